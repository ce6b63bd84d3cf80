"""FedProto: prototypes are count-weighted class means of the clients' features."""

import pytest
import torch
from strategy_helpers import NUM_CLASSES, run_round, wire

from bayesfl.errors import MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies.networks import batched_apply


def test_global_prototypes_are_the_pooled_class_means_of_uploaded_features(build):
    strategy, clients, state = build("fedproto")
    new_state, _ = run_round(strategy, clients, state, 1)
    feats = torch.cat([batched_apply(c.model, c.data.train_x)[1] for c in clients]).double()
    labels = torch.cat([c.data.train_y for c in clients])
    for y in range(NUM_CLASSES):
        expected = feats[labels == y].mean(0)
        torch.testing.assert_close(new_state["prototypes"][y].double(), expected,
                                   atol=1e-5, rtol=1e-5)
    assert new_state["counts"].sum() == len(labels)


def test_prototype_of_an_absent_class_must_be_zero(build):
    strategy, clients, state = build("fedproto")
    _, ups = run_round(strategy, clients, state, 1)
    t = dict(ups[0].tensors)
    t["counts"] = t["counts"].clone()
    moved = int(t["counts"][0])
    t["counts"][0] = 0
    t["counts"][1] += moved  # still sums to n, but class 0 has a prototype without samples
    with pytest.raises(MessageRejected, match="count 0"):
        strategy.validate_upload(wire(Message(ups[0].header, t)), round=1, client_id=0)


def test_fedproto_batched_equals_loop(build):
    import copy

    strategy, clients, state = build("fedproto")
    state, _ = run_round(strategy, clients, state, 1)
    twins = copy.deepcopy(clients)
    plain, _ = run_round(strategy, clients, state, 2)
    batched, _ = run_round(strategy, twins, state, 2, batched=True)
    torch.testing.assert_close(plain["prototypes"], batched["prototypes"], atol=1e-5, rtol=1e-5)


def test_unweighted_prototypes_are_the_plain_mean_over_clients_holding_the_class(build):
    strategy, clients, state = build("fedproto", weighted=False)
    new_state, ups = run_round(strategy, clients, state, 1)
    for y in range(NUM_CLASSES):
        holders = [u.tensors["prototypes"][y].double() for u in ups if u.tensors["counts"][y] > 0]
        torch.testing.assert_close(new_state["prototypes"][y].double(),
                                   sum(holders) / len(holders), atol=1e-6, rtol=1e-6)
    assert new_state["counts"].sum() == sum(len(c.data.train_y) for c in clients)


def test_fedproto_defaults_and_bad_options():
    from bayesfl.errors import ConfigError
    from bayesfl.strategies import StrategyContext, make_strategy, strategy_options

    assert strategy_options("fedproto") == {"lam": 1.0, "weighted": True}
    with pytest.raises(ConfigError, match="weighted"):
        make_strategy("fedproto", StrategyContext(3, 4), weighted="yes")
