"""The ``bayesfl`` command line: runs, TOML configs, and one-line errors with exit code 2."""

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

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


# ---- one vocabulary: flags and TOML keys --------------------------------------------------
def test_every_config_field_and_run_keyword_has_a_flag():
    from bayesfl.cli import SETTINGS
    from bayesfl.config import CONFIG_FIELDS

    targets = {s.target for s in SETTINGS}
    assert set(CONFIG_FIELDS) <= targets, "a SimulationConfig field without a CLI flag"
    assert {"out", "resume", "force", "progress", "threads"} <= targets


def test_the_flag_names_are_the_toml_keys(tmp_path):
    """Each setting written under its flag name (and its alias, with - or _) means what the
    flag means."""
    written = ('strategy = "fedavg"\nrounds = 1\nbins = 7\nlocal_epochs = 1\n'
               'no-progress = true\nno_batched = true\nthreads = 1\nfeature-dim = 4\n'
               'dataset = "gaussian_mixture"\nclients = 5\nbody = "mlp:8"\nbatch-size = 32\n'
               f'out = "{tmp_path / "run"}"\n'
               'dataset-option = ["n=300"]\n[option]\nnorm_bound = 5.0\n')
    config = tmp_path / "run.toml"
    config.write_text(written)
    assert main(["run", "--config", str(config)]) == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["n_bins"] == 7 and manifest["config"]["batched"] is False
    assert manifest["config"]["strategy_options"] == {"norm_bound": 5.0}
    assert manifest["config"]["dataset_options"] == {"n": 300}
    assert manifest["threads"] == 1
    # resume = true in the file continues the finished run (no refusal of the directory)
    config.write_text(written + "")
    resumed = tmp_path / "resume.toml"
    resumed.write_text(written.replace("[option]", "resume = true\n[option]"))
    assert main(["run", "--config", str(resumed)]) == 0


def test_the_python_names_are_accepted_as_aliases(tmp_path):
    from bayesfl.cli import settings_from_mapping

    settings = settings_from_mapping({"n_bins": 7, "strategy_options": {"alpha": 0.1},
                                      "dataset-options": {"n": 5}, "batched": False})
    assert settings == {"n_bins": 7, "strategy_options": {"alpha": 0.1},
                        "dataset_options": {"n": 5}, "batched": False}


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('rounds = "ten"', "rounds must be an integer, got 'ten' (a string)"),
        ('fraction = "half"', "fraction must be a number, got 'half' (a string)"),
        ("seed = 1e3", "seed must be an integer, got 1000.0 (a float)"),
        ("clients = true", "clients must be an integer, got True (a boolean)"),
        ('batched = "no"', "batched must be true or false, got 'no' (a string)"),
        ('no-progress = "yes"', "no-progress must be true or false"),
        ("seed = -5", "seed must be between 0 and"),
        ("threads = 0", "threads must be between 1 and 1,024, got 0"),
        ("option = 5", "option must be a table ([option] with KEY = VALUE lines) or a list"),
        ("learning_rate = 0.1", "unknown key 'learning_rate'; valid keys are the flags of "
                                "`bayesfl run` (- or _): strategy, dataset"),
        ("bin = 15", "unknown key 'bin' (did you mean 'bins'?)"),
        ("bins = 10\nn_bins = 12", "n_bins is given twice (as 'bins' and 'n_bins'); keep one"),
        ('config = "other.toml"', "a config file cannot name another config file"),
        ("rounds = ", "is not valid TOML"),
    ],
)
def test_bad_toml_values_name_the_file_and_the_key(tmp_path, capsys, toml, expected):
    config = tmp_path / "run.toml"
    config.write_text(toml + "\n")
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bayesfl: error: config {config}") and expected in err
    assert err.count("\n") == 1
    assert not (tmp_path / "x").exists()  # refused before anything was written


