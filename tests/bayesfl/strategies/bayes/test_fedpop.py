"""FedPop: SGLD head draws against an exact posterior, the local objective, a digits run,
poisoned uploads rejected."""

import math

import pytest
import torch
from strategy_helpers import generators, run_round, wire

from bayesfl.simulate import simulate
from bayesfl.strategies.bayes.fedpop import BODY, PRIOR_STD, FedPop, sample_heads
from tests.inference.ground_truth import (
    single_intra_op_thread,  # noqa: F401  (fixture)
    softmax_regression,
)

F64 = torch.float64


def exact_moments(inputs, labels, shift, std, grid_size=401):
    """Mean (2, 2) and covariance (4, 4) of a 2-class softmax head's posterior under the prior
    N(shift, std^2 I), for a shift with equal rows.

    The likelihood depends on W only through u = (w0 - w1)/sqrt(2); a shift with equal rows
    moves only s = (w0 + w1)/sqrt(2), independent of u, whose posterior is its prior
    N(sqrt(2) shift_row, std^2 I). The moments of u are Riemann sums on a grid over [-8, 8]^2
    (tests/inference/ground_truth.py's reduction, with the prior's std)."""
    axis = torch.linspace(-8.0, 8.0, grid_size, dtype=F64)
    grid = torch.cartesian_prod(axis, axis)
    sign = 1.0 - 2.0 * labels.to(F64)
    log_density = (torch.nn.functional.logsigmoid(sign * (2**0.5 * grid @ inputs.T)).sum(1)
                   - 0.5 * (grid**2).sum(1) / std**2)
    weights = torch.softmax(log_density, 0)
    mean_u = weights @ grid
    cov_u = (grid - mean_u).T @ (weights[:, None] * (grid - mean_u))
    lift = torch.cat([torch.eye(2), -torch.eye(2)], 0).to(F64) / 2**0.5
    s_part = torch.cat([torch.eye(2), torch.eye(2)], 0).to(F64) / 2**0.5
    mean = shift + (lift @ mean_u).reshape(2, 2)
    return mean, lift @ cov_u @ lift.T + std**2 * s_part @ s_part.T


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.trained
def test_sgld_head_draws_have_the_exact_posterior_moments():
    truth = softmax_regression()
    inputs = torch.cat([torch.ones(truth.features.shape[0], 1, dtype=F64), truth.features], 1)
    shift = torch.tensor([[0.5, -1.0], [0.5, -1.0]], dtype=F64)
    mean, covariance = exact_moments(inputs, truth.labels, shift, std=0.7)
    chains = 16
    draws, _ = sample_heads(inputs, truth.labels, 2, shift, 0.7, burn_in=500,
                            num_samples=400, thinning=5, num_chains=chains, seed=5)
    per_chain = draws.reshape(chains, -1, 2, 2)
    mean_se = per_chain.mean(1).std(0) / chains**0.5
    var_se = per_chain.var(1).std(0) / chains**0.5
    # as tests/inference/test_sgld.py: 4 standard errors of 16 independent chains, plus 2.5 %
    # for the variance (the Laplace-preconditioned step 0.05 inflates a Gaussian's variance
    # by ~1.3 %; this posterior is skewed)
    assert ((draws.mean(0) - mean).abs() <= 4 * mean_se).all(), (draws.mean(0), mean)
    variance = covariance.diagonal().reshape(2, 2)
    assert ((draws.var(0) - variance).abs() <= 4 * var_se + 0.025 * variance).all()
    # the prior matters: the exact posterior under N(0, I) differs from this one by far more
    # than the tolerance (so the test would catch a sampler that ignored the prior)
    other, _ = exact_moments(inputs, truth.labels, torch.zeros(2, 2, dtype=F64), std=1.0)
    assert ((other - mean).abs() > 10 * mean_se).any()


def test_local_loss_is_the_monte_carlo_negative_log_joint():
    g = torch.Generator().manual_seed(0)
    features = torch.rand(6, 3, generator=g, dtype=F64)
    labels = torch.tensor([0, 1, 2, 1, 0, 2])
    draws = torch.randn(4, 3, 4, generator=g, dtype=F64)
    prior_mean = torch.randn(3, 4, generator=g, dtype=F64)
    log_std = torch.tensor(math.log(0.8), dtype=F64)
    ours = FedPop.local_loss(features, labels, draws, prior_mean, log_std, 50)
    inputs = torch.cat([torch.ones(6, 1, dtype=F64), features], 1)
    nll = torch.stack([torch.nn.functional.cross_entropy(inputs @ z.T, labels) for z in draws])
    log_prior = torch.stack([torch.distributions.Normal(prior_mean, 0.8).log_prob(z).sum()
                             for z in draws])
    torch.testing.assert_close(ours, nll.mean() - log_prior.mean() / 50, rtol=1e-12, atol=1e-12)


@pytest.mark.trained
def test_three_rounds_on_digits_with_five_clients():
    result = simulate("fedpop", "digits", clients=5, rounds=3, seed=0, progress=False,
                      local_epochs=1, batch_size=64, threads=1,
                      strategy_options={"sgld_burn_in": 20, "sgld_samples": 5,
                                        "sgld_thinning": 2, "final_samples": 10})
    s = result.summary
    assert s["rejected_uploads"] == 0 and s["personalized"]
    assert s["accuracy"] > 0.5, s["accuracy"]  # 10 classes: chance is 0.1
    assert "map_plugin" in s
    post = result.posterior(3)
    heads = post.sample(4, torch.Generator().manual_seed(0))
    assert heads.shape == (4, 10, result.config.feature_dim + 1)
    probs = post.predict_proba(result.clients[3].data.test_x[:5])
    torch.testing.assert_close(probs.sum(1), torch.ones(5, dtype=F64), rtol=0, atol=1e-12)


POISONS = [
    (lambda t: {**t, PRIOR_STD: torch.zeros(1)}, "prior std"),
    (lambda t: {**t, PRIOR_STD: torch.tensor([-1.0])}, "prior std"),
    (lambda t: {k: v * 1e3 if k.startswith(BODY) else v for k, v in t.items()},
     "body update norm"),
    (lambda t: {**t, "num_samples": torch.tensor([10**9])}, "num_samples"),
]


def test_poisoned_uploads_are_rejected_with_a_reason(build):
    # one round of honest fits, then each poisoned variant of client 0's upload in turn
    options = {"sgld_burn_in": 10, "sgld_samples": 3, "sgld_thinning": 1}
    strategy, clients, state = build("fedpop", **options)
    state, _ = run_round(strategy, clients, state, 1)
    plan = strategy.configure(state, 2)
    ups = []
    for c, g in zip(clients, generators(clients, 2), strict=True):
        _, up = strategy.fit(c.config, c.state, c.data, wire(plan.broadcast), g)
        ups.append(wire(up))
    for poison, reason in POISONS:
        bad = strategy.up_message(2, 0, poison(dict(ups[0].tensors)))
        verdicts = strategy.validate_uploads(plan, [bad, *ups[1:]], [0, 1, 2])
        assert verdicts[0] is not None and reason in verdicts[0], verdicts[0]
        assert verdicts[1:] == [None, None]
