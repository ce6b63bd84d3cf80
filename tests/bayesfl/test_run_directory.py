"""Run directories: who may write into one, what --force removes, and the metrics log."""

import json

import pytest

from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.run_directory import (
    CHECKPOINT_NAME,
    RUN_FILES,
    MetricsLog,
    parse_metrics,
    prepare_run_directory,
)


def test_an_absent_or_empty_directory_is_used(tmp_path):
    prepare_run_directory(tmp_path / "a" / "b", resume=False, force=False)
    assert (tmp_path / "a" / "b").is_dir()
    prepare_run_directory(tmp_path / "a" / "b", resume=False, force=False)  # still empty


def test_a_non_empty_directory_is_refused_with_what_it_holds(tmp_path):
    for i in range(7):
        (tmp_path / f"f{i}").write_text("")
    with pytest.raises(ConfigError) as info:
        prepare_run_directory(tmp_path, resume=False, force=False)
    message = str(info.value)
    assert "is not empty (it holds f0, f1, f2, f3, f4 and 2 more)" in message
    assert "--resume (resume=True)" in message and "--force (force=True)" in message
    prepare_run_directory(tmp_path, resume=True, force=False)  # resume: accepted as it is
    assert len(list(tmp_path.iterdir())) == 7


def test_force_removes_the_files_a_run_writes_and_nothing_else(tmp_path):
    for name in RUN_FILES:
        (tmp_path / name).write_text("old")
    (tmp_path / f".{CHECKPOINT_NAME}.x1y2.tmp").write_text("torn")  # a kill mid-write
    (tmp_path / f".{CHECKPOINT_NAME}.spare.tmp").write_text("older")  # the one before last
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "plots").mkdir()
    (tmp_path / "summary.json.bak").write_text("mine too")
    prepare_run_directory(tmp_path, resume=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "plots",
                                                           "summary.json.bak"]


def test_force_does_not_remove_a_directory_named_like_a_run_file(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    prepare_run_directory(tmp_path, resume=False, force=True)
    assert (tmp_path / "metrics.jsonl").is_dir()


def test_resume_removes_the_temp_files_of_unfinished_checkpoint_writes(tmp_path):
    """kill -9 during a checkpoint's write leaves its temp file (the rename never came)."""
    (tmp_path / f".{CHECKPOINT_NAME}.x1y2.tmp").write_text("torn")
    (tmp_path / f".{CHECKPOINT_NAME}.spare.tmp").write_text("older")  # a killed run's spare
    (tmp_path / CHECKPOINT_NAME).write_text("kept")
    (tmp_path / ".notes.tmp").write_text("mine")
    prepare_run_directory(tmp_path, resume=True, force=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp", CHECKPOINT_NAME]


def test_resume_and_force_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="contradict each other"):
        prepare_run_directory(tmp_path, resume=True, force=True)


def test_a_file_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        prepare_run_directory(tmp_path / "run", resume=True, force=False)


def test_the_metrics_log_appends_and_restores_what_it_wrote(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.start()
    for r in (0, 1, 2):
        log.append({"round": r, "accuracy": r / 10})
    assert (tmp_path / "metrics.jsonl").read_bytes() == bytes(log.text)
    saved = bytes(log.text)
    (tmp_path / "metrics.jsonl").write_text("damaged")
    other = MetricsLog(tmp_path / "metrics.jsonl")
    other.restore(saved, [0, 1, 2])
    assert other.records == [{"round": r, "accuracy": r / 10} for r in (0, 1, 2)]
    assert (tmp_path / "metrics.jsonl").read_bytes() == saved


@pytest.mark.parametrize(("text", "expected"), [
    (b"\xff\xfe", "not JSON lines"),
    (b'{"round": 0}\n{"round": 1', "not JSON lines"),
    (b'{"round": 0}\n{"accuracy": 1}\n', "rounds [0, None] where [0, 1] were expected"),
    (b'{"round": 0}\n', "rounds [0] where [0, 1] were expected"),
    (b"[1]\n[2]\n", "rounds [None, None]"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "not JSON lines"),
])
def test_a_damaged_log_in_a_checkpoint_is_a_checkpoint_error(text, expected):
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl is damaged") as info:
        parse_metrics(text, [0, 1])
    assert expected in str(info.value)


def test_a_long_round_list_is_shortened_in_the_message():
    text = "".join(json.dumps({"round": r}) + "\n" for r in range(1, 50)).encode()
    with pytest.raises(CheckpointError, match=r"rounds \[1, 2, \.\.\., 49\] where \[0, 1, "
                                              r"\.\.\., 49\]"):
        parse_metrics(text, list(range(50)))


def test_the_run_result_and_its_torn_temp_file_are_run_files(tmp_path):
    from bayesfl.run_directory import RESULT_NAME

    assert RESULT_NAME in RUN_FILES  # force starts again without the old run's result
    (tmp_path / f".{RESULT_NAME}.a1b2.tmp").write_text("torn")  # a kill mid-write
    (tmp_path / CHECKPOINT_NAME).write_text("kept")
    prepare_run_directory(tmp_path, resume=True, force=False)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]
