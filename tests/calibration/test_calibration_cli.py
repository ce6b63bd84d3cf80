"""The bayesfl-calibrate command: table, JSON and PNG from saved predictions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration.cli import main
from calibration.metrics import evaluate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    probs = random_probs(rng, 600, 5, scale=2.0).astype(np.float32)
    return probs, calibrated_labels(rng, probs ** 0.6), rng.integers(0, 4, 600)


def test_npz_gives_table_json_and_png(tmp_path, arrays, capsys):
    probs, labels, clients = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels, client_ids=clients)
    code = main([str(tmp_path / "p.npz"), "--bins", "10", "--json", str(tmp_path / "r.json"),
                 "--plot", str(tmp_path / "r.png"), "--markdown", str(tmp_path / "r.md")])
    out = capsys.readouterr().out
    assert code == 0
    assert "pooled (micro)" in out and "macro (mean over clients)" in out and "ECE" in out
    parsed = json.loads((tmp_path / "r.json").read_text())
    assert parsed["n_bins"] == 10 and len(parsed["clients"]) == 4
    assert parsed["pooled"]["ece"] == pytest.approx(evaluate(probs, labels, 10)["ece"], abs=1e-12)
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "r.md").read_text().startswith("| group |")


def test_csv_with_client_column_and_quantile_bins(tmp_path, arrays, capsys):
    probs, labels, clients = arrays
    lines = ["label,site,p0,p1,p2,p3,p4"]
    lines += [f"{y},s{c}," + ",".join(f"{v:.9g}" for v in row)
              for row, y, c in zip(probs, labels, clients, strict=True)]
    (tmp_path / "p.csv").write_text("\n".join(lines) + "\n")
    code = main([str(tmp_path / "p.csv"), "--client-column", "site", "--binning", "quantile",
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    parsed = json.loads((tmp_path / "r.json").read_text())
    assert parsed["binning"] == "quantile"
    assert [row["name"] for row in parsed["clients"]] == ["s0", "s1", "s2", "s3"]


def test_pt_logits_with_separate_labels(tmp_path, arrays, capsys):
    probs, labels, _ = arrays
    logits = torch.log(torch.tensor(probs))
    torch.save(logits, tmp_path / "logits.pt")
    np.save(tmp_path / "labels.npy", labels)
    code = main([str(tmp_path / "logits.pt"), "--logits", "--labels", str(tmp_path / "labels.npy"),
                 "--json", str(tmp_path / "r.json")])
    assert code == 0
    parsed = json.loads((tmp_path / "r.json").read_text())
    assert parsed["pooled"]["name"] == "all"
    assert parsed["pooled"]["ece"] == pytest.approx(evaluate(probs, labels)["ece"], abs=1e-6)


def test_bins_option_changes_the_result(tmp_path, arrays, capsys):
    probs, labels, _ = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels)
    values = []
    for bins in ("5", "20"):
        args = [str(tmp_path / "p.npz"), "--bins", bins, "--json", str(tmp_path / "r.json")]
        assert main(args) == 0
        values.append(json.loads((tmp_path / "r.json").read_text())["pooled"]["ece"])
    assert values[0] != values[1]


@pytest.mark.parametrize("problem", ["nan", "labels", "pickle", "missing", "plot"])
def test_bad_input_exits_nonzero_with_one_line_reason(tmp_path, arrays, capsys, problem):
    probs, labels, _ = arrays
    path = tmp_path / "p.npz"
    args = [str(path)]
    if problem == "nan":
        probs = probs.copy()
        probs[3, 1] = np.nan
        np.savez(path, probs=probs, labels=labels)
    elif problem == "labels":
        np.savez(path, probs=probs, labels=labels + 10)
    elif problem == "pickle":
        np.savez(path, probs=np.array([{}], dtype=object), labels=labels)
    elif problem == "missing":
        path = tmp_path / "absent.npz"
        args = [str(path)]
    else:
        np.savez(path, probs=probs, labels=labels)
        args += ["--plot", str(tmp_path / "diagram.gif")]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("bayesfl-calibrate: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_python_dash_m_calibration_runs_as_a_subprocess(tmp_path, arrays):
    probs, labels, clients = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels, client_ids=clients)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    done = subprocess.run([sys.executable, "-m", "calibration", str(tmp_path / "p.npz"),
                           "--plot", str(tmp_path / "d.png")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pooled (micro)" in done.stdout
    assert (tmp_path / "d.png").read_bytes().startswith(b"\x89PNG")


# -- every failure: one line, a non-zero exit, no traceback ------------------------------------
def one_line_failure(capsys, args, code=1):
    """Run the CLI on ``args``; check the exit code and the single error line; return it."""
    assert main([str(a) for a in args]) == code
    captured = capsys.readouterr()
    assert captured.err.startswith("bayesfl-calibrate: error: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def npy_header(shape) -> bytes:
    import io

    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        stream, {"descr": "<f8", "fortran_order": False, "shape": shape})
    return stream.getvalue()


@pytest.fixture
def saved(tmp_path, arrays):
    probs, labels, clients = arrays
    np.savez(tmp_path / "p.npz", probs=probs, labels=labels, client_ids=clients)
    return tmp_path / "p.npz"


@pytest.mark.parametrize(("bins", "message"), [
    ("10000000000", "n_bins = 10,000,000,000 exceeds the limit of 1,000,000"),
    ("100000000", "n_bins = 100,000,000 exceeds the limit of 1,000,000"),
    ("0", "n_bins must be a positive integer; got 0"),
])
def test_too_many_bins_are_refused_before_the_file_is_read(tmp_path, capsys, bins, message):
    missing = tmp_path / "not-read.npz"  # refused before it would be found missing
    assert message in one_line_failure(capsys, [missing, "--bins", bins])


@pytest.mark.parametrize("args", [["--bins", "abc"], ["--binning", "adaptive"],
                                  ["--max-bytes", "4Q"], ["--max-bytes", "0"], ["--nonsense"]])
def test_usage_errors_are_one_line_with_exit_2(saved, capsys, args):
    err = one_line_failure(capsys, [saved, *args], code=2)
    assert "--help" in err


def test_max_bytes_accepts_sizes_with_units(saved, capsys):
    assert main([str(saved), "--max-bytes", "1G"]) == 0
    err = one_line_failure(capsys, [saved, "--max-bytes", "1k"])
    assert "more than the limit of 1 kB (1,000 bytes)" in err


def test_file_problems_are_one_line(tmp_path, capsys):
    (tmp_path / "dir.npz").mkdir()
    assert "is a directory" in one_line_failure(capsys, [tmp_path / "dir.npz"])
    (tmp_path / "huge.npy").write_bytes(npy_header((10**12, 2)))
    err = one_line_failure(capsys, [tmp_path / "huge.npy", "--labels", tmp_path / "huge.npy"])
    assert "1,000,000,000,000 x 2 float64 values" in err
    (tmp_path / "a.npz").symlink_to(tmp_path / "b.npz")
    (tmp_path / "b.npz").symlink_to(tmp_path / "a.npz")
    assert "symbolic link loop" in one_line_failure(capsys, [tmp_path / "a.npz"])
    if os.path.exists("/dev/zero"):
        assert "character device" in one_line_failure(capsys, ["/dev/zero"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_is_refused_without_blocking(tmp_path, capsys):
    os.mkfifo(tmp_path / "p.npz")
    assert "named pipe (FIFO)" in one_line_failure(capsys, [tmp_path / "p.npz"])


def test_input_problems_are_one_line(tmp_path, arrays, capsys):
    probs, labels, clients = arrays
    np.savez(tmp_path / "text.npz", probs=probs.astype(str), labels=labels)
    assert "holds text" in one_line_failure(capsys, [tmp_path / "text.npz"])
    ids = clients.astype(float)
    ids[5] = np.nan
    np.savez(tmp_path / "nan.npz", probs=probs, labels=labels, client_ids=ids)
    assert "client_ids[5] is missing (NaN)" in one_line_failure(capsys, [tmp_path / "nan.npz"])


def test_big_endian_arrays_are_scored(tmp_path, arrays, capsys):
    probs, labels, _ = arrays
    np.savez(tmp_path / "be.npz", probs=probs.astype(">f4"), labels=labels.astype(">i8"))
    assert main([str(tmp_path / "be.npz"), "--json", str(tmp_path / "r.json")]) == 0
    parsed = json.loads((tmp_path / "r.json").read_text())
    assert parsed["pooled"]["ece"] == pytest.approx(evaluate(probs, labels)["ece"], abs=1e-12)


def test_an_output_path_that_is_a_directory_is_refused_first(saved, tmp_path, capsys):
    (tmp_path / "out.json").mkdir()
    err = one_line_failure(capsys, [saved, "--json", tmp_path / "out.json"])
    assert "--json" in err and "is a directory" in err


def test_a_pandas_csv_with_its_index_and_all_rows_bad(tmp_path, capsys):
    """The index column is ignored (one warning line); rows that are all bad are all counted."""
    import pandas as pd

    rng = np.random.default_rng(3)
    probs = random_probs(rng, 444, 3)
    frame = pd.DataFrame(probs, columns=["a", "b", "c"])
    frame["label"] = calibrated_labels(rng, probs)
    frame["client_id"] = rng.integers(0, 19, 444)
    frame.to_csv(tmp_path / "good.csv")
    assert main([str(tmp_path / "good.csv")]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("bayesfl-calibrate: warning: good.csv: ignoring the first")
    assert captured.err.count("\n") == 1 and "pooled (micro)" in captured.out

    frame[["a", "b", "c"]] *= 2
    frame.to_csv(tmp_path / "bad.csv", index=False)
    err = one_line_failure(capsys, [tmp_path / "bad.csv"])
    assert "row 0 sums to 2 (444 bad rows)" in err


@pytest.mark.parametrize(("raised", "code", "message"), [
    (RuntimeError("boom\nsecond line"), 1, "unexpected RuntimeError: boom second line"),
    (MemoryError(), 1, "out of memory"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_unexpected_failures_are_one_line(saved, capsys, monkeypatch, raised, code, message):
    import calibration.cli as cli

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(cli, "report", fail)
    monkeypatch.delenv("BAYESFL_TRACEBACK", raising=False)
    assert message in one_line_failure(capsys, [saved], code=code)


def test_a_traceback_can_be_asked_for(saved, monkeypatch):
    import calibration.cli as cli

    monkeypatch.setattr(cli, "report", lambda *a, **k: 1 / 0)
    monkeypatch.setenv("BAYESFL_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        main([str(saved)])


@pytest.mark.slow  # two interpreters that import torch: ~5-20 s on a busy machine
def test_a_separate_process_prints_exactly_one_line(tmp_path):
    """A usage error (exit 2) and an input error (exit 1: the path is a directory)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("BAYESFL_TRACEBACK", None)
    for args in (["--bins", "x"], []):
        done = subprocess.run([sys.executable, "-m", "calibration", str(tmp_path), *args],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode in (1, 2) and done.stdout == ""
        assert done.stderr.startswith("bayesfl-calibrate: error: ")
        assert done.stderr.count("\n") == 1, done.stderr