@pytest.mark.parametrize("where", ["toml", "flag"])
def test_a_dataset_option_of_the_wrong_type_is_a_one_line_error(tmp_path, capsys, where):
    config = tmp_path / "run.toml"
    config.write_text('strategy = "fedavg"\ndataset = "gaussian_mixture"\nclients = 4\n'
                      + ('[dataset_options]\nn = "many"\n' if where == "toml" else ""))
    flags = ["--dataset-option", "n=many"] if where == "flag" else []
    assert main(["run", "--config", str(config), "--out", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == ("bayesfl: error: dataset 'gaussian_mixture' option n must be an integer, "
                   "got 'many' (a string)\n")
    assert not (tmp_path / "x").exists()  # refused before anything was written


@pytest.mark.parametrize(("content", "expected"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "is not a text file (not UTF-8"),
    (b"\x00\x01\x02rounds = 1", "is not valid TOML"),
])
def test_a_binary_config_file_is_a_one_line_error(tmp_path, capsys, content, expected):
    config = tmp_path / "run.toml"
    config.write_bytes(content)
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_a_config_that_is_not_a_regular_file_is_named_so(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- bad values on the command line --------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--seed", "-5"], "seed must be between 0 and 9,223,372,036,854,775,807, got -5"),
        (["--device", "bogus"], "unknown device 'bogus'; use cpu, cuda, cuda:N or mps"),
        (["--feature-dim", "1000000000"], "feature_dim must be between 1 and 16,384, got "
                                          "1,000,000,000"),
        (["--bins", "10000000000"], "n_bins must be between 1 and 10,000, got 10,000,000,000"),
        (["--body", "mlp:1000000000"], "parameters together"),
        (["--strategy", "fedlog-dp-local", "--option", "clip=inf"],
         "strategy_options clip=inf: an option value must be a finite number"),
        (["--strategy", "fedlog-dp-local", "--option", "clip=-1"], "DP needs epsilon > 0"),
        (["--strategy", "fedlog-dp-local", "--option", "epsilon=1e-300"],
         "fedlog-dp-local epsilon=1e-300 is out of range"),
        (["--strategy", "fedlog", "--option", "prior_nu=1e300"],
         "prior_nu must be a number in [0, 1e+09], got 1e+300"),
        (["--lr", "1e10"], "lr must be at most 1, got 1e+10"),
        (["--resume", "--force"], "resume and force contradict each other"),
    ],
)
def test_bad_values_give_one_line_errors_without_traceback(tmp_path, capsys, args, expected):
    assert main(["run", *TINY, "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bayesfl: error: ") and expected in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("error", ["inference", "calibration", "os"])
def test_errors_of_the_other_layers_are_one_line_errors_too(tmp_path, capsys, monkeypatch,
                                                            error):
    """A bad value that only the inference or calibration layer detects (or a failed write)
    is reported like a configuration error, not as a traceback."""
    from calibration.errors import InvalidInputError as CalibrationInputError
    from inference.errors import InvalidInputError as InferenceInputError

    raised = {"inference": InferenceInputError("bound must be a finite number > 0, got inf"),
              "calibration": CalibrationInputError("n_bins must be a positive integer"),
              "os": PermissionError(13, "Permission denied", "/runs/x")}[error]

    def failing(*args, **kwargs):
        raise raised

    monkeypatch.setattr(sys.modules["bayesfl.simulate"], "simulate", failing)
    assert main(["run", *TINY, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == f"bayesfl: error: {raised}\n"


def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["run", *TINY, "--out", str(tmp_path / "x"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available here" in err and "use --device cpu" in err
    assert not (tmp_path / "x").exists()


def test_a_batch_larger_than_any_client_is_full_batch_training(tmp_path):
    runs = {}
    for size in ("1000000000", "1000000", "48"):  # 48 >= every client's training set here
        out = tmp_path / size
        assert main(["run", *TINY, "--rounds", "2", "--batch-size", size, "--out", str(out)]) == 0
        runs[size] = [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
                      for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert runs["1000000000"] == runs["1000000"] == runs["48"]


# ---- run directories -----------------------------------------------------------------------
def test_a_non_empty_run_directory_is_refused_unless_resume_or_force(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *TINY, "--out", str(out)]) == 0
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["run", *TINY, "--seed", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"run directory {out} is not empty" in err
    assert "--resume" in err and "--force" in err and err.count("\n") == 1
    assert (out / "metrics.jsonl").read_text() == first  # untouched
    (out / "notes.txt").write_text("mine")
    assert main(["run", *TINY, "--seed", "5", "--out", str(out), "--force"]) == 0
    assert (out / "metrics.jsonl").read_text() != first
    assert (out / "notes.txt").read_text() == "mine"  # --force removes only a run's files


def test_resume_without_a_checkpoint_says_it_starts_from_the_first_round(tmp_path, capsys):
    assert main(["run", *TINY, "--out", str(tmp_path / "typo"), "--resume"]) == 0
    assert f"no checkpoint in {tmp_path / 'typo'} yet" in capsys.readouterr().err


def test_flags_are_not_abbreviated(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--round", "2"])  # a TOML key must be the whole name, and so must a flag
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --round 2" in capsys.readouterr().err


def test_a_file_where_the_run_directory_should_be_is_refused(tmp_path, capsys):
    (tmp_path / "run").write_text("")
    assert main(["run", *TINY, "--out", str(tmp_path / "run")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


# ---- Ctrl-C --------------------------------------------------------------------------------
def _interrupt_after_round(monkeypatch, stop_round):
    simulate_module = sys.modules["bayesfl.simulate"]
    real = simulate_module.simulate

    def interrupted(*args, **kwargs):
        def callback(r, record):
            if r == stop_round:
                raise KeyboardInterrupt
        return real(*args, round_callback=callback, **kwargs)

    monkeypatch.setattr(simulate_module, "simulate", interrupted)


def test_ctrl_c_prints_the_exact_resume_command_and_exits_130(tmp_path, capsys, monkeypatch):
    full = tmp_path / "full"
    args = ["run", *TINY, "--rounds", "3", "--force"]
    assert main([*args, "--out", str(full)]) == 0
    monkeypatch.chdir(tmp_path)
    _interrupt_after_round(monkeypatch, 1)
    capsys.readouterr()
    assert main(args) == 130  # default --out: runs/fedlog_gaussian_mixture_seed0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    command = err.split("continue the run with: ")[1].strip()
    words = shlex.split(command)
    assert words[0] == "bayesfl" and "--resume" in words and "--force" not in words
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(words[1:]) == 0

    def numbers(path):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    out = tmp_path / "runs" / "fedlog_gaussian_mixture_seed0"
    assert numbers(out) == numbers(full)


# The child runs the real CLI; the only addition is a round callback that, after round 3 is
# checkpointed, writes a marker and waits. The test signals only once the marker exists, so the
# SIGINT always lands mid-run (37 rounds remain) whatever the machine's load: no wall-clock guess.
INTERRUPTIBLE_CLI = """
import importlib, signal, sys, time
from pathlib import Path

# Ctrl-C as in a terminal, even when the tests were started from a shell without job control
# in the background, which makes its children inherit SIGINT ignored (Python then installs no
# KeyboardInterrupt handler, and the SIGINT below would be lost)
signal.signal(signal.SIGINT, signal.default_int_handler)

engine = importlib.import_module("bayesfl.simulate")  # the module: bayesfl.simulate is the function
real_simulate, marker = engine.simulate, Path(sys.argv[1])

def wait_after_round_3(r, record):
    if r == 3:
        marker.write_text("3")
        time.sleep(600)  # the SIGINT interrupts this sleep

def simulate(*args, **kwargs):
    return real_simulate(*args, round_callback=wait_after_round_3, **kwargs)

engine.simulate = simulate
from bayesfl.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_sigint_to_a_real_process_leaves_a_resumable_run(tmp_path):
    """The real thing: SIGINT to a `bayesfl run` process mid-run; then the printed command."""
    out, marker = tmp_path / "run", tmp_path / "round-3-done"
    args = ["run", *TINY, "--rounds", "40", "--out", str(out)]
    process = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE_CLI, str(marker), *args],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 300  # only a bound on a hung child; never reached normally
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), process.communicate(timeout=60)[1]
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # rounds 0-3: stopped in 3
    words = shlex.split(err.split("continue the run with: ")[1])
    assert main(words[1:]) == 0
    full = tmp_path / "full"
    assert main([*args[:-1], str(full)]) == 0

    def numbers(path):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert numbers(out) == numbers(full)


# ---- the README's examples -----------------------------------------------------------------
README = Path(__file__).resolve().parents[2] / "README.md"
QUICK = ["--rounds", "1", "--local-epochs", "1", "--no-progress"]  # appended: flags win


def readme_run_commands(text: str) -> list[list[str]]:
    """The arguments of every `bayesfl run` line in the README's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        block = block.replace("\\\n", " ")  # a shell line continued with a backslash
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["bayesfl", "run"]:
                commands.append(words[1:])
    return commands


def readme_toml_files(text: str) -> dict[str, str]:
    """TOML blocks of the README by the file name their first line names (``# NAME.toml``)."""
    files = {}
    for block in re.findall(r"```toml\n(.*?)```", text, flags=re.S):
        name = re.match(r"#\s*(\S+\.toml)", block)
        assert name, f"a README TOML block must start with '# NAME.toml': {block[:60]!r}"
        files[name.group(1)] = block
    return files


def test_the_readme_toml_examples_use_only_valid_keys():
    from bayesfl.cli import settings_from_mapping

    files = readme_toml_files(README.read_text())
    for name, text in files.items():
        settings_from_mapping(tomllib.loads(text), source=f"README {name}")  # raises if not


@pytest.mark.slow
def test_the_readme_run_commands_work(tmp_path, monkeypatch):
    text = README.read_text()
    commands, files = readme_run_commands(text), readme_toml_files(text)
    assert commands, "the README shows no `bayesfl run` command"
    for i, words in enumerate(commands):
        where = tmp_path / str(i)  # each example on its own, as a reader would try it
        where.mkdir()
        monkeypatch.chdir(where)
        if "--config" in words:
            name = words[words.index("--config") + 1]
            assert name in files, f"the README runs --config {name} but shows no TOML block " \
                                  f"starting '# {name}'"
            (where / name).write_text(files[name])
        assert main([*words, *QUICK]) == 0, f"README example failed: bayesfl {shlex.join(words)}"
