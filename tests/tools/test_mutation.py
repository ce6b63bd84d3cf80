"""tools/mutation.py without running mutmut: drawing a sample of mutants, the Wilson interval
and the record each run appends to bench/results/mutation.jsonl."""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "mutation.py"
_SPEC = importlib.util.spec_from_file_location("mutation_tool", _PATH)
mutation = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mutation)

NAMES = [f"m.x_f__mutmut_{i}" for i in range(1, 51)] + [f"m.xǁCǁg__mutmut_{i}" for i in (1, 2)]


def test_sample_draws_distinct_names_of_the_population_in_mutmut_order():
    sample = mutation.sample_names(NAMES, 10, seed=0)
    assert len(sample) == len(set(sample)) == 10
    assert set(sample) <= set(NAMES)
    assert sample == sorted(sample, key=mutation.natural)  # x_f__mutmut_2 before ..._10


def test_sample_depends_on_the_seed_only_not_on_the_order_of_the_names():
    assert mutation.sample_names(NAMES, 10, 3) == mutation.sample_names(NAMES[::-1], 10, 3)
    assert mutation.sample_names(NAMES, 10, 3) != mutation.sample_names(NAMES, 10, 4)


def test_a_sample_as_large_as_the_population_is_the_population():
    assert mutation.sample_names(NAMES, 100, 0) == sorted(NAMES, key=mutation.natural)


@pytest.mark.parametrize(("k", "n", "low", "high"), [
    # Wilson's interval, z = 1.96, centred on (k + z^2/2) / (n + z^2)
    (64, 80, 0.6995, 0.8730),
    (40, 80, 0.3930, 0.6070),  # symmetric about 1/2
    (80, 80, 0.9542, 1.0),     # all killed: from n / (n + z^2) = 80 / 83.84 up to 1
    (0, 10, 0.0, 0.2775),      # none: from 0 up to z^2 / (n + z^2) = 3.84 / 13.84
])
def test_wilson_interval(k, n, low, high):
    lo, hi = mutation.wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4)
    assert hi == pytest.approx(high, abs=1e-4)


def test_wilson_interval_of_no_trials_is_everything():
    assert mutation.wilson_interval(0, 0) == (0.0, 1.0)


# --- the stored record of a run (bench/results/mutation.jsonl) ------------------------------

def summary(sample=None):
    """A `report` summary of 40 mutants: 30 killed, 2 timeouts, 1 crash, 5 survived, 1 with no
    tests, 1 listed equivalent."""
    return {"module": "bayesfl/x.py", "tests": ["tests/bayesfl/test_x.py"],
            "killed": 30, "timeout": 2, "crashed": 1, "survived": 5, "no_tests": 1,
            "equivalent": 1, "not_checked": 0, "total": 40, "detected": 33, "scored": 39,
            "score": 33 / 39, "sample": sample, "wall_s": 123.4,
            "survivors": [{"mutant": f"x_f__mutmut_{i}"} for i in range(6)]}


WHERE = {"commit": "abc1234", "date": "2026-11-29", "machine": "x86_64 AVX2, 1 thread",
         "worktree": "clean"}


def test_a_sample_record_carries_its_counts_score_interval_and_provenance():
    sample = {"size": 40, "seed": 3, "population": 412, "ci95": None}
    record = mutation.run_record(summary(sample), "sample", False, WHERE)
    assert record["kind"] == "sample" and not record["resumed"]
    assert (record["sample_size"], record["seed"], record["population"]) == (40, 3, 412)
    assert record["tests"] == ["tests/bayesfl/test_x.py"]
    assert (record["detected"], record["scored"], record["total"]) == (33, 39, 40)
    assert record["score"] == pytest.approx(0.8462, abs=1e-4)  # 33 / 39
    # by hand: p = 33/39 = 0.84615, z^2 = 3.8416, 1 + z^2/39 = 1.09850; centre
    # (p + z^2/78) / 1.09850 = 0.89541 / 1.09850 = 0.81511; half-width
    # 1.96 sqrt(p(1-p)/39 + z^2/6084) / 1.09850 = 1.96 sqrt(0.0039693) / 1.09850 = 0.11241
    assert record["ci95"] == pytest.approx([0.7027, 0.9275], abs=1e-4)
    assert record["survivors"] == [f"x_f__mutmut_{i}" for i in range(6)]
    assert {k: record[k] for k in WHERE} == WHERE and record["wall_s"] == 123.4


