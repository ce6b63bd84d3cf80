"""FedPA: the dynamic-programming delta against the explicit shrinkage solve (the authors'
test), the normalised upload (FedAvg's step off the samples' span), linear-Gaussian exactness,
a digits run, poisoned uploads rejected."""

import numpy as np
import pytest
import torch
from strategy_helpers import context, generators, make_clients, run_round, wire

from bayesfl.errors import ConfigError
from bayesfl.simulate import simulate
from bayesfl.strategies import make_strategy
from bayesfl.strategies.bayes.fedpa import (
    COUNT,
    DELTA,
    SAMPLES,
    client_delta,
    posterior_delta,
    server_step,
    shrinkage_weight,
    swag_gaussian,
)
from bayesfl.training import LocalTraining
from inference.gaussian import GaussianPosterior, GaussianTerm, combine

F64 = torch.float64


@pytest.mark.parametrize("count", [1, 2, 5, 8])
@pytest.mark.parametrize("rho", [1.0, 5.0])
def test_dynamic_program_delta_is_the_explicit_shrinkage_solve(count, rho):
    # the authors' test_update_delta_posterior_avg: Delta = (rho_l I + (1 - rho_l) S)^-1
    # (mean - theta) with S the unbiased sample covariance (np.cov), rho_l = 1/(1 + (l-1) rho)
    g = torch.Generator().manual_seed(count)
    theta = torch.randn(6, generator=g, dtype=F64)
    samples = [theta + torch.randn(6, generator=g, dtype=F64) for _ in range(count)]
    ours = posterior_delta(theta, samples, rho).numpy()
    stacked = torch.stack(samples).numpy()
    weight = shrinkage_weight(count, rho)
    covariance = weight * np.eye(6) + ((1 - weight) * np.cov(stacked.T) if count > 1 else 0)
    expected = np.linalg.solve(covariance, stacked.mean(0) - theta.numpy())
    # a float64 rank-one recursion against one LU solve of a 6 x 6 matrix (condition < 1e3)
    np.testing.assert_allclose(ours, expected, rtol=1e-10, atol=1e-12)


def off_span(vector, samples):
    """``vector`` (P,) minus its projection on the span of the samples' deviations from their
    mean (the directions in which the shrinkage covariance differs from rho_l I)."""
    deviations = samples - samples.mean(0)
    q, _ = torch.linalg.qr(deviations.T)  # (P, l) orthonormal; spans the l - 1 deviations
    return vector - q @ (q.T @ vector)


@pytest.mark.parametrize("count", [1, 2, 5])
@pytest.mark.parametrize("rho", [1.0, 5.0])
def test_normalised_upload_is_fedavgs_step_off_the_samples_span(count, rho):
    g = torch.Generator().manual_seed(10 + count)
    theta = torch.randn(40, generator=g, dtype=F64)
    samples = theta + 0.3 * torch.randn(count, 40, generator=g, dtype=F64)
    mean = samples.mean(0)
    ours = client_delta(theta, list(samples), rho)
    weight = shrinkage_weight(count, rho)
    covariance = weight * torch.eye(40, dtype=F64) + (
        (1 - weight) * torch.cov(samples.T) if count > 1 else 0)
    expected = weight * torch.linalg.solve(covariance, mean - theta)
    # rho_l times the explicit solve; float64 recursion vs one LU of a 40 x 40 matrix whose
    # eigenvalues lie in [rho_l, rho_l + 0.1 * l] (condition < 20)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    # off the samples' span Sigma_hat = rho_l I: the upload is exactly FedAvg's step on the
    # samples' mean there; the paper's delta is 1 + (l - 1) rho times longer (the 4x step that
    # kept FedPA at 45 % accuracy on MNIST: rho = 1, 4 samples)
    torch.testing.assert_close(off_span(ours, samples), off_span(mean - theta, samples),
                               rtol=1e-10, atol=1e-12)
    paper = client_delta(theta, list(samples), rho, normalize=False)
    torch.testing.assert_close(off_span(paper, samples),
                               (1 + (count - 1) * rho) * off_span(mean - theta, samples),
                               rtol=1e-10, atol=1e-12)
    # identical samples (no spread): the upload is mean - theta in every direction
    same = client_delta(theta, [mean] * count, rho)
    torch.testing.assert_close(same, mean - theta, rtol=1e-12, atol=1e-14)


