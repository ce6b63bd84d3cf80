"""``SimulationResult``'s docstring lists every key of ``summary`` (the API reference shows it:
issue 43 found them undocumented). A real run's summary is compared with the list, so a key
added to the summary without a word in the docstring fails here."""

import re

import pytest

import bayesfl
from bayesfl.simulate import SimulationResult


def documented_keys() -> set[str]:
    """The ``code`` names of SimulationResult's docstring before its Attributes section."""
    text = SimulationResult.__doc__.split("Attributes:")[0]
    return set(re.findall(r"``(\w+)``", text))


@pytest.mark.parametrize(("strategy", "options"), [
    ("fedlog", {"novel_fraction": 0.25}),  # a posterior strategy: map_plugin, feature_scale
    ("fedavg", {}),
])
def test_every_summary_key_of_a_run_is_documented(strategy, options):
    result = bayesfl.simulate(strategy=strategy, dataset="digits", clients=4, partition="iid",
                              rounds=1, seed=0, progress=False, **options)
    missing = sorted(set(result.summary) - documented_keys())
    assert not missing, f"summary keys without a word in SimulationResult's docstring: {missing}"
    per_client = set(result.summary["per_client"][0])
    assert {"client_id", "count"} <= per_client
    if "map_plugin" in result.summary:
        assert set(result.summary["map_plugin"]) <= documented_keys()
