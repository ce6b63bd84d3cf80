"""The ``bayesfl`` command line: runs, TOML configs, and one-line errors with exit code 2."""

import json

import pytest

from bayesfl.cli import main, parse_options

TINY = ["--dataset", "gaussian_mixture", "--dataset-option", "n=300", "--clients", "5",
        "--partition", "shards:2",
        "--rounds", "1", "--body", "mlp:8", "--feature-dim", "4", "--local-epochs", "1",
        "--batch-size", "32", "--no-progress"]


def test_run_writes_a_run_directory_and_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--strategy", "fedlog", "--seed", "1", "--out", str(out), *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedlog" and summary["clients"] == 5
    printed = capsys.readouterr().out
    assert "accuracy" in printed and str(out) in printed


def test_toml_config_sets_options_and_flags_override_it(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('strategy = "fedavg"\nrounds = 5\nlocal-epochs = 1\nseed = 2\n'
                      '[dataset_options]\nn = 200\ndim = 5\n')
    out = tmp_path / "run"
    assert main(["run", "--config", str(config), *TINY, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert summary["strategy"] == "fedavg" and summary["seed"] == 2
    assert summary["rounds"] == 1  # the flag wins over the file
    # the command line's n=300 wins over the file's n=200; the file's dim stays
    assert manifest["config"]["dataset_options"] == {"n": 300, "dim": 5}


def test_resume_flag_continues_a_finished_run(tmp_path):
    out = str(tmp_path / "run")
    assert main(["run", "--out", out, *TINY]) == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert main(["run", "--out", out, "--resume", *TINY]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "fedsgd"], "unknown strategy 'fedsgd'; valid names: fedlog"),
        (["--dataset", "imagenet"], "unknown dataset 'imagenet'; valid names: digits"),
        (["--partition", "zipf:2"], "zipf"),
        (["--body", "transformer:4"], "transformer"),
        (["--option", "nonsense=1"], "unknown option(s) ['nonsense'] for strategy 'fedlog'"),
    ],
)
def test_bad_names_give_one_line_errors_and_exit_code_2(tmp_path, capsys, args, expected):
    code = main(["run", *TINY, "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("bayesfl: error: ") and expected in err
    assert err.count("\n") == 1


def test_a_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.safetensors").write_bytes(b"garbage")
    assert main(["run", "--out", str(out), "--resume", *TINY]) == 2
    assert "corrupt" in capsys.readouterr().err


def test_unknown_settings_in_a_config_file_are_rejected(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("learning_rate = 0.1\n")
    assert main(["run", "--config", str(config), *TINY]) == 2
    assert "learning_rate" in capsys.readouterr().err


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2


def test_strategies_lists_every_registered_name(capsys):
    assert main(["strategies"]) == 0
    listed = capsys.readouterr().out
    for name in ("fedlog", "fedlog-c", "fedavg", "fedper", "fedrep", "lg-fedavg", "fedbabu",
                 "fedproto", "fedlog-dp-local", "fedlog-dp-central"):
        assert name in listed


def test_options_are_parsed_as_toml_literals():
    assert parse_options(["alpha=0.01", "upload-dtype=float64", "flag=true"]) == {
        "alpha": 0.01, "upload_dtype": "float64", "flag": True}
