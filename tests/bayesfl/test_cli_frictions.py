"""``bayesfl run`` where a new user stumbled (issue 26): the default partition works for any
number of clients, ``--rounds 0`` is defined and says what it did, a missing data set names the
flag that downloads it, and the Flower command names each of its durations."""

import json

import numpy as np
import pytest

from bayesfl.cli import main
from bayesfl.data.partition import PartitionScheme, partition
from bayesfl.flower.command import durations_line

# small and quick: digits (10 classes), one round of one epoch
QUICK = ["--rounds", "1", "--local-epochs", "1", "--no-progress", "--threads", "1",
         "--body", "mlp:16", "--feature-dim", "8"]


# ---- the default partition -------------------------------------------------------------------
@pytest.mark.parametrize("clients", [2, 3, 4])
def test_the_default_partition_runs_with_fewer_clients_than_half_the_classes(tmp_path,
                                                                             clients):
    # `shards:2` cannot cover digits' 10 classes with fewer than 5 clients; the default can
    out = tmp_path / "run"
    assert main(["run", "--clients", str(clients), "--out", str(out), *QUICK]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"] == clients and summary["partition"] == "shards"
    counts = np.array(json.loads((out / "partition.json").read_text())["counts"])
    held = (counts > 0).sum(1)  # classes per client: as few as cover all 10
    assert (counts.sum(0) > 0).all()
    assert (held == -(-10 // clients)).all(), held


@pytest.mark.parametrize(("clients", "per_client"), [(1, 10), (2, 5), (3, 4), (4, 3), (5, 2),
                                                      (20, 2)])
def test_plain_shards_is_shards_2_where_that_covers_every_class(clients, per_client):
    labels = np.repeat(np.arange(10), 40)
    parts = partition(labels, clients, "shards", seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(400))  # each sample once
    assert [len(np.unique(labels[p])) for p in parts] == [per_client] * clients
    if clients >= 5:  # the same partition as the explicit scheme, sample for sample
        explicit = partition(labels, clients, "shards:2", seed=0)
        assert all(np.array_equal(a, b) for a, b in zip(parts, explicit, strict=True))
    assert str(PartitionScheme.parse("shards")) == "shards"


# ---- --rounds 0 ------------------------------------------------------------------------------
def test_zero_rounds_evaluates_the_initial_model_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--strategy", "fedavg", "--clients", "5", "--out", str(out), *QUICK]
    assert main([*args, "--rounds", "0"]) == 0
    printed = capsys.readouterr().out
    assert "0 rounds: nothing was trained" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 0 and summary["bytes_up"] == 0  # no client sent anything
    assert main([*args, "--rounds", "-1"]) == 2  # a negative count is refused, one line
    assert "rounds must be >= 0, got -1" in capsys.readouterr().err


# ---- data sets that need files ---------------------------------------------------------------
def test_a_missing_data_set_names_the_download_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BAYESFL_DATA_ROOT", str(tmp_path / "empty"))
    code = main(["run", "--dataset", "mnist", "--clients", "3", "--out", str(tmp_path / "r"),
                 *QUICK])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "pass --download" in err and "download=True" not in err  # the CLI's spelling


def test_download_is_a_flag_and_a_toml_key_for_the_data_set_option():
    from bayesfl.settings import read_config, settings_from_mapping

    assert settings_from_mapping({"dataset": "mnist", "download": True}) == {
        "dataset": "mnist", "dataset_options": {"download": True}}
    merged = settings_from_mapping({"dataset-option": ["split=train"], "download": True})
    assert merged["dataset_options"] == {"split": "train", "download": True}
    assert callable(read_config)


def test_download_with_a_data_set_that_has_no_files_is_a_one_line_error(tmp_path, capsys):
    assert main(["run", "--download", "--out", str(tmp_path / "r"), *QUICK]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "download" in err and "digits" in err


# ---- Flower's durations ----------------------------------------------------------------------
def test_the_flower_command_names_each_duration_for_what_it_spans():
    line = durations_line(131.04, 125.2, 106.5)
    assert line == ("time: wall_s 131.0 (the whole command), run_s 125.2 (the Flower run, "
                    "submission to final status), rounds_s 106.5 (the ServerApp's rounds, "
                    "summary.json seconds)")
    assert "rounds_s" not in durations_line(10.0, 9.0, None)


@pytest.mark.parametrize("args", [["strategies"], ["strategies", "fedavg"], ["--help"],
                                  ["run", "--help"]])
def test_a_listing_piped_into_head_that_has_left_ends_quietly(args):
    # `bayesfl strategies fedavg | head -1` as a user's shell runs it: Python's stdout to a pipe
    # is block-buffered (no PYTHONUNBUFFERED), so a listing shorter than the buffer is written
    # only when the interpreter flushes it on exit. `head -1` has read its line and left before
    # the listing comes (the sleep), so that flush meets a closed pipe: the command must still
    # end quietly, as it does when the write fails earlier.
    import os
    import shlex
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    command = shlex.join([sys.executable, "-m", "bayesfl", *args])
    script = f"set -o pipefail; {{ echo first; sleep 1; {command}; }} | head -1; echo \"rc=$?\""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    assert done.stdout.splitlines() == ["first", "rc=0"], done.stdout
    assert done.stderr == ""


def test_a_reader_that_leaves_early_ends_the_listing_quietly():
    # `bayesfl strategies | head -1`: the reader closes the pipe before the listing is written.
    # Closing our end first makes every write fail, whatever the pipe buffer holds.
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run([sys.executable, "-m", "bayesfl", "strategies"], stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    os.close(write_end)
    assert done.returncode == 0
    assert done.stderr == ""
