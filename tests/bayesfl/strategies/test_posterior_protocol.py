"""Every posterior strategy's ``posterior()`` returns the ``inference`` posterior protocol
(`inference.posterior.Posterior`), of one of the kinds ``Strategy.posterior`` documents,
whose draws are shaped and distributed as documented (issue 42)."""

from __future__ import annotations

import math

import pytest
import torch

from bayesfl.data.datasets import load_dataset
from bayesfl.simulate import simulate
from bayesfl.strategies import STRATEGIES
from inference.posterior import Posterior

DATA = {"n": 90, "num_classes": 3, "dim": 5}
SMALL = dict(dataset="gaussian_mixture", clients=3, partition="iid", rounds=1, seed=3,
             body="mlp:8", feature_dim=4, local_epochs=1, progress=False, batched=False,
             threads=1, dataset_options=DATA)
DOCUMENTED_KINDS = {"body", "subnet_laplace", "diagonal_laplace", "network_gaussian"}
"""The kinds Strategy.posterior's docstring describes ``sample`` for."""

# every registered strategy that is a posterior strategy by class, and a probabilistic head on
# two that are not (the option makes them one)
CASES = [(name, {}) for name, cls in STRATEGIES.items() if cls.is_posterior]
CASES += [("fedavg", {"head": "laplace"}), ("fedper", {"head": "conjugate"})]
SHORT_CHAINS = {"fedpop": {"sgld_burn_in": 2, "sgld_samples": 2, "final_samples": 3}}
# FedPA's covariance comes from the samples after its burn-in epoch: with one local epoch a
# client has none and its posterior is the mode alone
SETTINGS = {"fedpa": {"local_epochs": 3}}


def test_the_cases_cover_the_posterior_families():
    names = {name for name, _ in CASES}
    assert {"fedlog", "fedlog-c", "fedsi", "fedsi-fac", "pfedbayes", "fedpop", "fedpa"} <= names


@pytest.mark.parametrize(("name", "options"), CASES,
                         ids=[f"{n}-{'-'.join(o.values()) or 'plain'}" for n, o in CASES])
def test_the_posterior_satisfies_the_protocol_and_samples_as_documented(name, options):
    result = simulate(name, strategy_options={**options, **SHORT_CHAINS.get(name, {})},
                      **{**SMALL, **SETTINGS.get(name, {})})
    posterior = result.posterior(0)
    assert isinstance(posterior, Posterior), type(posterior)
    assert posterior.kind in DOCUMENTED_KINDS
    mean = posterior.mean
    if posterior.kind == "body":
        assert mean.shape == (3, 4 + 1)  # (C, d + 1) for the conjugate and Laplace heads
    else:
        assert mean.dim() == 1  # a flat parameter vector (P,)

    n = 4000
    draws = posterior.sample(n, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (n, *mean.shape)
    again = posterior.sample(n, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(draws, again, rtol=0, atol=0)  # the generator decides
    # the draws are centred on the mean: per coordinate, the sample mean lies within 6
    # standard errors of it (over <= 200 coordinates a false alarm has odds < 1e-6); a
    # coordinate that does not vary (off FedSI's subnet) sits exactly at the mean
    d = draws.double().reshape(n, -1)
    m = mean.double().reshape(-1)
    spread = d.std(dim=0)
    moving = spread > 0
    assert bool(moving.any()), "a posterior whose draws never leave the mean"
    z = (d.mean(dim=0) - m)[moving] / (spread[moving] / math.sqrt(n))
    assert z.abs().max() < 6.0
    torch.testing.assert_close(d[:, ~moving], m[~moving].expand(n, -1), rtol=0, atol=0)
    if posterior.kind == "subnet_laplace":
        assert 0 < int(moving.sum()) < m.numel()  # only the subnet varies

    x = load_dataset("gaussian_mixture", seed=3, **DATA).x[:7]
    probs = posterior.predict_proba(x)
    assert probs.shape == (7, 3) and bool((probs >= 0).all())
    # rows sum to one up to float32 rounding of a softmax (or its average over draws)
    torch.testing.assert_close(probs.double().sum(dim=1), torch.ones(7, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    moved = posterior.to("cpu")
    assert isinstance(moved, Posterior) and moved.kind == posterior.kind
    torch.testing.assert_close(moved.mean, mean, rtol=0, atol=0)
