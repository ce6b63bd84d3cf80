"""``make demo`` (``python -m bayesfl.demo``): runs again over its own results, never over
someone else's run."""

import json

import pytest

from bayesfl.demo import main


@pytest.mark.slow
def test_the_demo_runs_twice_into_the_same_directory(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["--rounds", "1", "--out", str(out), "--no-progress", "--threads", "1"]
    assert main(args) == 0
    first = json.loads((out / "fedlog" / "summary.json").read_text())
    assert main([*args[:1], "2", *args[2:]]) == 0  # again, now 2 rounds: replaced, not refused
    second = json.loads((out / "fedlog" / "summary.json").read_text())
    assert (first["rounds"], second["rounds"]) == (1, 2)
    metrics = (out / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in metrics] == [1, 2]
    assert (out / "accuracy.png").exists() and (out / "comparison.md").exists()
    assert "FedLog uploads" in capsys.readouterr().out


def test_the_demo_refuses_a_bayesfl_run_directory_unless_forced(tmp_path, capsys):
    from bayesfl.demo import check_demo_directory
    from bayesfl.errors import ConfigError

    (tmp_path / "manifest.json").write_text("{}")
    assert main(["--rounds", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds a `bayesfl run` directory (manifest.json)" in err and "--force" in err
    with pytest.raises(ConfigError):
        check_demo_directory(tmp_path, force=False)
    check_demo_directory(tmp_path, force=True)  # forced: accepted
