"""FedAvg, FedPer, FedRep, LG-FedAvg, FedBABU: what is shared, how it is averaged, trained."""

import copy

import pytest
import torch
from strategy_helpers import run_round, wire

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies import STRATEGIES, make_strategy
from bayesfl.strategies.base import StrategyContext


def shared_names(strategy, clients):
    return set(strategy.broadcast(strategy.init(clients), 1).tensors)


@pytest.mark.parametrize(
    ("name", "shared"),
    [("fedavg", {"body", "head"}), ("fedper", {"body"}), ("fedrep", {"body"}),
     ("fedrep-1", {"body"}), ("lg-fedavg", {"head"}), ("lg-fedavg-2", {"body", "head"}),
     ("fedbabu", {"body"})],
)
def test_each_strategy_shares_the_part_its_paper_shares(build, name, shared):
    strategy, clients, _ = build(name)
    assert {n.split(".")[0] for n in shared_names(strategy, clients)} == shared


def test_fedavg_aggregate_is_the_sample_weighted_mean(build):
    strategy, clients, state = build("fedavg", sizes=(4, 12))
    new_state, ups = run_round(strategy, clients, state, 1)
    for name in state:
        expected = (4 * ups[0].tensors[name].double() + 12 * ups[1].tensors[name].double()) / 16
        torch.testing.assert_close(new_state[name].double(), expected, atol=1e-6, rtol=1e-6)


def test_lg_fedavg_averages_without_weights(build):
    strategy, clients, state = build("lg-fedavg", sizes=(4, 12))
    new_state, ups = run_round(strategy, clients, state, 1)
    expected = (ups[0].tensors["head.weight"] + ups[1].tensors["head.weight"]) / 2
    torch.testing.assert_close(new_state["head.weight"], expected)


def test_fedavg_predicts_with_the_global_network(build):
    strategy, clients, state = build("fedavg")
    state, _ = run_round(strategy, clients, state, 1)
    twin = copy.deepcopy(clients[0].model)
    twin.load_state_dict(state)
    x = clients[0].data.test_x
    expected = torch.softmax(twin(x).double(), dim=1)
    torch.testing.assert_close(strategy.predict_proba(clients[0], state, x), expected)


def test_personal_heads_stay_on_the_client(build):
    strategy, clients, state = build("fedper")
    state, _ = run_round(strategy, clients, state, 1)
    heads = [c.model.head.weight.detach().clone() for c in clients]
    assert not torch.equal(heads[0], heads[1])  # trained locally, never averaged
    assert all(not name.startswith("head.") for name in state)


def test_fedrep_trains_the_head_with_the_body_frozen_first(build):
    strategy, _, _ = build("fedrep", sizes=(10,), head_epochs=2)
    (head_phase, head_cfg), (body_phase, body_cfg) = strategy.phases()
    assert head_phase("head.weight") and not head_phase("body.1.weight")
    assert body_phase("body.1.weight") and not body_phase("head.bias")
    assert head_cfg.epochs == 2 and body_cfg.epochs == strategy.context.training.epochs


def test_fedbabu_never_trains_the_head_during_federated_rounds(build):
    strategy, clients, state = build("fedbabu")
    head = clients[0].model.head.weight.detach().clone()
    state, _ = run_round(strategy, clients, state, 1)
    assert torch.equal(clients[0].model.head.weight, head)
    probs = strategy.predict_proba(clients[0], state, clients[0].data.test_x)  # fine-tuned copy
    assert torch.equal(clients[0].model.head.weight, head)
    torch.testing.assert_close(probs.sum(1), torch.ones(len(probs), dtype=torch.float64))


@pytest.mark.parametrize("name", ["fedavg", "fedper", "fedrep", "fedrep-1", "lg-fedavg",
                                  "lg-fedavg-2", "fedbabu"])
def test_batched_local_training_matches_the_loop(build, name):
    strategy, clients, state = build(name)
    twins = copy.deepcopy(clients)
    plain, _ = run_round(strategy, clients, state, 1, batched=False)
    batched, _ = run_round(strategy, twins, state, 1, batched=True)
    for key in plain:
        torch.testing.assert_close(plain[key], batched[key], atol=1e-5, rtol=1e-5)


def test_a_wrong_shape_or_count_is_rejected(build):
    strategy, clients, state = build("fedavg")
    _, ups = run_round(strategy, clients, state, 1)
    t = dict(ups[0].tensors)
    t["head.weight"] = t["head.weight"][:1]
    with pytest.raises(MessageRejected, match="shape"):
        strategy.validate_upload(wire(Message(ups[0].header, t)), round=1, client_id=0)
    t = dict(ups[0].tensors)
    t["num_samples"] = torch.tensor([0])
    with pytest.raises(MessageRejected, match="num_samples"):
        strategy.validate_upload(wire(Message(ups[0].header, t)), round=1, client_id=0)


def test_lg_fedavg_accepts_different_bodies_but_fedavg_does_not(build):
    build("lg-fedavg", bodies=("mlp:8", "mlp:5-5"))
    with pytest.raises(ConfigError, match="one body"):
        build("fedavg", bodies=("mlp:8", "mlp:5"))


def test_unknown_names_and_options_list_the_valid_ones():
    context = StrategyContext(num_classes=3, feature_dim=4)
    with pytest.raises(ConfigError, match="valid names: " + ", ".join(STRATEGIES)):
        make_strategy("fedsgd", context)
    with pytest.raises(ConfigError, match="valid: head_epochs"):
        make_strategy("fedrep", context, head_epoch=3)


def test_fedbabu_can_fine_tune_the_whole_copy_for_evaluation(build):
    strategy, clients, state = build("fedbabu", finetune="all", finetune_epochs=2)
    state, _ = run_round(strategy, clients, state, 1)
    before = copy.deepcopy(clients[0].model.state_dict())
    head_only = make_strategy("fedbabu", strategy.context, finetune_epochs=2)
    head_only.init(clients)
    x = clients[0].data.test_x
    probs_all = strategy.predict_proba(clients[0], state, x)
    probs_head = head_only.predict_proba(clients[0], state, x)
    assert not torch.allclose(probs_all, probs_head)  # the body moved too
    for k, v in clients[0].model.state_dict().items():  # the client's own model is untouched
        assert torch.equal(v, before[k])
    with pytest.raises(ConfigError, match="finetune"):
        make_strategy("fedbabu", strategy.context, finetune="body")
