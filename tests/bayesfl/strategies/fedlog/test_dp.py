"""FedLog with differential privacy: the noise scale of spec fedlog.md §4.2 and where the noise
is added (local DP: every client's upload; central DP: the sum, once)."""

import math

import pytest
import torch
from strategy_helpers import context, make_clients

from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.networks import batched_apply
from inference.conjugate import gaussian_sigma

# These tiny clients (a dozen samples) are deliberately drowned in noise to test the mechanics;
# the noise-to-signal warning that says so is tested in test_fedlog.py.
pytestmark = pytest.mark.filterwarnings("ignore::inference.conjugate.privacy.PrivacyNoiseWarning")

# spec §4.2 reference table: m = 101 (d = 100 body features), b = 2, delta = 0.01
SIGMA_TABLE = {  # epsilon: (v1 per release, v2 k = 1, v2 k = 100)
    0.1: (622.3, 903.2, 9032.2),
    0.5: (124.5, 225.6, 2255.6),
    1.0: (62.2, 121.9, 1219.0),
    5.0: (12.4, 28.3, 282.5),
    10.0: (6.2, 14.9, 148.9),
}


@pytest.mark.parametrize("epsilon", sorted(SIGMA_TABLE))
def test_gaussian_sigma_reproduces_the_spec_table(epsilon):
    v1, v2_once, v2_hundred = SIGMA_TABLE[epsilon]
    args = dict(delta=0.01, feature_dim=100, bound=2.0)
    assert gaussian_sigma(epsilon, rounds=1, composition="single", **args) == pytest.approx(
        v1, abs=0.05)
    assert gaussian_sigma(epsilon, rounds=1, **args) == pytest.approx(v2_once, abs=0.05)
    assert gaussian_sigma(epsilon, rounds=100, **args) == pytest.approx(v2_hundred, abs=0.05)


@pytest.mark.parametrize("name", ["fedlog-dp-local", "fedlog-dp-central"])
@pytest.mark.parametrize("epsilon", sorted(SIGMA_TABLE))
def test_dp_strategies_use_the_v2_sigma_of_the_table(name, epsilon):
    # the strategies count the init round as a release: k = rounds + 1
    for rounds, column in ((0, 1), (99, 2)):
        ctx = StrategyContext(num_classes=10, feature_dim=100, rounds=rounds)
        strategy = make_strategy(name, ctx, epsilon=epsilon, delta=0.01, clip=2.0)
        assert strategy.sigma == pytest.approx(SIGMA_TABLE[epsilon][column], abs=0.05)


RUNS = 120


def noisy_rounds(name):
    """Round-0 uploads (no training, so the clean statistics are fixed) and aggregates over
    RUNS seeded repetitions; returns the strategy, clients, clean per-client statistics, and
    the noise of every upload (RUNS, K, C, m) and of every aggregate (RUNS, C, m)."""
    strategy = make_strategy(name, context(), epsilon=1.0, delta=0.01, clip=2.0)
    clients = make_clients(strategy)
    state = strategy.init()
    clean = torch.stack([
        strategy.client_statistics(
            c.data, batched_apply(strategy.client_model(c.config, c.state), c.data.train_x))
        for c in clients])
    down = strategy.configure(state, 0).broadcast
    upload_noise, total_noise = [], []
    for run in range(RUNS):
        gens = [torch.Generator().manual_seed(10_000 * run + c.config.client_id)
                for c in clients]
        ups = [strategy.fit(c.config, c.state, c.data, down, g)[1]
               for c, g in zip(clients, gens, strict=True)]
        new = strategy.aggregate(state, ups, 0, torch.Generator().manual_seed(77 + run))
        upload_noise.append(torch.stack([u.tensors["statistics"].double() for u in ups]) - clean)
        total_noise.append(new["statistics"] - clean.sum(0))
    return strategy, clients, torch.stack(upload_noise), torch.stack(total_noise)


def test_local_dp_noises_every_upload_and_the_sum_has_k_times_the_variance():
    strategy, clients, upload_noise, total_noise = noisy_rounds("fedlog-dp-local")
    sigma, k = strategy.sigma, len(clients)
    assert sigma > 10
    # each client's upload carries its own N(0, sigma^2) per cell
    for c in range(k):
        assert upload_noise[:, c].var().item() == pytest.approx(sigma**2, rel=0.15)
    # independent across clients: the sum's variance is k sigma^2 (k^2 sigma^2 if shared)
    assert total_noise.var().item() == pytest.approx(k * sigma**2, rel=0.15)
    assert total_noise.mean().abs().item() < 4 * math.sqrt(k) * sigma / math.sqrt(
        total_noise.numel())


def test_central_dp_leaves_uploads_clean_and_noises_the_sum_once():
    strategy, clients, upload_noise, total_noise = noisy_rounds("fedlog-dp-central")
    sigma = strategy.sigma
    assert sigma > 10
    assert upload_noise.abs().max().item() < 1e-4  # float32 rounding only
    # one N(0, sigma^2) draw per cell of the sum, whatever the number of clients
    assert total_noise.var().item() == pytest.approx(sigma**2, rel=0.15)
    assert total_noise.var().item() < 0.5 * len(clients) * sigma**2