def test_a_clients_upload_is_fedavgs_step_off_its_samples_span():
    # a real fit (5 local epochs: 4 IASG samples, rho = 1): the uploaded delta, off the span
    # of the stored samples' deviations, is the samples' mean minus the broadcast parameters
    strategy = make_strategy("fedpa", context(epochs=5), client_lr=0.05)
    clients = make_clients(strategy)
    state = strategy.init()
    plan = strategy.configure(state, 1)
    c = clients[1]
    new_state, upload = strategy.fit(c.config, c.state, c.data, wire(plan.broadcast),
                                     generators([c], 1)[0])
    samples = new_state[SAMPLES][: int(new_state[COUNT].item())].to(F64)
    assert samples.shape[0] == 4
    names = [n for n, _ in strategy.template(c.config.body).named_parameters()]
    theta = torch.cat([state[n].reshape(-1) for n in names]).to(F64)
    delta = torch.cat([upload.tensors[DELTA + n].reshape(-1) for n in names]).to(F64)
    step = off_span(samples.mean(0) - theta, samples)
    assert step.norm() > 1e-3  # the clients did move
    # float32 samples and upload: agreement to float32 rounding of O(1) parameters
    torch.testing.assert_close(off_span(delta, samples), step, rtol=1e-4, atol=1e-5)


def linear_gaussian_clients(sizes=(30, 12, 45, 20), dim=5, seed=0):
    """Per client: (X_k, y_k) of one linear model y = X w + N(0, 1), and the exact local
    posterior under a flat prior: precision X_k^T X_k, mean its least-squares solution."""
    g = np.random.default_rng(seed)
    w = g.normal(size=dim)
    clients = []
    for n in sizes:
        x = g.normal(size=(n, dim)) + g.normal(size=dim)  # clients differ in their inputs
        y = x @ w + g.normal(size=n)
        precision = x.T @ x
        clients.append((x, y, np.linalg.solve(precision, x.T @ y), precision))
    return clients


def exact_samples(mean, covariance, count, seed):
    """``count`` points whose sample mean is ``mean`` and whose unbiased sample covariance is
    ``covariance`` exactly (the local posterior's moments with no Monte Carlo error)."""
    g = np.random.default_rng(seed)
    centred = g.normal(size=(count, mean.shape[0]))
    centred -= centred.mean(0)
    q, _ = np.linalg.qr(centred)  # orthonormal columns, each orthogonal to the ones vector
    return mean + np.sqrt(count - 1) * q @ np.linalg.cholesky(covariance).T


def test_precision_weighted_combination_of_exact_local_posteriors_is_global_least_squares():
    clients = linear_gaussian_clients()
    x = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    least_squares = np.linalg.lstsq(x, y, rcond=None)[0]
    # inference.combine: prior + sum of likelihood terms; a 1e-12 prior precision shifts the
    # mean by ~1e-12 relative (X^T X has eigenvalues ~10-100)
    prior = GaussianTerm.isotropic(5, 1e-12)
    posts = [GaussianPosterior(prior, GaussianTerm("full", torch.from_numpy(p @ m),
                                                   dense=torch.from_numpy(p)), (5,))
             for _, _, m, p in clients]
    np.testing.assert_allclose(combine(posts).mean.numpy(), least_squares, rtol=1e-9, atol=1e-10)


