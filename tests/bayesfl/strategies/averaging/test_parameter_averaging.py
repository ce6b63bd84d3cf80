"""FedAvg, FedPer, FedRep, LG-FedAvg, FedBABU: what is shared, how it is averaged, trained."""

import copy

import pytest
import torch
from strategy_helpers import (
    context,
    evaluation_broadcast,
    fit_all,
    generators,
    make_clients,
    predict,
    run_round,
    wire,
)

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies import PREDICTIVE, STRATEGIES, make_strategy
from bayesfl.strategies.averaging.parameter_averaging import PERSONALIZED, shared_state
from bayesfl.strategies.base import StrategyContext


def shared_names(strategy):
    return set(strategy.configure(strategy.init(), 1).broadcast.tensors)


@pytest.mark.parametrize(
    ("name", "shared"),
    [("fedavg", {"body", "head"}), ("fedper", {"body"}), ("fedrep", {"body"}),
     ("fedrep-1", {"body"}), ("lg-fedavg", {"head"}), ("lg-fedavg-2", {"body", "head"}),
     ("fedbabu", {"body"})],
)
def test_each_strategy_shares_the_part_its_paper_shares(build, name, shared):
    strategy, clients, _ = build(name)
    assert {n.split(".")[0] for n in shared_names(strategy)} == shared
    # the client computes the same split from its own network
    assert strategy.shared_names(clients[0].config.body) == shared_names(strategy)


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
    c = clients[0]
    twin = strategy.client_model(c.config, c.state)
    twin.load_state_dict(shared_state(state))
    x = c.data.test_x
    expected = torch.softmax(twin(x).double(), dim=1)
    torch.testing.assert_close(predict(strategy, c, state, x, r=1), expected)


def test_personal_heads_stay_on_the_client(build):
    strategy, clients, state = build("fedper")
    state, _ = run_round(strategy, clients, state, 1)
    heads = [c.state["model.head.weight"] for c in clients]
    assert not torch.equal(heads[0], heads[1])  # trained locally, never averaged
    assert all(not name.startswith("head.") for name in state)


def test_fedrep_trains_the_head_with_the_body_frozen_first(build):
    strategy, clients, _ = build("fedrep", sizes=(10,), head_epochs=2)
    shared = strategy.shared_names(clients[0].config.body)
    (head_phase, head_cfg), (body_phase, body_cfg) = strategy.phases(shared)
    assert head_phase("head.weight") and not head_phase("body.1.weight")
    assert body_phase("body.1.weight") and not body_phase("head.bias")
    assert head_cfg.epochs == 2 and body_cfg.epochs == strategy.context.training.epochs


def test_fedbabu_never_trains_the_head_during_federated_rounds(build):
    strategy, clients, state = build("fedbabu")
    head = clients[0].state["model.head.weight"].clone()
    state, _ = run_round(strategy, clients, state, 1)
    assert torch.equal(clients[0].state["model.head.weight"], head)
    # before personalisation: the global body and the initial head
    c = clients[0]
    twin = strategy.client_model(c.config, c.state)
    twin.load_state_dict(state, strict=False)
    probs = predict(strategy, c, state, c.data.test_x, r=1)
    torch.testing.assert_close(probs, torch.softmax(twin(c.data.test_x).double(), dim=1))
    torch.testing.assert_close(probs.sum(1), torch.ones(len(probs), dtype=torch.float64))


def _personalize(strategy, client, state, seed=5, r=1):
    return strategy.personalize(client.config, client.state, client.data,
                                evaluation_broadcast(strategy, state, r),
                                torch.Generator().manual_seed(seed))


