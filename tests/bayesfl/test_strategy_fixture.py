"""Issue 42's acceptance: a strategy written in one module outside the package, with declared
options (tests/bayesfl/flower_strategy_app/strategy_app/damped_fedavg.py), runs in the
simulator and on Flower and appears in `bayesfl strategies`, the CLI help and the docs tables,
with no file of the package or the docs edited: importing its module registers it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from bayesfl.cli import main
from bayesfl.errors import ConfigError
from bayesfl.simulate import simulate
from bayesfl.strategies import STRATEGIES
from bayesfl.strategies.listing import architecture_table, family_table, readme_table

APP = Path(__file__).parent / "flower_strategy_app"
NAME = "damped-fedavg"
SMALL = dict(dataset="gaussian_mixture", clients=3, partition="iid", rounds=2, seed=3,
             body="mlp:8", feature_dim=4, local_epochs=1, progress=False, batched=False,
             threads=1, dataset_options={"n": 90, "num_classes": 3, "dim": 5})


@pytest.fixture
def registered(monkeypatch):
    """The fixture's module imported (so registered) for one test, unregistered after it."""
    monkeypatch.syspath_prepend(str(APP))
    module = importlib.import_module("strategy_app.damped_fedavg")
    yield module
    STRATEGIES.pop(NAME, None)
    for name in [m for m in sys.modules if m == "strategy_app" or m.startswith("strategy_app.")]:
        del sys.modules[name]


def test_it_is_unknown_until_its_module_is_imported():
    assert NAME not in STRATEGIES
    with pytest.raises(ConfigError, match=f"unknown strategy '{NAME}'"):
        simulate(NAME, **SMALL)


def test_it_is_listed_by_bayesfl_strategies_and_the_run_help(registered, capsys):
    assert main(["strategies"]) == 0
    listing = capsys.readouterr().out
    line = next(line for line in listing.splitlines() if line.startswith(NAME + " "))
    assert "FedAvg whose server keeps a share of its previous network each round." in line
    assert "damping=0.0" in listing.split(NAME, 1)[1]
    assert main(["strategies", NAME]) == 0
    assert "share of the previous shared parameters the server keeps" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"local-only, {NAME}" in help_text  # in its family's line


def test_it_appears_in_every_docs_table(registered):
    assert f"`{NAME}`" in readme_table().split("parameter averaging", 1)[1].split("\n")[0]
    row = next(r for r in architecture_table().splitlines() if f"`{NAME}`" in r)
    assert "`strategy_app.damped_fedavg`" in row and "mixed with the previous network" in row
    row = next(r for r in family_table("averaging").splitlines() if "`damping`" in r)
    assert row.startswith(f"| `damping` | `0.0` | `{NAME}` | share of the previous shared")
    aggregation = next(r for r in family_table("averaging").splitlines()
                       if r.startswith("| `aggregation`"))
    assert "| all |" in aggregation  # it takes FedAvg's options too


def test_it_runs_in_the_simulator_and_at_zero_damping_it_is_fedavg(registered, tmp_path):
    fedavg = simulate("fedavg", **SMALL)
    same = simulate(NAME, strategy_options={"damping": 0.0}, **SMALL)
    damped = simulate(NAME, strategy_options={"damping": 0.5}, **SMALL)
    for name, tensor in fedavg.state.items():  # the same operations: equal
        torch.testing.assert_close(same.state[name], tensor, rtol=0, atol=0)
    assert same.summary["accuracy"] == fedavg.summary["accuracy"]
    assert any(not torch.equal(damped.state[k], v) for k, v in fedavg.state.items())
    with pytest.raises(ConfigError, match=rf"{NAME} damping must be a finite number in "
                                          r"\[0, 0\.99\], got 1\.5"):
        simulate(NAME, strategy_options={"damping": 1.5}, **SMALL)
    with pytest.raises(ConfigError, match=r"did you mean 'damping'\?"):
        simulate(NAME, strategy_options={"dampnig": 0.5}, **SMALL)


def test_it_runs_on_flower_in_process_as_in_the_simulator(registered, tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity

    from tests.bayesfl.test_flower import SMALL as FLOWER_SMALL
    from tests.bayesfl.test_flower import assert_figures_equal, serve

    for key in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, key, 1)
    summary = serve({**FLOWER_SMALL, "strategy": NAME, "threads": 1,
                     "option": "damping=0.5"}).run()
    sim = simulate(NAME, strategy_options={"damping": 0.5}, **SMALL)
    assert summary["events"] == [] and summary["strategy"] == NAME
    assert_figures_equal(summary, sim.summary, "headline")


@pytest.mark.flower
@pytest.mark.slow  # ~1-3 minutes: three SuperNodes
def test_it_runs_on_real_supernodes_that_load_it_from_the_app(registered, tmp_path):
    pytest.importorskip("flwr")
    from bayesfl.flower.local import LocalFederation

    out = tmp_path / "run"
    config = {"strategy": NAME, "dataset": "gaussian_mixture", "clients": 3,
              "partition": "iid", "rounds": 2, "seed": 3, "body": "mlp:8", "feature-dim": 4,
              "local-epochs": 1, "option": "damping=0.5", "dataset-option": "n=90 "
              "num_classes=3 dim=5", "threads": 1, "round-timeout": 400.0,
              "node-wait": 300.0, "out": str(out)}
    with LocalFederation(3, start_timeout=300.0) as fed:
        status = fed.run(config, app=APP, timeout=900.0, done_marker=out / "summary.json")
    assert status.completed, (status.status, status.details, fed.log("superlink")[-4000:])
    summary = json.loads((out / "summary.json").read_text())
    sim = simulate(NAME, strategy_options={"damping": 0.5}, **SMALL)
    for key in ("ece", "accuracy", "nll", "brier"):
        # the same float32 operations on both sides; 1e-6 leaves room for batch layout only
        assert summary[key] == pytest.approx(sim.summary[key], abs=1e-6), key


def test_the_run_help_lists_every_built_in_strategy_under_its_family(capsys):
    from bayesfl.strategies import FAMILIES

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    section = capsys.readouterr().out.split("strategies (--strategy NAME", 1)[1]
    listed: dict[str, list[str]] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("    "):  # "  label: a, b,"
            label, _, names = line.strip().partition(": ")
            listed[label] = names.split(", ")
        elif line.startswith("    "):  # a wrapped line of the same family
            listed[label] += line.strip().split(", ")
    listed = {label: [n.strip(",") for n in names if n] for label, names in listed.items()}
    assert list(listed) == [f.label for f in FAMILIES.values()]
    for name, cls in STRATEGIES.items():
        assert name in listed[FAMILIES[cls.registration.family].label], name
