"""Resumable bench runs: one JSON line per finished run in a cache file, keyed by its settings.

A long bench (the papers' protocols: 100 rounds, several N and seeds) interrupted at any point
continues where it stopped: `run_cached` skips every run whose key is in the cache and
appends each run the moment it finishes (one ``{"key": ..., "record": ...}`` line, flushed; a
torn last line of a killed process is ignored on the next read). Runs go in ``jobs``
processes (each one torch thread), in the order given, and none starts after ``budget``
seconds, so a bench can be called in bounded slices.

Used by ``bench/colearn.py``, ``bench/fedpart.py`` and ``bench/fedlog_table1.py``.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Task = tuple[str, Callable[..., dict], tuple]
"""(key, function, arguments): ``function(*arguments)`` returns the run's JSON-able record;
the function must be importable (a module-level one) for ``jobs > 1``."""


def provenance(device: str = "cpu") -> dict[str, str]:
    """Where and when a run was measured, the fields every published figure's record carries:
    ``commit`` (short hash of ``HEAD``: commit a bench's code before running it),
    ``date`` (UTC, ``YYYY-MM-DD``) and ``machine`` (the CPU's model name and torch's kernel
    level, one thread; or the GPU's name where ``device`` is ``"cuda"``)."""
    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if device == "cuda" and torch.cuda.is_available():
        machine = f"GPU {torch.cuda.get_device_name(0)}"
    else:
        model = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        machine = (f"CPU {model} ({torch.backends.cpu.get_cpu_capability()}), "
                   f"{torch.get_num_threads()} torch thread(s)")
    return {"commit": commit, "date": datetime.now(UTC).date().isoformat(),
            "machine": machine}


def worktree_state() -> str:
    """``"clean"`` when the checkout's tracked files are those of ``HEAD``, else how many
    differ (``"3 tracked files modified"``, ``"1 tracked file modified"``: the run measured
    code that is not ``commit``'s, e.g. another engineer's uncommitted change in a shared
    checkout); ``"unknown"`` without git."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True,
                                cwd=Path(__file__).resolve().parent).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line for line in status.splitlines() if line.strip()]
    if not changed:
        return "clean"
    return f"{len(changed)} tracked file{'s' if len(changed) > 1 else ''} modified"


def append_result(path: Path | str | None, result: dict, *, seeds: Sequence[int],
                  load_before: Sequence[float], device: str = "cpu") -> dict:
    """One bench invocation's result with its provenance, appended as one JSON line to ``path``
    (none when ``path`` is ``None`` or empty) and returned.

    The record is ``result`` plus `provenance` (``commit``, ``date``, ``machine``),
    ``seeds``, ``torch`` (its version), ``threads`` (torch's intra-op threads) and the 1, 5 and
    15-minute load averages before the measured work (``load_before``, from ``os.getloadavg``)
    and now (``load_after``): on a shared machine the load says how far the absolute times
    can be trusted, and the ratio to a peer measured in the same run is the figure to quote.
    ``worktree`` (`worktree_state`) says whether the code run was ``commit``'s."""
    import torch

    record = {**result, **provenance(device), "worktree": worktree_state(),
              "seeds": [int(s) for s in seeds],
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_before": [round(float(v), 2) for v in load_before],
              "load_after": [round(v, 2) for v in os.getloadavg()]}
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
    return record


def read_jsonl(path: Path | None) -> list[dict]:
    """Every JSON object line of a results file (one that does not parse, such as the torn
    last line of a killed run, is skipped); none when the file is absent."""
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def read_cache(path: Path | None) -> dict[str, dict]:
    """The finished runs of a cache file: key -> record (a line that does not parse, such as
    the torn last line of a killed run, is skipped)."""
    if path is None or not path.exists():
        return {}
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and "key" in entry and "record" in entry:
            out[entry["key"]] = entry["record"]
    return out


def _single_thread(function: Callable[..., dict], arguments: tuple) -> dict:
    import torch

    torch.set_num_threads(1)  # small models on shared cores: threads cost more than they gain
    return function(*arguments)


def run_cached(tasks: Sequence[Task], cache: Path | None, *, jobs: int = 1,
               budget: float = float("inf"), label: Callable[[str, dict], str] | None = None,
               ) -> dict[str, dict]:
    """Every task's record: from ``cache`` where its key is there, else run (``jobs``
    processes, in the given order, none started after ``budget`` seconds) and appended to
    ``cache`` as it finishes. Returns key -> record of the finished runs (the unfinished ones
    are missing; a run that raises is reported on stderr and missing too)."""
    done = read_cache(cache)
    todo = [t for t in tasks if t[0] not in done]
    if done:
        print(f"{len(tasks) - len(todo)} of {len(tasks)} runs from {cache}", file=sys.stderr,
              flush=True)
    start = time.perf_counter()

    def finished(key: str, record: dict) -> None:
        done[key] = record
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("a") as f:
                f.write(json.dumps({"key": key, "record": record}) + "\n")
        text = label(key, record) if label is not None else ""
        print(f"{key}: {text} ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
              flush=True)

    if jobs <= 1:
        for key, function, arguments in todo:
            if time.perf_counter() - start > budget:
                break
            finished(key, _single_thread(function, arguments))
        return done
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        pending: dict[Any, str] = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < jobs and time.perf_counter() - start <= budget:
                key, function, arguments = queue.pop(0)
                pending[pool.submit(_single_thread, function, arguments)] = key
            if not pending:
                break
            ready, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
            for future in ready:
                key = pending.pop(future)
                try:
                    finished(key, future.result())
                except Exception as err:  # one failed run must not lose the others
                    print(f"{key}: failed: {type(err).__name__}: {err}", file=sys.stderr,
                          flush=True)
    return done


__all__ = ["Task", "append_result", "provenance", "read_cache", "read_jsonl", "run_cached",
           "worktree_state"]
