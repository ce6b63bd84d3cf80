"""bench/run_cache.py: an interrupted bench continues where it stopped -- every finished run is
one JSON line keyed by its settings, a cached run is never run again, a torn last line (a
killed process) is ignored, and no run starts after the budget."""

import json

from bench.run_cache import read_cache, run_cached

CALLS: list[int] = []


def square(x: int) -> dict:
    CALLS.append(x)
    return {"x": x, "square": x * x}


def tasks(xs):
    return [(f"square|{x}", square, (x,)) for x in xs]


def test_a_second_call_runs_only_what_the_first_did_not_finish(tmp_path):
    cache = tmp_path / "runs.jsonl"
    CALLS.clear()
    first = run_cached(tasks([1, 2]), cache)
    assert first == {"square|1": {"x": 1, "square": 1}, "square|2": {"x": 2, "square": 4}}
    assert CALLS == [1, 2] and len(cache.read_text().splitlines()) == 2
    CALLS.clear()
    second = run_cached(tasks([1, 2, 3]), cache)
    assert CALLS == [3]  # 1 and 2 came from the cache
    assert second["square|3"] == {"x": 3, "square": 9} and len(second) == 3


def test_a_torn_last_line_is_skipped_and_that_run_is_done_again(tmp_path):
    cache = tmp_path / "runs.jsonl"
    cache.write_text(json.dumps({"key": "square|1", "record": {"x": 1, "square": 1}}) + "\n"
                     + '{"key": "square|2", "rec')  # a process killed mid-write
    assert read_cache(cache) == {"square|1": {"x": 1, "square": 1}}
    CALLS.clear()
    run_cached(tasks([1, 2]), cache)
    assert CALLS == [2]


def test_no_run_starts_after_the_budget(tmp_path):
    CALLS.clear()
    done = run_cached(tasks([1, 2]), tmp_path / "runs.jsonl", budget=-1.0)
    assert done == {} and CALLS == []
    assert read_cache(tmp_path / "absent.jsonl") == {} and read_cache(None) == {}


def test_provenance_names_the_commit_the_utc_date_and_the_machine():
    import datetime
    import subprocess

    import torch

    from bench.run_cache import provenance

    record = provenance()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert record["commit"] == (head or "unknown")
    assert datetime.date.fromisoformat(record["date"])  # YYYY-MM-DD
    assert record["machine"].startswith("CPU ")
    assert f"{torch.get_num_threads()} torch thread(s)" in record["machine"]