def test_federated_posterior_averaging_converges_to_global_least_squares():
    clients = linear_gaussian_clients()
    x = np.concatenate([c[0] for c in clients])
    y = np.concatenate([c[1] for c in clients])
    least_squares = np.linalg.lstsq(x, y, rcond=None)[0]
    # every client's IASG "samples" carry its exact posterior moments (6 points, the fewest
    # with a full-rank covariance in 5 dimensions); rho = 1e9 makes the shrinkage weight
    # 2e-10, so Sigma_hat = Sigma_k to ~1e-9 relative
    samples = [torch.from_numpy(exact_samples(m, np.linalg.inv(p), 6, k))
               for k, (_, _, m, p) in enumerate(clients)]
    eigenvalues = np.linalg.eigvalsh(sum(p for *_, p in clients))
    # the mean delta is (X^T y - X^T X theta) / K: gradient descent on a quadratic, whose best
    # step 2K / (lambda_min + lambda_max) contracts by (kappa - 1) / (kappa + 1) per round
    lr = 2 * len(clients) / (eigenvalues[0] + eigenvalues[-1])
    rate = (eigenvalues[-1] - eigenvalues[0]) / (eigenvalues[-1] + eigenvalues[0])
    assert rate < 0.85
    theta = {"w": torch.zeros(5, dtype=F64)}
    for _ in range(150):
        # Delta_k = Sigma_hat_k^-1 (mu_hat_k - theta): the client's delta from its samples,
        # taken at the current server parameters
        deltas = [{"w": posterior_delta(theta["w"], list(s), 1e9)} for s in samples]
        theta, _ = server_step(theta, deltas, torch.ones(len(clients)), lr)
    # the fixed point is sum_k Sigma_k^-1 (mu_k - theta) = 0, i.e. X^T X theta = X^T y; after
    # 150 rounds the contraction leaves < 0.85^150 = 3e-11 of the start's error, and the
    # shrinkage's ~1e-9 relative bias remains
    np.testing.assert_allclose(theta["w"].numpy(), least_squares, rtol=1e-7, atol=1e-8)
    # FedAvg's deltas (rho = 0: Sigma_hat = I) converge to the unweighted mean of local
    # solutions instead, which is not the least-squares solution here
    fedavg = np.mean([m for _, _, m, _ in clients], axis=0)
    assert np.abs(fedavg - least_squares).max() > 1e-3


def test_server_momentum_accumulates_the_mean_delta():
    params = {"w": torch.zeros(3, dtype=F64)}
    deltas = [{"w": torch.tensor([1.0, 2.0, 3.0], dtype=F64)},
              {"w": torch.tensor([3.0, 2.0, 1.0], dtype=F64)}]
    new, buffers = server_step(params, deltas, torch.tensor([1.0, 3.0]), 0.5, 0.9)
    mean = torch.tensor([2.5, 2.0, 1.5], dtype=F64)  # weights 1/4, 3/4
    torch.testing.assert_close(new["w"], 0.5 * mean, rtol=0, atol=1e-15)
    again, _ = server_step(new, deltas, torch.tensor([1.0, 3.0]), 0.5, 0.9, buffers)
    torch.testing.assert_close(again["w"], new["w"] + 0.5 * (0.9 * mean + mean), rtol=0,
                               atol=1e-15)


