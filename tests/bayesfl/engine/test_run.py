"""The run written once (``bayesfl.engine.run.Run``): each transport is the engine's run plus
its channel and hooks, with no method of one written again in the other; the summary of a
run whose rounds are not all evaluated (Flower's ``evaluate-every``) is the summary of the
simulator's code path; a checkpoint's client states come back checked against their layout.
"""

import inspect

import pytest
import torch

from bayesfl.engine.rounds import RoundHooks
from bayesfl.engine.run import Run
from bayesfl.engine.state import restored_client_states, save_round
from bayesfl.engine.steps import build_summary
from bayesfl.evaluation import merge_evaluations


def _transports():
    pytest.importorskip("flwr")
    from bayesfl.flower.server_app import FlowerServer
    from bayesfl.simulate import _Run

    return _Run, FlowerServer


def _own_methods(cls) -> set[str]:
    return {name for name, value in vars(cls).items()
            if inspect.isfunction(value) or isinstance(value, property)}


def test_every_method_both_transports_define_is_a_hook_of_the_engine():
    simulator, flower = _transports()
    assert issubclass(simulator, Run) and issubclass(flower, Run)
    hooks = _own_methods(Run) | {n for n in vars(RoundHooks) if not n.startswith("_")} | {
        "evaluate_inline"}
    shared = _own_methods(simulator) & _own_methods(flower)
    # a name in both is the transport's answer to one hook (its constructor included), never the
    # same logic written twice
    assert shared - hooks == set(), shared - hooks


def test_each_transport_is_at_most_150_lines():
    for cls in _transports():
        lines = inspect.getsource(cls).rstrip("\n").count("\n") + 1
        assert lines <= 150, f"{cls.__name__}: {lines} lines"


def _record(round, accuracy, bytes_up, rejections=()):
    return {"round": round, "accuracy": accuracy, "bytes_up": bytes_up, "bytes_down": 2 * bytes_up,
            "bytes_down_evaluation": 3, "floats_up": 5, "floats_down": 7,
            "rejections": [{"client_id": c, "reason": "r"} for c in rejections]}


def _evaluation():
    from bayesfl.strategies.base import PREDICTIVE, Evaluation
    from calibration.accumulator import Accumulator

    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1])
    return merge_evaluations([Evaluation(0, {PREDICTIVE: Accumulator(5).update(probs, labels)},
                                         {}, labels)])


def test_a_summary_counts_every_round_and_takes_the_best_of_the_evaluated_ones():
    from bayesfl.config import SimulationConfig

    config = SimulationConfig(strategy="fedavg", dataset="digits", clients=2, partition="iid",
                              rounds=4, seed=0)
    # rounds 1 and 3 not evaluated (evaluate-every 2): their bytes and rejections count, they
    # cannot be the best round
    metrics = [_record(1, None, 10, [0]), _record(2, 0.5, 20), _record(3, None, 30, [1]),
               _record(4, 0.25, 40)]
    summary = build_summary(config, metrics, _evaluation(), 0.0)
    assert (summary["best_round"], summary["best_accuracy"]) == (2, 0.5)
    assert summary["bytes_up"] == 100 and summary["bytes_down"] == 200
    assert summary["bytes_down_evaluation"] == 12
    assert summary["floats_up"] == 20 and summary["floats_down"] == 28
    assert summary["rejected_uploads"] == 2
    assert [(r["round"], r["client_id"]) for r in summary["rejections"]] == [(1, 0), (3, 1)]
    # the evaluated records alone give the same best round (the summary the simulator, whose
    # rounds are all evaluated, writes)
    evaluated = [m for m in metrics if m["accuracy"] is not None]
    again = build_summary(config, evaluated, _evaluation(), 0.0)
    assert (again["best_round"], again["best_accuracy"]) == (2, 0.5)


def test_restored_client_states_come_back_on_their_layout(tmp_path):
    from bayesfl.checkpoint import load_checkpoint

    g = torch.Generator().manual_seed(0)
    states = {0: {"w": torch.randn(3, generator=g), "n": torch.tensor(4)},
              1: {"w": torch.randn(3, generator=g), "n": torch.tensor(7)}}
    path = tmp_path / "checkpoint.safetensors"
    save_round(path, round=1, first_round=1, seconds=0.0, identity={"a": 1},
               fingerprint="f" * 64, state={"s": torch.zeros(1)}, clients=states,
               metrics_text=b"", transport="test").wait()
    tensors, meta = load_checkpoint(path, fingerprint="f" * 64)
    restored = restored_client_states(tensors, meta, states, torch.device("cpu"))
    for cid, state in states.items():
        assert restored[cid].keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(restored[cid][k], v) and restored[cid][k].dtype == v.dtype
    # a client whose state has another layout than its initial one: not this run's checkpoint
    other = {0: {"w": torch.zeros(4), "n": torch.tensor(0)}, 1: states[1]}
    with pytest.raises(ValueError, match="client 0's tensors differ from its layout"):
        restored_client_states(tensors, meta, other, torch.device("cpu"))
