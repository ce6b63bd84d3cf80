"""Which layers each parameter-averaging baseline shares, counted as the FedLog paper does.

The parameter counts of the paper's MNIST and CIFAR CNNs (spec fedlog.md §5.2) pin every split
to the right layer: a split off by one layer changes the float count.
"""

import pytest
import torch
from strategy_helpers import context, make_clients, run_round, wire
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.strategies import StrategyContext, make_strategy, strategy_options
from bayesfl.strategies.averaging.parameter_averaging import shared_state
from bayesfl.strategies.networks import layer_parameter_names
from bayesfl.training import LocalTraining

# registry name -> layers of a 4-layer network (body.1, body.3, body.5, head) it averages
SHARED_LAYERS = {
    "fedavg": ("body.1", "body.3", "body.5", "head"),
    "fedper": ("body.1", "body.3"),
    "fedrep": ("body.1", "body.3"),
    "fedrep-1": ("body.1", "body.3", "body.5"),
    "lg-fedavg": ("head",),
    "lg-fedavg-2": ("body.5", "head"),
    "fedbabu": ("body.1", "body.3", "body.5"),
}


MLP = "mlp:8-8"
"""Flatten, then Linear+ReLU layers 6 -> 8 -> 8 -> 4: body.1, body.3, body.5 (then the head)."""


def build_net(name, sizes=(12, 20, 7), **options):
    ctx = context(rounds=2, sizes=sizes, bodies=(MLP,),
                  training=LocalTraining(epochs=1, lr=1e-2, batch_size=5))
    strategy = make_strategy(name, ctx, **options)
    clients = make_clients(strategy, sizes)  # one body spec: the same initial network
    return strategy, clients, strategy.init()


def parameter_names(strategy, client):
    return [n for n, _ in strategy.client_model(client.config, client.state).named_parameters()]


def expected_names(names, layers):
    return {n for n in names if n.rsplit(".", 1)[0] in layers}


@pytest.mark.parametrize("name", sorted(SHARED_LAYERS))
def test_exactly_the_named_layers_are_averaged_and_the_rest_stay_local(name):
    strategy, clients, state = build_net(name)
    names = parameter_names(strategy, clients[0])
    shared = expected_names(names, SHARED_LAYERS[name])
    assert set(state) == shared
    assert strategy.shared_names(MLP) == shared  # the client's own split agrees
    state, ups = run_round(strategy, clients, state, 1)
    assert set(shared_state(state)) == shared
    assert set(state) - shared == {f"declared/{c.config.client_id}" for c in clients}
    assert all(set(u.tensors) == shared | {"num_samples"} for u in ups)
    # next round: shared layers arrive identical on every client, personal ones differ
    down = wire(strategy.configure(state, 2).broadcast)
    # the network each client predicts with: its own state with the broadcast loaded into it
    received = [strategy._predict_parameters(c.config, c.state, down) for c in clients]
    for param in names:
        values = [r["model." + param] for r in received]
        same = all(torch.equal(values[0], v) for v in values[1:])
        if param in shared:
            assert same, param
        elif name != "fedbabu":  # FedBABU's personal head is frozen at its (common) init
            assert not same, param


def test_fedbabu_head_stays_at_its_common_initialisation():
    strategy, clients, state = build_net("fedbabu")
    init = clients[0].state["model.head.weight"].clone()
    run_round(strategy, clients, state, 1)
    assert all(torch.equal(c.state["model.head.weight"], init) for c in clients)


def test_fedrep_phases_train_the_personal_layers_then_the_shared_ones():
    strategy, clients, _ = build_net("fedrep", head_epochs=3)
    (first, first_cfg), (second, second_cfg) = strategy.phases(strategy.shared_names(MLP))
    names = parameter_names(strategy, clients[0])
    assert [n for n in names if first(n)] == ["body.5.weight", "body.5.bias", "head.weight",
                                              "head.bias"]
    assert [n for n in names if second(n)] == ["body.1.weight", "body.1.bias", "body.3.weight",
                                               "body.3.bias"]
    assert first_cfg.epochs == 3 and second_cfg.epochs == strategy.context.training.epochs


ROBUST_DEFAULTS = {"aggregation": "mean", "trim_fraction": 0.1, "norm_bound": None,
                   "screening_ratio": 10.0, "schedule": None, "bn_stats": "aggregate",
                   "head": None, "head_prior": "zero", "head_options": None}