def test_swag_covariance_is_half_diagonal_plus_low_rank():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(2, 2)  # 6 parameters
    samples = torch.randn(4, 6, generator=g, dtype=F64)
    post = swag_gaussian(model, torch.zeros(6, dtype=F64), samples, n_samples=4,
                         input_shape=(2,))
    deviations = samples - samples.mean(0)
    expected = 0.5 * (torch.diag(deviations.square().mean(0)) + deviations.T @ deviations / 3)
    actual = torch.diag(post.variance) + post.factor.T @ post.factor
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)
    draws = post.sample(20000, torch.Generator().manual_seed(1))
    # 20,000 draws: the empirical covariance is within a few percent of the largest entry
    assert (torch.cov(draws.T) - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.trained
def test_three_rounds_on_digits_with_five_clients():
    result = simulate("fedpa", "digits", clients=5, partition="iid", rounds=3, seed=0,
                      progress=False, local_epochs=5, batch_size=64, threads=1,
                      strategy_options={"mc_samples": 4, "client_lr": 0.1})
    s = result.summary
    assert s["rejected_uploads"] == 0
    # Learning, on any CPU: over seeds 0-4 the three rounds gave 0.10-0.28, 0.26-0.61 and
    # 0.37-0.72 (each seed rising by >= 0.19 from round 1 to 3); chance is 0.1 with standard
    # error 0.014 on the 450 test digits. (On 2-class shards the same run ended anywhere
    # between 0.09 and 0.56 by seed: too erratic to assert on.)
    accuracy = [m["accuracy"] for m in result.metrics]
    assert accuracy[-1] > 0.2 and accuracy[-1] > accuracy[0] + 0.05, accuracy
    assert "map_plugin" in s
    post = result.posterior(1)
    assert post.factor is not None and post.factor.shape[0] == 4  # epochs 1-4 are samples
    assert post.sample(3).shape == (3, post.mean.shape[0])


POISONS = [
    (lambda t: {k: v * 1e4 if k.startswith(DELTA) else v for k, v in t.items()}, "delta norm"),
    (lambda t: {**t, "num_samples": torch.tensor([10**9])}, "num_samples"),
    (lambda t: {**t, "num_samples": torch.tensor([0])}, "num_samples must be >= 1"),
    (lambda t: {k: v.fill_(float("nan")) if k.startswith(DELTA) else v for k, v in t.items()},
     "finite"),
]


def test_poisoned_uploads_are_rejected_with_a_reason(build):
    # one round of honest fits, then each poisoned variant of client 0's upload in turn
    strategy, clients, state = build("fedpa", client_lr=0.05)
    state, _ = run_round(strategy, clients, state, 1)
    plan = strategy.configure(state, 2)
    ups = []
    for c, g in zip(clients, generators(clients, 2), strict=True):
        _, up = strategy.fit(c.config, c.state, c.data, wire(plan.broadcast), g)
        ups.append(wire(up))
    for poison, reason in POISONS:
        tensors = {k: v.clone() for k, v in ups[0].tensors.items()}
        bad = strategy.up_message(2, 0, poison(tensors))
        verdicts = strategy.validate_uploads(plan, [bad, *ups[1:]], [0, 1, 2])
        assert verdicts[0] is not None and reason in verdicts[0], verdicts[0]
        assert verdicts[1:] == [None, None]


# ---- rounds without samples, burn-in and every documented option ----------------------------
def fit_one(strategy, r=1, client=0, state=None):
    """Client ``client``'s fit in round ``r`` from the server ``state`` (default: init):
    (client, broadcast as received, new client state, upload as received)."""
    c = make_clients(strategy)[client]
    down = wire(strategy.configure(strategy.init() if state is None else state, r).broadcast)
    new_state, upload = strategy.fit(c.config, c.state, c.data, down, generators([c], r)[0])
    return c, down, new_state, wire(upload)


def flat_delta(strategy, c, upload):
    names = [n for n, _ in strategy.template(c.config.body).named_parameters()]
    return torch.cat([upload.tensors[DELTA + n].reshape(-1) for n in names])


@pytest.mark.parametrize("burn_in_rounds, counts", [(0, [2, 2]), (1, [0, 2]), (2, [0, 0])])
def test_burn_in_rounds_b_means_rounds_1_to_b_draw_no_iasg_sample(burn_in_rounds, counts):
    # 3 local epochs, burn_in_epochs 1: a sampling round gives 2 samples (epochs 2 and 3);
    # rounds count from 1, so burn_in_rounds = 1 must leave round 1 without samples
    strategy = make_strategy("fedpa", context(epochs=3), burn_in_rounds=burn_in_rounds)
    clients, state = make_clients(strategy), strategy.init()
    seen = []
    for r in (1, 2):
        state, _ = run_round(strategy, clients, state, r)
        seen.append([int(c.state[COUNT].item()) for c in clients])
    assert seen == [[k] * len(clients) for k in counts]


@pytest.mark.parametrize("why", ["burn_in_rounds", "too few epochs"])
def test_without_samples_the_upload_is_the_last_iterate_minus_the_broadcast(why):
    # no IASG sample (a burn-in round, or epochs <= burn_in_epochs): the FedAvg delta, last
    # iterate minus theta, as the reference code sends; its sign makes a lone client's server
    # step (server_lr 1) land on that client's last iterate
    options = {"burn_in_rounds": 1} if why == "burn_in_rounds" else {"burn_in_epochs": 2}
    strategy = make_strategy("fedpa", context(epochs=2), **options)
    _, down, new_state, upload = fit_one(strategy)
    assert int(new_state[COUNT].item()) == 0
    for name, theta in down.tensors.items():
        last = new_state["model." + name]
        assert not torch.equal(last, theta)  # the client moved
        # float64 difference of the same two float32 tensors, cast to float32: identical
        assert torch.equal(upload.tensors[DELTA + name],
                           (last.double() - theta.double()).float()), name
    new = strategy.aggregate(strategy.init(), [upload], 1, torch.Generator())
    for name in down.tensors:
        # theta + 1 * (last - theta) in float64, cast back: last up to float32 rounding
        torch.testing.assert_close(new[name], new_state["model." + name], rtol=0, atol=1e-6)


def test_client_lr_is_the_step_of_local_sgd():
    # one full-batch epoch and no sample (burn_in_rounds 1): the upload is one SGD step,
    # -client_lr * grad CE(theta), with the gradient computed here independently
    training = LocalTraining(epochs=1, lr=1e-2, batch_size=64)
    strategy = make_strategy("fedpa", context(training=training), client_lr=0.3,
                             burn_in_rounds=1)
    c, down, _, upload = fit_one(strategy)
    model = strategy.template(c.config.body)
    params = {n: down.tensors[n].clone().requires_grad_(True) for n, _ in
              model.named_parameters()}
    loss = torch.nn.functional.cross_entropy(
        torch.func.functional_call(model, params, (c.data.train_x,)), c.data.train_y)
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, _), grad in zip(params.items(), grads, strict=True):
        # float32 forward/backward over the same 12 samples in another order: rounding only
        torch.testing.assert_close(upload.tensors[DELTA + name], -0.3 * grad, rtol=1e-5,
                                   atol=1e-7)


