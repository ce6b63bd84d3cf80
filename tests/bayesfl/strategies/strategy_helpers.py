"""Tiny clients for strategy tests: Gaussian-mixture data, small MLP bodies, one-round driver.

A client is its own ``config`` (``context.client_config(k)``), ``data`` and ``state`` (from
``strategy.init_client(config)``); `run_round` drives one round of the v2 contract over
them and stores every client's new state.
"""

from dataclasses import dataclass

import torch

from bayesfl.data.clients import ClientData
from bayesfl.messages import decode, encode
from bayesfl.strategies import PREDICTIVE, ClientConfig, ClientState, StrategyContext
from bayesfl.training import LocalTraining

NUM_CLASSES = 3
INPUT_DIM = 6
FEATURE_DIM = 4
SIZES = (12, 20, 7)


@dataclass
class Client:
    """One simulated client: what it is configured with, its data and its state."""

    config: ClientConfig
    data: ClientData
    state: ClientState


def make_client_data(client_id: int, n_train: int, n_test: int, seed: int) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(NUM_CLASSES, INPUT_DIM, generator=torch.Generator().manual_seed(99)) * 2

    def draw(n):
        y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        return means[y] + torch.randn(n, INPUT_DIM, generator=g), y

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return ClientData(client_id, train_x, train_y, test_x, test_y)


def make_clients(strategy, sizes=SIZES):
    """Client k gets ``sizes[k]`` training samples and the config the strategy's context gives
    it (its body spec in turn, one init seed per spec: same-spec clients start equal)."""
    clients = []
    for k, n in enumerate(sizes):
        config = strategy.context.client_config(k)
        clients.append(Client(config, make_client_data(k, n, 6, seed=k),
                              strategy.init_client(config)))
    return clients


def context(rounds=3, epochs=2, sizes=SIZES, bodies=("mlp:8",), training=None):
    return StrategyContext(NUM_CLASSES, FEATURE_DIM,
                           training or LocalTraining(epochs=epochs, lr=1e-2, batch_size=5),
                           rounds=rounds, input_shape=(INPUT_DIM,), bodies=tuple(bodies),
                           clients=len(sizes))


def wire(message):
    """What a message looks like after crossing the transport."""
    return decode(encode(message))


def generators(clients, r):
    return [torch.Generator().manual_seed(1000 * r + c.config.client_id) for c in clients]


def fit_all(strategy, clients, broadcast, gens, batched=False):
    """``[(state, upload)]`` of every client: one ``fit`` each, or one ``fit_group`` per body
    spec (the transport forms the groups), in the clients' order."""
    if not batched:
        return [strategy.fit(c.config, c.state, c.data, broadcast, g)
                for c, g in zip(clients, gens, strict=True)]
    results = {}
    for body in dict.fromkeys(c.config.body for c in clients):
        group = [(c, g) for c, g in zip(clients, gens, strict=True) if c.config.body == body]
        out = strategy.fit_group([c.config for c, _ in group], [c.state for c, _ in group],
                                 [c.data for c, _ in group], broadcast, [g for _, g in group])
        results.update({c.config.client_id: r for (c, _), r in zip(group, out, strict=True)})
    return [results[c.config.client_id] for c in clients]


def run_round(strategy, clients, state, r, batched=False):
    """One round over ``clients`` (the round's participants): configure, fit, validate every
    upload against the plan, aggregate. Updates the clients' states; returns the new server
    state and the uploads as the server received them."""
    plan = strategy.configure(state, r)
    down = wire(plan.broadcast)
    ups = []
    for c, (new_state, upload) in zip(
            clients, fit_all(strategy, clients, down, generators(clients, r), batched),
            strict=True):
        c.state = new_state
        ups.append(wire(upload))
    for c, u in zip(clients, ups, strict=True):
        strategy.validate_upload(plan, u, c.config.client_id)
    return strategy.aggregate(state, ups, r, torch.Generator().manual_seed(r)), ups


def evaluation_broadcast(strategy, state, r=0):
    """What clients evaluate with after round ``r`` (as received)."""
    return wire(strategy.configure_evaluation(state, r))


def predict(strategy, client, state, x, r=0, key=PREDICTIVE):
    """The client's ``key`` predictive (n, C) of ``x`` with the server ``state`` of round r."""
    broadcast = evaluation_broadcast(strategy, state, r)
    return strategy.predict(client.config, client.state, broadcast, x)[key]


def network_output(strategy, client, x=None):
    """The client's own network applied to ``x`` (default: its training inputs), eval mode."""
    from bayesfl.strategies.networks import batched_apply

    model = strategy.client_model(client.config, client.state)
    return batched_apply(model, client.data.train_x if x is None else x)
