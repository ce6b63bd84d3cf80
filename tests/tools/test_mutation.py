"""The pure parts of tools/mutation.py: drawing a sample of mutants and the Wilson interval."""

import importlib.util
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