def test_burn_in_epochs_rho_and_normalize_delta_shape_the_upload():
    # 4 epochs with burn_in_epochs 2: 2 samples (epochs 3, 4); the upload is the paper's
    # Delta (normalize_delta False) with rho = 3, from those samples
    strategy = make_strategy("fedpa", context(epochs=4), burn_in_epochs=2, rho=3.0,
                             normalize_delta=False)
    c, down, new_state, upload = fit_one(strategy)
    assert int(new_state[COUNT].item()) == 2 and new_state[SAMPLES].shape[0] == 2
    samples = list(new_state[SAMPLES].to(F64))
    names = [n for n, _ in strategy.template(c.config.body).named_parameters()]
    theta = torch.cat([down.tensors[n].reshape(-1) for n in names]).to(F64)
    delta = flat_delta(strategy, c, upload).to(F64)
    # from the stored float32 samples; 1 / rho_l = 4 amplifies their rounding (~1e-7)
    expected = client_delta(theta, samples, 3.0, normalize=False)
    torch.testing.assert_close(delta, expected, rtol=1e-4, atol=1e-5)
    # the options matter: rho 1 or the normalised upload are far from it (off the samples'
    # span: 4x, 2x and 1x the samples' mean step)
    step = off_span(samples[0] / 2 + samples[1] / 2 - theta, torch.stack(samples))
    assert step.norm() > 1e-3
    torch.testing.assert_close(off_span(delta, torch.stack(samples)), 4 * step, rtol=1e-4,
                               atol=1e-5)
    for other in (client_delta(theta, samples, 1.0, normalize=False),
                  client_delta(theta, samples, 3.0)):
        assert (other - expected).norm() > 0.5 * step.norm()


def hand_uploads(strategy, values=(1.0, 4.0), counts=(1, 3)):
    """Uploads whose deltas are constant: client k's every entry ``values[k]``."""
    params = strategy.parameters(strategy.init())
    return [strategy.up_message(1, k, {**{DELTA + n: torch.full_like(p, v)
                                          for n, p in params.items()},
                                       "num_samples": torch.tensor([n])})
            for k, (v, n) in enumerate(zip(values, counts, strict=True))]


@pytest.mark.parametrize("weighted, mean", [(True, 3.25), (False, 2.5)])
def test_server_lr_momentum_and_weighting_of_the_aggregate(weighted, mean):
    # deltas 1 (n = 1) and 4 (n = 3): weighted mean (1 + 12) / 4 = 3.25, uniform 2.5;
    # server_lr 0.5, momentum 0.5: round 1 moves 0.5 * mean, round 2 0.5 * (0.5 mean + mean)
    strategy = make_strategy("fedpa", context(), server_lr=0.5, server_momentum=0.5,
                             weighted=weighted)
    start = strategy.init()
    ups = hand_uploads(strategy)
    one = strategy.aggregate(start, ups, 1, torch.Generator())
    two = strategy.aggregate(one, ups, 2, torch.Generator())
    for name, theta in strategy.parameters(start).items():
        # exact: binary fractions added in float64 and cast like the strategy does
        assert torch.equal(one[name], (theta.double() + 0.5 * mean).float()), name
        assert torch.equal(two[name], (one[name].double() + 0.5 * 1.5 * mean).float()), name