def test_paper_defaults_of_the_layer_options():
    assert strategy_options("fedper") == ROBUST_DEFAULTS | {"local_layers": 2}
    assert strategy_options("fedrep") == ROBUST_DEFAULTS | {"head_epochs": 10, "local_layers": 2}
    assert strategy_options("fedrep-1") == ROBUST_DEFAULTS | {"head_epochs": 10,
                                                              "local_layers": 1}
    assert strategy_options("lg-fedavg") == ROBUST_DEFAULTS | {"global_layers": 1}
    assert strategy_options("lg-fedavg-2") == ROBUST_DEFAULTS | {"global_layers": 2}


def test_layer_options_override_the_defaults():
    _, _, state = build_net("fedper", local_layers=1)
    assert {n.rsplit(".", 1)[0] for n in state} == {"body.1", "body.3", "body.5"}
    _, _, state = build_net("lg-fedavg", global_layers=3)
    assert {n.rsplit(".", 1)[0] for n in state} == {"body.3", "body.5", "head"}


@pytest.mark.parametrize(("name", "option", "value"), [
    ("fedper", "local_layers", 0), ("fedrep", "local_layers", -1),
    ("lg-fedavg", "global_layers", 0), ("lg-fedavg", "global_layers", 1.5),
    ("fedper", "local_layers", True),
])
def test_bad_layer_counts_are_config_errors(name, option, value):
    with pytest.raises(ConfigError, match=option):
        make_strategy(name, StrategyContext(3, 4), **{option: value})


def test_layer_counts_that_do_not_fit_the_network_are_config_errors():
    with pytest.raises(ConfigError, match="nothing would be shared"):
        build_net("fedper", local_layers=4)
    with pytest.raises(ConfigError, match="only 4"):
        build_net("lg-fedavg", global_layers=5)


def test_lg_fedavg_2_rejects_bodies_whose_second_global_layer_differs():
    bodies = ("mlp:8", "mlp:5")
    strategy = make_strategy("lg-fedavg-2", context(bodies=bodies))
    with pytest.raises(ConfigError, match="different shared parameter"):
        strategy.init()
    one = make_strategy("lg-fedavg", context(bodies=bodies))  # one global layer: any bodies
    one.init()


# ---- the FedLog paper's CNNs (spec fedlog.md §7.1) and its per-round float counts (§5.2) ---
def mnist_cnn_body():
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(10, 20, 5), nn.Dropout2d(), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Dropout())


def cifar_cnn_body():
    return nn.Sequential(
        nn.Unflatten(1, (3, 32, 32)),
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 100), nn.ReLU(),
        nn.Dropout())


PAPER_FLOATS = {  # spec §5.2: floats uploaded per client per round
    "mnist": {"fedavg": 21840, "lg-fedavg": 510, "lg-fedavg-2": 16560, "fedper": 5280,
              "fedrep": 5280, "fedbabu": 21330, "fedrep-1": 21330},
    "cifar10": {"fedavg": 64102, "lg-fedavg": 1010, "lg-fedavg-2": 13110, "fedper": 50992,
                "fedrep": 50992, "fedbabu": 63092, "fedrep-1": 63092},
    "cifar100": {"fedavg": 73192, "lg-fedavg": 10100, "lg-fedavg-2": 22200, "fedper": 50992,
                 "fedrep": 50992, "fedbabu": 63092, "fedrep-1": 63092},
}
NETWORKS = {"mnist": (mnist_cnn_body, 50, 10), "cifar10": (cifar_cnn_body, 100, 10),
            "cifar100": (cifar_cnn_body, 100, 100)}


@pytest.mark.parametrize("dataset", sorted(PAPER_FLOATS))
def test_shared_floats_reproduce_the_papers_per_round_counts(dataset):
    body, d, num_classes = NETWORKS[dataset]
    ctx = StrategyContext(num_classes, d)
    for name, floats in PAPER_FLOATS[dataset].items():
        strategy = make_strategy(name, ctx)
        model = strategy.build_model(body())
        # the paper's CNNs have no body spec: the split is taken from the network itself, as
        # the server's init and the client's shared_names take it from theirs
        shared = strategy.shared_parameters(model)
        state = {k: v for k, v in model.named_parameters() if k in shared}
        assert sum(v.numel() for v in state.values()) == floats, name
        assert strategy.upload_schema(state, 1).keys() == set(state) | {"num_samples"}


def test_the_papers_mnist_cnn_has_four_layers_in_forward_order():
    model = make_strategy("fedavg", StrategyContext(10, 50)).build_model(mnist_cnn_body())
    assert [g[0].rsplit(".", 1)[0] for g in layer_parameter_names(model)] == [
        "body.1", "body.4", "body.9", "head"]
