"""FedProto: prototypes are count-weighted class means of the clients' features."""

import copy

import pytest
import torch
from strategy_helpers import (
    NUM_CLASSES,
    fit_all,
    generators,
    network_output,
    predict,
    run_round,
    wire,
)

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies import StrategyContext, make_strategy, strategy_options


def test_global_prototypes_are_the_pooled_class_means_of_uploaded_features(build):
    strategy, clients, state = build("fedproto")
    new_state, _ = run_round(strategy, clients, state, 1)
    feats = torch.cat([network_output(strategy, c)[1] for c in clients]).double()
    labels = torch.cat([c.data.train_y for c in clients])
    for y in range(NUM_CLASSES):
        expected = feats[labels == y].mean(0)
        torch.testing.assert_close(new_state["prototypes"][y].double(), expected,
                                   atol=1e-5, rtol=1e-5)
    assert new_state["counts"].sum() == len(labels)


def test_prototype_of_an_absent_class_must_be_zero(build):
    strategy, clients, state = build("fedproto")
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    t = dict(ups[0].tensors)
    t["counts"] = t["counts"].clone()
    moved = int(t["counts"][0])
    t["counts"][0] = 0
    t["counts"][1] += moved  # still sums to n, but class 0 has a prototype without samples
    with pytest.raises(MessageRejected, match="count 0"):
        strategy.validate_upload(plan, wire(Message(ups[0].header, t)), 0)


def test_fedproto_batched_equals_loop(build):
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
    assert strategy_options("fedproto") == {"lam": 1.0, "weighted": True, "inference": "prototype"}
    with pytest.raises(ConfigError, match="weighted"):
        make_strategy("fedproto", StrategyContext(3, 4), weighted="yes")


def test_prototype_inference_predicts_the_nearest_global_prototype(build):
    strategy, clients, state = build("fedproto")
    assert strategy.inference == "prototype"
    state, _ = run_round(strategy, clients, state, 1)
    client = clients[0]
    x = client.data.test_x
    probs = predict(strategy, client, state, x, r=1)
    _, features = network_output(strategy, client, x)
    # reference: squared distances by explicit differences, over the classes with a prototype
    gaps = features.double()[:, None, :] - state["prototypes"].double()[None, :, :]
    distances = gaps.pow(2).sum(-1)
    present = state["counts"] > 0
    distances[:, ~present] = float("inf")
    assert torch.equal(probs.argmax(1), distances.argmin(1))
    expected = torch.softmax(-distances, dim=1)
    torch.testing.assert_close(probs, expected, atol=1e-12, rtol=1e-9)
    assert probs.dtype == torch.float64 and torch.all(probs[:, ~present] == 0)


def test_head_inference_and_the_fallback_before_any_prototype_use_the_head(build):
    strategy, clients, state = build("fedproto", inference="head")
    client = clients[0]
    logits, _ = network_output(strategy, client, client.data.test_x)
    expected = torch.softmax(logits.double(), dim=1)
    torch.testing.assert_close(predict(strategy, client, state, client.data.test_x), expected)
    # no aggregation yet: no prototypes
    prototype_strategy, _, prototype_state = build("fedproto")
    torch.testing.assert_close(
        predict(prototype_strategy, client, prototype_state, client.data.test_x), expected)


def test_an_unknown_inference_rule_is_a_config_error(build):
    with pytest.raises(ConfigError, match="inference"):
        build("fedproto", inference="knn")


def test_fit_group_gives_the_states_and_uploads_of_fit_one_client_at_a_time(build):
    strategy, clients, state = build("fedproto")
    state, _ = run_round(strategy, clients, state, 1)
    down = wire(strategy.configure(state, 2).broadcast)
    plain = fit_all(strategy, clients, down, generators(clients, 2))
    grouped = fit_all(strategy, clients, down, generators(clients, 2), batched=True)
    for (s_plain, u_plain), (s_group, u_group) in zip(plain, grouped, strict=True):
        assert torch.equal(u_plain.tensors["counts"], u_group.tensors["counts"])
        assert torch.equal(u_plain.tensors["num_samples"], u_group.tensors["num_samples"])
        # float32 rounding of vmapped vs plain Adam over 2 epochs; features are O(1)
        torch.testing.assert_close(u_plain.tensors["prototypes"], u_group.tensors["prototypes"],
                                   atol=1e-5, rtol=1e-5)
        assert s_plain.keys() == s_group.keys()
        for k in s_plain:
            torch.testing.assert_close(s_plain[k], s_group[k], atol=1e-5, rtol=1e-5, msg=k)


def test_fit_group_refuses_clients_with_two_body_specs(build):
    strategy, clients, state = build("fedproto", bodies=("mlp:8", "mlp:5-5"))
    down = strategy.configure(state, 1).broadcast
    with pytest.raises(ConfigError, match="one body spec"):
        strategy.fit_group([c.config for c in clients], [c.state for c in clients],
                           [c.data for c in clients], down, generators(clients, 1))


def test_fit_group_of_one_body_spec_is_each_clients_fit_with_mixed_bodies(build):
    strategy, clients, state = build("fedproto", bodies=("mlp:8", "mlp:5-5"))
    twins = copy.deepcopy(clients)
    plain, _ = run_round(strategy, clients, state, 1)
    grouped, _ = run_round(strategy, twins, state, 1, batched=True)  # one group per body
    torch.testing.assert_close(plain["prototypes"], grouped["prototypes"], atol=1e-5, rtol=1e-5)
