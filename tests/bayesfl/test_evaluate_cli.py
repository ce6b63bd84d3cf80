"""``bayesfl evaluate RUN_DIR``: a small real run (``bayesfl run``, digits), the files it writes,
and its one-line refusals of bad input."""

from __future__ import annotations

import json

import pytest

from bayesfl.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate") / "run"
    code = main(["run", "--strategy", "fedlog", "--dataset", "digits", "--clients", "6",
                 "--partition", "labels:5", "--rounds", "1", "--seed", "1", "--body", "mlp:32",
                 "--feature-dim", "16", "--local-epochs", "1", "--no-progress",
                 "--out", str(out)])
    assert code == 0
    return out


def test_evaluate_writes_the_report_files_and_prints_the_tables(run_dir, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "report"
    code = main(["evaluate", str(run_dir), "--shift", "rotate:15,90", "--shift", "noise:0.1",
                 "--ood", "unseen-labels", "--out", str(out), "--seed", "3",
                 "--posterior-samples", "4", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    for name in ("shift_report.json", "shift_report.md", "shift_metrics.png",
                 "risk_coverage.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "shift_report.json").read_text())
    assert report["settings"]["shifts"] == {"rotate": [15.0, 90.0], "noise": [0.1]}
    assert report["settings"]["seed"] == 3 and report["predictives"] == ["predictive",
                                                                          "map_plugin"]
    pooled = [r for r in report["shift"] if r["scope"] == "pooled"]
    assert {(r["shift"], r["severity"]) for r in pooled} == {
        ("none", 0.0), ("rotate", 15.0), ("rotate", 90.0), ("noise", 0.1)}
    assert {r["score"] for r in report["ood"]} == {"entropy", "max_prob", "mutual_information"}
    assert "### rotate (degrees)" in printed and "unseen-labels" in printed
    assert (out / "shift_report.md").read_text() in printed
    # the default output directory is RUN_DIR/shift
    assert main(["evaluate", str(run_dir), "--shift", "contrast:0.5", "--no-progress",
                 "--no-plots", "--posterior-samples", "0"]) == 0
    assert (run_dir / "shift" / "shift_report.md").is_file()
    assert not (run_dir / "shift" / "shift_metrics.png").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--shift", "blur:1"], "unknown shift 'blur'"),
    (["--shift", "rot:15"], "did you mean 'rotate'"),
    (["--shift", "rotate:fifteen"], "not a number"),
    (["--shift", "contrast:1.5"], "outside [0, 1]"),
    (["--shift", "noise:-0.1"], "outside"),
    (["--ood", "unseen"], "unknown ood set 'unseen'; valid: unseen-labels, novel-clients"),
    (["--ood", "novel-clients"], "no novel clients"),
    ([], "nothing to evaluate"),
    (["--shift", "rotate:15", "--image-shape", "1,9,9"], "does not fit"),
])
def test_evaluate_refuses_bad_input_in_one_line(run_dir, capsys, flags, message):
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), *flags, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("bayesfl: error: ") and err.count("\n") == 1


def test_evaluate_refuses_what_is_not_a_finished_run(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "missing"), "--shift", "noise:0.1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["evaluate", str(empty), "--shift", "noise:0.1"]) == 2
    assert "holds no finished run" in capsys.readouterr().err
    # a Flower run directory: the clients' states stayed at their sites
    flower = tmp_path / "flower"
    flower.mkdir()
    (flower / "summary.json").write_text(json.dumps({"transport": "flower"}))
    assert main(["evaluate", str(flower), "--shift", "noise:0.1"]) == 2
    assert "Flower run" in capsys.readouterr().err


def test_rotate_on_data_that_are_not_images_is_refused(tmp_path, capsys):
    out = tmp_path / "mixture"
    assert main(["run", "--strategy", "fedavg", "--dataset", "gaussian_mixture", "--clients",
                 "3", "--partition", "iid", "--rounds", "1", "--body", "mlp:8",
                 "--feature-dim", "4", "--dataset-option", "n=90", "--dataset-option",
                 "num_classes=3", "--dataset-option", "dim=5", "--no-progress",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(out), "--shift", "rotate:15", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "needs images" in err and "--image-shape" in err and "noise" in err
    assert main(["evaluate", str(out), "--ood", "unseen-labels", "--no-progress"]) == 2
    assert "every client trained on every label" in capsys.readouterr().err
