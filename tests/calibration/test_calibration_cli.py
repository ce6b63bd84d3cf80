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