def test_fedbabu_personalize_fine_tunes_a_copy_that_predicts_with_its_own_parameters(build):
    strategy, clients, state = build("fedbabu", finetune_stop="fixed")  # its one epoch
    state, _ = run_round(strategy, clients, state, 1)
    c = clients[0]
    before = copy.deepcopy(c.state)
    personal = _personalize(strategy, c, state)
    # the client's training state is left untouched
    assert c.state.keys() == before.keys()
    assert all(torch.equal(c.state[k], before[k]) for k in before)
    # head fine-tuning: the global body, a head moved away from its initialisation
    assert PERSONALIZED in personal
    for name, value in shared_state(state).items():
        torch.testing.assert_close(personal["model." + name], value, atol=0, rtol=0)
    assert not torch.equal(personal["model.head.weight"], before["model.head.weight"])
    # it predicts with its own parameters only: any later broadcast leaves it as it is
    x = c.data.test_x
    own = torch.softmax(strategy.client_model(c.config, personal)(x).double(), dim=1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    probs = strategy.predict(c.config, personal, broadcast, x)[PREDICTIVE]
    torch.testing.assert_close(probs, own)
    moved = {k: v + 1.0 for k, v in shared_state(state).items()}
    assert torch.equal(
        strategy.predict(c.config, personal, evaluation_broadcast(strategy, moved, 2), x)[
            PREDICTIVE], probs)
    assert not torch.allclose(probs, predict(strategy, c, state, x, r=1))


def test_fedbabu_personalize_is_deterministic_given_the_generator(build):
    strategy, clients, state = build("fedbabu")
    state, _ = run_round(strategy, clients, state, 1)
    c = clients[1]
    first, again = _personalize(strategy, c, state, seed=7), _personalize(strategy, c, state,
                                                                          seed=7)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = _personalize(strategy, c, state, seed=8)  # another mini-batch order
    assert not torch.equal(other["model.head.weight"], first["model.head.weight"])


@pytest.mark.parametrize("name", ["fedavg", "fedper", "fedrep", "fedrep-1", "lg-fedavg",
                                  "lg-fedavg-2", "fedbabu"])
def test_batched_local_training_matches_the_loop(build, name):
    strategy, clients, state = build(name)
    twins = copy.deepcopy(clients)
    plain, _ = run_round(strategy, clients, state, 1, batched=False)
    batched, _ = run_round(strategy, twins, state, 1, batched=True)
    for key in plain:
        torch.testing.assert_close(plain[key], batched[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["fedavg", "fedrep"])
def test_fit_group_gives_the_states_and_uploads_of_fit_one_client_at_a_time(build, name):
    strategy, clients, state = build(name)
    down = wire(strategy.configure(state, 1).broadcast)
    plain = fit_all(strategy, clients, down, generators(clients, 1))
    grouped = fit_all(strategy, clients, down, generators(clients, 1), batched=True)
    for (s_plain, u_plain), (s_group, u_group) in zip(plain, grouped, strict=True):
        assert u_plain.header == u_group.header
        assert u_plain.tensors.keys() == u_group.tensors.keys()
        assert torch.equal(u_plain.tensors["num_samples"], u_group.tensors["num_samples"])
        # float32 rounding of vmapped vs plain Adam over the round; parameters are O(1)
        for k in u_plain.tensors:
            torch.testing.assert_close(u_plain.tensors[k], u_group.tensors[k], atol=1e-5,
                                       rtol=1e-5, msg=k)
        assert s_plain.keys() == s_group.keys()
        for k in s_plain:
            torch.testing.assert_close(s_plain[k], s_group[k], atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["fedavg", "fedrep"])
def test_fit_group_refuses_clients_with_two_body_specs(build, name):
    single, _, single_state = build(name)
    down = single.configure(single_state, 1).broadcast  # a broadcast of a one-body run
    strategy = make_strategy(name, context(bodies=("mlp:8", "mlp:5-5")))
    clients = make_clients(strategy)
    with pytest.raises(ConfigError, match="one body spec"):
        strategy.fit_group([c.config for c in clients], [c.state for c in clients],
                           [c.data for c in clients], down, generators(clients, 1))


def test_a_wrong_shape_or_count_is_rejected(build):
    strategy, clients, state = build("fedavg")
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    t = dict(ups[0].tensors)
    t["head.weight"] = t["head.weight"][:1]
    with pytest.raises(MessageRejected, match="shape"):
        strategy.validate_upload(plan, wire(Message(ups[0].header, t)), 0)
    t = dict(ups[0].tensors)
    t["num_samples"] = torch.tensor([0])
    with pytest.raises(MessageRejected, match="num_samples"):
        strategy.validate_upload(plan, wire(Message(ups[0].header, t)), 0)


def test_lg_fedavg_accepts_different_bodies_but_fedavg_does_not(build):
    build("lg-fedavg", bodies=("mlp:8", "mlp:5-5"))
    with pytest.raises(ConfigError, match="one body"):
        build("fedavg", bodies=("mlp:8", "mlp:5"))


def test_unknown_names_and_options_list_the_valid_ones():
    ctx = StrategyContext(num_classes=3, feature_dim=4)
    with pytest.raises(ConfigError, match="valid names: " + ", ".join(STRATEGIES)):
        make_strategy("fedsgd", ctx)
    with pytest.raises(ConfigError, match="valid: aggregation, bn_stats, head, head_epochs, "
                                          "head_options, head_prior, local_layers"):
        make_strategy("fedrep", ctx, head_epoch=3)


def test_fedbabu_can_fine_tune_the_whole_network_to_personalize(build):
    strategy, clients, state = build("fedbabu", finetune="all", finetune_epochs=2,
                                     finetune_stop="fixed")
    state, _ = run_round(strategy, clients, state, 1)
    c = clients[0]
    before = copy.deepcopy(c.state)
    head_only = make_strategy("fedbabu", strategy.context, finetune_epochs=2,
                              finetune_stop="fixed")
    every, head = _personalize(strategy, c, state), _personalize(head_only, c, state)
    x = c.data.test_x
    broadcast = evaluation_broadcast(strategy, state, 1)
    probs_all = strategy.predict(c.config, every, broadcast, x)[PREDICTIVE]
    probs_head = head_only.predict(c.config, head, broadcast, x)[PREDICTIVE]
    assert not torch.allclose(probs_all, probs_head)
    assert not torch.equal(every["model.body.1.weight"], state["body.1.weight"])  # body moved
    assert torch.equal(head["model.body.1.weight"], state["body.1.weight"])
    for k, v in c.state.items():  # the client's own state is untouched
        assert torch.equal(v, before[k])
    with pytest.raises(ConfigError, match="finetune"):
        make_strategy("fedbabu", strategy.context, finetune="body")


@pytest.mark.parametrize(("name", "options"), [
    ("fedrep", {"head_epochs": "3"}), ("fedrep", {"head_epochs": 2.5}),
    ("fedrep", {"head_epochs": True}), ("fedrep", {"head_epochs": -1}),
    ("fedproto", {"lam": "a"}), ("fedproto", {"lam": float("inf")}),
    ("fedproto", {"lam": -0.5}), ("fedproto", {"lam": False}),
])
def test_numeric_strategy_options_of_the_wrong_type_are_config_errors(name, options):
    with pytest.raises(ConfigError, match=f"{name} .* must be"):
        make_strategy(name, StrategyContext(num_classes=3, feature_dim=4), **options)


@pytest.mark.parametrize("name", ["fedbabu", "fedavg-ft"])
def test_fine_tuning_stops_by_heldout_nll_by_default_and_fixed_runs_every_epoch(build, name):
    from bayesfl.strategies.averaging.finetuning import fine_tune

    strategy, clients, state = build(name, finetune_epochs=3)
    assert strategy.finetune_stop == "heldout_nll"
    state, _ = run_round(strategy, clients, state, 1)
    c = clients[0]
    broadcast = evaluation_broadcast(strategy, state, 1)
    for stop in ("heldout_nll", "fixed"):
        chosen = make_strategy(name, strategy.context, finetune_epochs=3, finetune_stop=stop)
        mine = chosen.personalize(c.config, c.state, c.data, broadcast,
                                  torch.Generator().manual_seed(3))
        plain = fine_tune(chosen, c.config, c.state, c.data, broadcast,
                          torch.Generator().manual_seed(3), epochs=3, scope=chosen.finetune,
                          stop=stop)
        for k in plain:
            torch.testing.assert_close(mine[k], plain[k], rtol=0, atol=0)
    with pytest.raises(ConfigError, match="finetune_stop must be one of"):
        make_strategy(name, strategy.context, finetune_stop="early")


def test_fedbabu_rounds_are_evaluated_as_personalised_now_not_with_the_initial_head(build):
    # before personalisation, each client's figures are those of personalize() run now on a
    # copy (its own generator per client and round); the clients' states are not changed
    from bayesfl.strategies.base import derived_seed

    strategy, clients, state = build("fedbabu", finetune_epochs=2, finetune_stop="fixed")
    state, _ = run_round(strategy, clients, state, 1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    before = [copy.deepcopy(c.state) for c in clients]
    evaluations = strategy.evaluate_group([c.config for c in clients],
                                          [c.state for c in clients],
                                          [c.data for c in clients], broadcast, keep_probs=True)
    for c, kept, e in zip(clients, before, evaluations, strict=True):
        assert all(torch.equal(c.state[k], kept[k]) for k in kept)
        seed = derived_seed(strategy.context.seed, 37, c.config.client_id, 1)
        g = torch.Generator().manual_seed(seed)
        personal = strategy.personalize(c.config, c.state, c.data, broadcast, g)
        expected = strategy.predict(c.config, personal, broadcast, c.data.test_x)[PREDICTIVE]
        torch.testing.assert_close(e.probs[PREDICTIVE], expected, rtol=0, atol=0)
        initial_head = strategy.predict(c.config, c.state, broadcast, c.data.test_x)[PREDICTIVE]
        assert not torch.allclose(e.probs[PREDICTIVE], initial_head)
    assert strategy.round_view is not None
