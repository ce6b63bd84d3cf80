"""A run directory: who may write into it, and its per-round log ``metrics.jsonl``.

A run writes into an empty (or new) directory. A directory that holds anything is refused
unless the caller says what to do with it: ``resume`` continues the run whose checkpoint is
there, ``force`` starts the run again there — it deletes the files a run writes
(`RUN_FILES`) and leaves every other file alone, so ``--force`` on a directory that also
holds the user's own files never removes those.

``metrics.jsonl`` is rebuilt on resume from the copy of its lines that every checkpoint
carries (`MetricsLog`): a torn last line, a line for a round after the checkpoint, an
edited or deleted file all give way to exactly the lines of the rounds the checkpoint vouches
for, and the summary is computed from those.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bayesfl.errors import CheckpointError, ConfigError

CHECKPOINT_NAME = "checkpoint.safetensors"
METRICS_NAME = "metrics.jsonl"
RESULT_NAME = "result.safetensors"
"""The finished run's final states, written last (`bayesfl.run_result`, ``load_run``)."""

RUN_FILES = (METRICS_NAME, "summary.json", "manifest.json", "partition.txt", "partition.json",
             "predictions.npz", "accuracy.png", "reliability.png", CHECKPOINT_NAME, RESULT_NAME)
"""The files a run writes into its directory (``force`` removes these and nothing else)."""


def prepare_run_directory(path: Path, *, resume: bool, force: bool) -> None:
    """Create ``path``, or check that the run may write into it.

    Raises:
        ConfigError: ``resume`` and ``force`` together; ``path`` is not a directory; or it is
            not empty and neither ``resume`` nor ``force`` was given (the message lists what
            it holds and the three ways on).
    """
    if resume and force:
        raise ConfigError("resume and force contradict each other: resume (--resume) continues "
                          f"the run in {path}, force (--force) starts it again; pass one")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run directory {path} exists and is not a directory; choose another "
                          "output directory (--out)")
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        if entries and not (resume or force):
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more"
                                              if len(entries) > 5 else "")
            raise ConfigError(
                f"run directory {path} is not empty (it holds {shown}); pass --resume "
                "(resume=True) to continue the run there, --force (force=True) to start it "
                "again (the files a run writes are replaced, others kept), or choose another "
                "output directory")
        if force:
            remove_run_files(path)
        elif resume:
            remove_stale_temp_files(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create run directory {path}: {err.strerror or err}; choose "
                          "another output directory (--out)") from err


SHIFT_FILES = ("shift_report.json", "shift_report.md", "shift_metrics.png",
               "risk_coverage.png", "shift_states.safetensors")
"""The files a run's shift step writes into ``RUN_DIR/shift`` (run keys ``shift``/``ood``,
`bayesfl.shift_protocol`); ``force`` removes them too, so no report of an earlier run
is taken for this one's."""


def remove_run_files(path: Path) -> None:
    """Delete the files a run writes into ``path`` (and checkpoint temp files, and its shift
    report in ``path/shift``), no others."""
    _remove(path, lambda name: name in RUN_FILES or _is_temp(name))
    if (path / "shift").is_dir() and not (path / "shift").is_symlink():
        _remove(path / "shift", lambda name: name in SHIFT_FILES)


def remove_stale_temp_files(path: Path) -> None:
    """Delete the temporary files of checkpoint writes that a killed run left in ``path``
    (an atomic write renames its temp file; one that is still there was never finished)."""
    _remove(path, _is_temp)


def _is_temp(name: str) -> bool:
    """A temp file of an atomic write of the checkpoint or the run result."""
    return name.endswith(".tmp") and (name.startswith(f".{CHECKPOINT_NAME}.")
                                      or name.startswith(f".{RESULT_NAME}."))


def _remove(path: Path, chosen: Callable[[str], bool]) -> None:
    for entry in path.iterdir():
        if chosen(entry.name) and (entry.is_symlink() or entry.is_file()):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()


class MetricsLog:
    """The lines of ``metrics.jsonl``: appended to the file round by round, and kept (as
    UTF-8 bytes) for the checkpoint, which carries them so that a resume can rebuild the file.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.text = bytearray()
        self.records: list[dict[str, Any]] = []

    def start(self) -> None:
        """Begin an empty log (a new run)."""
        self.text.clear()
        self.records.clear()
        if self.path is not None:
            self.path.write_bytes(b"")

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode("utf-8")
        self.text += line
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "ab") as f:
                f.write(line)

    def restore(self, text: bytes, rounds: list[int]) -> None:
        """Take the log a checkpoint carries and rewrite the file with it.

        Args:
            text: the log's bytes as checkpointed.
            rounds: the rounds it must hold, in order (the run's first round to the
                checkpoint's).

        Raises:
            CheckpointError: the carried log is not JSON lines of these rounds.
        """
        self.records = parse_metrics(text, rounds)
        self.text = bytearray(text)
        if self.path is not None:
            self.path.write_bytes(bytes(text))


def parse_metrics(text: bytes, rounds: list[int]) -> list[dict[str, Any]]:
    """The records of JSON-lines ``text``, checked to be the rounds ``rounds`` in order.

    Raises:
        CheckpointError: not UTF-8 JSON lines, a line that is not an object with an integer
            ``"round"``, or rounds other than ``rounds``.
    """
    bad = ("the checkpoint's copy of metrics.jsonl is damaged ({}); delete the run directory "
           "or start the run again with --force")
    try:
        lines = bytes(text).decode("utf-8").splitlines()
        records = [json.loads(line) for line in lines]
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointError(bad.format(f"not JSON lines: {err}")) from err
    found = [r.get("round") if isinstance(r, dict) else None for r in records]
    if found != rounds:
        raise CheckpointError(bad.format(f"it holds the rounds {_short(found)} where "
                                         f"{_short(rounds)} were expected"))
    return records


def _short(items: list[Any]) -> str:
    return str(items) if len(items) <= 6 else f"[{items[0]}, {items[1]}, ..., {items[-1]}]"


__all__ = ["CHECKPOINT_NAME", "METRICS_NAME", "RESULT_NAME", "RUN_FILES", "SHIFT_FILES",
           "MetricsLog",
           "parse_metrics", "prepare_run_directory", "remove_run_files", "remove_stale_temp_files"]
