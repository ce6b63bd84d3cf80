"""Tiny clients for strategy tests: Gaussian-mixture data, small MLP bodies, one-round driver."""

import torch

from bayesfl.bodies import build_body
from bayesfl.data.clients import ClientData
from bayesfl.messages import decode, encode
from bayesfl.strategies import Client, StrategyContext
from bayesfl.training import LocalTraining

NUM_CLASSES = 3
INPUT_DIM = 6
FEATURE_DIM = 4


def make_client_data(client_id: int, n_train: int, n_test: int, seed: int) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(NUM_CLASSES, INPUT_DIM, generator=torch.Generator().manual_seed(99)) * 2

    def draw(n):
        y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        return means[y] + torch.randn(n, INPUT_DIM, generator=g), y

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return ClientData(client_id, train_x, train_y, test_x, test_y)


def make_clients(strategy, sizes=(12, 20, 7), bodies=("mlp:8",)):
    clients = []
    for k, n in enumerate(sizes):
        spec = bodies[k % len(bodies)]
        torch.manual_seed(bodies.index(spec))
        body = build_body(spec, (INPUT_DIM,), FEATURE_DIM)
        data = make_client_data(k, n, 6, seed=k)
        clients.append(Client(k, data, strategy.build_model(body), spec))
    return clients


def context(rounds=3, epochs=2):
    return StrategyContext(NUM_CLASSES, FEATURE_DIM,
                           LocalTraining(epochs=epochs, lr=1e-2, batch_size=5), rounds=rounds)


def wire(message):
    """What a message looks like after crossing the transport."""
    return decode(encode(message))


def run_round(strategy, clients, state, r, batched=False):
    down = wire(strategy.broadcast(state, r))
    gens = [torch.Generator().manual_seed(1000 * r + c.client_id) for c in clients]
    if batched:
        ups = strategy.client_update_batch(clients, down, gens)
    else:
        ups = [strategy.client_update(c, down, g) for c, g in zip(clients, gens, strict=True)]
    ups = [wire(u) for u in ups]
    for c, u in zip(clients, ups, strict=True):
        strategy.validate_upload(u, round=r, client_id=c.client_id)
    return strategy.aggregate(state, ups, r, torch.Generator().manual_seed(r)), ups