def test_mc_samples_is_the_number_of_draws_of_the_predictive():
    strategy = make_strategy("fedpa", context(epochs=4), mc_samples=7)
    c, down, new_state, _ = fit_one(strategy)
    post = strategy.posterior(c.config, new_state, down)
    assert post.n_samples == 7 and post.factor.shape[0] == 3  # 3 samples: epochs 2-4


@pytest.mark.parametrize("ratio, rejected", [(None, []), (2.0, [2]), (10.0, [])])
def test_screening_ratio_bounds_the_delta_norm_against_the_rounds_median(ratio, rejected):
    # delta norms in proportion 1 : 1 : 3 (constant deltas 1, 1, 3), equal sample counts:
    # 3 is more than 2x the median and less than 10x
    strategy = make_strategy("fedpa", context(), screening_ratio=ratio)
    plan = strategy.configure(strategy.init(), 1)
    ups = hand_uploads(strategy, (1.0, 1.0, 3.0), (5, 5, 5))
    verdicts = strategy.validate_uploads(plan, [wire(u) for u in ups], [0, 1, 2])
    assert [k for k, v in enumerate(verdicts) if v is not None] == rejected
    if rejected:
        assert "delta norm" in verdicts[2]


def test_the_options_default_to_the_papers_settings():
    strategy = make_strategy("fedpa", context())
    assert (strategy.client_lr, strategy.rho, strategy.burn_in_epochs, strategy.burn_in_rounds,
            strategy.server_lr, strategy.server_momentum, strategy.normalize_delta,
            strategy.weighted, strategy.mc_samples, strategy.screening_ratio) == (
        0.05, 1.0, 1, 0, 1.0, 0.0, True, True, 32, 10.0)


@pytest.mark.parametrize("option, lowest, bad, message", [
    ("client_lr", 1e-12, 0.0, r"fedpa client_lr must be a finite number >= 1e-12, got 0\.0"),
    ("rho", 0.0, -0.5, r"fedpa rho must be a finite number >= 0, got -0\.5"),
    ("burn_in_epochs", 1, 0, r"fedpa burn_in_epochs must be an integer >= 1, got 0"),
    ("burn_in_rounds", 0, -1, r"fedpa burn_in_rounds must be an integer >= 0, got -1"),
    ("server_lr", 1e-12, 0.0, r"fedpa server_lr must be a finite number >= 1e-12, got 0\.0"),
    ("server_momentum", 0.0, -0.5,
     r"fedpa server_momentum must be a finite number >= 0, got -0\.5"),
    ("server_momentum", 0.999, 1.0, r"fedpa server_momentum must be in \[0, 1\), got 1\.0"),
    ("normalize_delta", False, 1, r"fedpa normalize_delta must be true or false, got 1"),
    ("weighted", False, 0, r"fedpa weighted must be true or false, got 0"),
    ("mc_samples", 1, 0, r"fedpa mc_samples must be an integer >= 1, got 0"),
    ("mc_samples", 1, 2.0, r"fedpa mc_samples must be an integer >= 1, got 2\.0"),
    ("screening_ratio", 1.0, 0.5, r"fedpa screening_ratio must be a finite number >= 1, "
                                  r"got 0\.5"),
    ("screening_ratio", None, "2", r"fedpa screening_ratio must be a finite number >= 1, "
                                   r"got '2'"),
])
def test_each_option_accepts_its_bound_and_rejects_what_lies_beyond(option, lowest, bad,
                                                                     message):
    assert getattr(make_strategy("fedpa", context(), **{option: lowest}), option) == lowest
    with pytest.raises(ConfigError, match=message):
        make_strategy("fedpa", context(), **{option: bad})


def test_one_body_spec_for_all_clients():
    with pytest.raises(ConfigError, match=r"fedpa averages every parameter of the network: "
                                          r"use one body spec for all clients, "
                                          r"got \['mlp:16', 'mlp:8'\]"):
        make_strategy("fedpa", context(bodies=("mlp:8", "mlp:16", "mlp:8")))