def test_a_full_run_has_no_sample_and_no_interval():
    record = mutation.run_record(summary(), "full", False, WHERE)
    assert record["sample_size"] is record["seed"] is record["ci95"] is None
    assert record["score"] == pytest.approx(33 / 39)


def wilson_by_roots(k, n, z=1.96):
    """Wilson's bounds derived afresh: the p with |p - k/n| = z sqrt(p(1-p)/n), the roots of
    (1 + z^2/n) p^2 - (2k/n + z^2/n) p + (k/n)^2 = 0."""
    import numpy as np

    phat = k / n
    roots = np.roots([1 + z * z / n, -(2 * phat + z * z / n), phat * phat])
    return tuple(sorted(float(r.real) for r in roots))


@pytest.mark.parametrize(("k", "n"), [(33, 39), (64, 80), (1, 25), (0, 10), (40, 40)])
def test_wilson_interval_against_independent_computations(k, n):
    lo, hi = mutation.wilson_interval(k, n)
    assert (lo, hi) == pytest.approx(wilson_by_roots(k, n), abs=1e-9)
    stats = pytest.importorskip("scipy.stats")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=2e-4)  # scipy: z = 1.95996...


def fake_run(module, codes, calls):
    """A stand-in for mutmut: writes the verdicts a run would leave in the work directory."""
    def run(workdir, names):
        calls.append("run")
        meta = workdir / "mutants" / f"{module}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
    return run


@pytest.mark.parametrize("record", [True, False])
def test_a_run_appends_one_record_unless_told_not_to(tmp_path, monkeypatch, record):
    module = "bayesfl/calibrate.py"
    prefix = "bayesfl.calibrate."
    codes = {f"{prefix}x_f__mutmut_{i}": 1 for i in range(1, 4)} | {f"{prefix}x_f__mutmut_4": 36}
    monkeypatch.chdir(mutation.ROOT)  # report() works in the work directory: come back after
    monkeypatch.setattr(mutation, "WORK", tmp_path / ".mutation")
    records = tmp_path / "mutation.jsonl"
    monkeypatch.setattr(mutation, "append_record", lambda path, r: records.write_text(
        json.dumps(r) + "\n"))
    calls = []
    monkeypatch.setattr(mutation, "run_mutmut", fake_run(module, codes, calls))
    monkeypatch.setattr(mutation, "provenance",
                        lambda threads: calls.append("provenance") or WHERE | {"threads": threads})

    assert mutation.main([module] + ([] if record else ["--no-record"])) == 0
    assert calls == ["provenance", "run"]  # the commit and worktree the run copied
    if not record:
        assert not records.exists()
        return
    [line] = records.read_text().splitlines()
    stored = json.loads(line)
    assert stored["module"] == module and stored["kind"] == "full"
    assert stored["tests"] == ["tests/bayesfl/test_calibrate.py"]
    counts = (stored["killed"], stored["timeout"], stored["detected"], stored["total"])
    assert counts == (3, 1, 4, 4)
    assert stored["score"] == 1.0 and stored["ci95"] is None and stored["wall_s"] >= 0
    assert stored["commit"] == "abc1234" and stored["threads"] == "1"


def test_provenance_names_the_commit_date_and_machine():
    where = mutation.provenance("1")
    assert where["machine"].endswith(", 1 thread") and where["commit"] != "unknown"
    assert len(where["date"]) == 10 and where["worktree"]
