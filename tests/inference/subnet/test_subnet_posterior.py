"""SubnetLaplacePosterior: Gaussian algebra, sampling, predictive methods, state and devices."""

from __future__ import annotations

import math

import pytest
import torch
from subnet_cases import make_mlp
from torch.func import functional_call, jacrev, vmap

from inference.errors import InvalidInputError, NumericalError
from inference.posterior import Posterior
from inference.subnet import SubnetLaplacePosterior, fit_subnet_laplace, flat_trainable_parameters
from tests.devices import DEVICES


@pytest.fixture
def fitted(mlp_case):
    model, loader, x_test = mlp_case
    idx = torch.tensor([0, 3, 8, 14, 40, 41, 60, 77])
    prior = torch.linspace(0.2, 3.0, flat_trainable_parameters(model).numel(), dtype=torch.float64)
    return fit_subnet_laplace(model, loader, idx, prior), model, loader, x_test


def full_jacobian(model, x):
    """(B, C, P) Jacobian of all trainable parameters by torch.func (independent reference)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    return torch.cat([jac[k].reshape(x.shape[0], -1, v.numel()) for k, v in params.items()], 2)


def test_satisfies_the_posterior_protocol(fitted):
    post = fitted[0]
    assert isinstance(post, Posterior)
    assert post.kind == "subnet_laplace"
    assert post.mean.shape == (flat_trainable_parameters(fitted[1]).numel(),)


def test_covariance_and_cholesky_invert_the_precision(fitted):
    post = fitted[0]
    eye = torch.eye(post.n_subnet, dtype=torch.float64)
    assert post.cholesky.dtype == torch.float64
    assert torch.allclose(post.cholesky @ post.cholesky.T, post.precision, atol=1e-12)
    assert torch.allclose(post.covariance @ post.precision, eye, atol=1e-10)
    assert torch.allclose(post.marginal_variance_subnet(), post.covariance.diagonal(), atol=1e-12)


def test_sample_covariance_of_20000_draws_matches_the_analytic_covariance(fitted):
    """Wishart standard error of a sample covariance entry: sqrt((S_ij^2 + S_ii S_jj) / n).

    Tolerance: 5 standard errors per entry (64 entries; a 5-sigma excursion has probability
    ~6e-7 each). The transposed-factor bug of laplace-torch 0.2.3 (cov = L^T L for the
    covariance's Cholesky factor L) would fail this test: checked below on the same numbers.
    """
    post = fitted[0]
    n = 20_000
    draws = post.sample(n, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (n, post.n_params)
    idx = post.subnet_indices
    outside = torch.ones(post.n_params, dtype=torch.bool)
    outside[idx] = False
    assert torch.equal(draws[:, outside], post.mean[outside].expand(n, -1))

    sub = draws[:, idx].double()
    cov = post.covariance
    std_err = ((cov.square() + torch.outer(cov.diagonal(), cov.diagonal())) / n).sqrt()
    sample_cov = torch.cov(sub.T)
    assert bool(((sample_cov - cov).abs() <= 5 * std_err).all())
    mean_err = (cov.diagonal() / n).sqrt()
    assert bool(((sub.mean(0) - post.mean_subnet).abs() <= 5 * mean_err).all())

    lower = torch.linalg.cholesky(cov)
    wrong = lower.T @ lower
    assert bool(((wrong - cov).abs() > 5 * std_err).any())


def test_marginal_std_full_is_zero_outside_the_subnet(fitted):
    post = fitted[0]
    std = post.marginal_std_full()
    assert std.shape == post.mean.shape and std.dtype == post.mean.dtype
    assert torch.allclose(std[post.subnet_indices], post.covariance.diagonal().sqrt())
    mask = torch.ones_like(std, dtype=torch.bool)
    mask[post.subnet_indices] = False
    assert bool((std[mask] == 0).all())


def test_glm_probit_equals_hand_written_probit_on_a_torch_func_jacobian(fitted):
    """Reference: J from torch.func over all parameters, sliced; var = diag(J Sigma J^T)."""
    post, model, _, x = fitted
    J = full_jacobian(model, x)[:, :, post.subnet_indices]
    f_var = torch.einsum("bcs,st,bct->bc", J, post.covariance, J)
    logits = model(x)
    expected = torch.softmax(logits / torch.sqrt(1 + math.pi / 8 * f_var), dim=-1)
    assert torch.allclose(post.predict_proba(x), expected, atol=1e-12)
    assert torch.allclose(post.predict_proba(x, "map"), torch.softmax(logits, -1), atol=1e-14)


def test_glm_mc_matches_monte_carlo_of_the_linearised_logit_gaussian(fitted):
    """Reference: 100,000 draws from N(f, J Sigma J^T) per input (function space).

    Tolerance per entry: 5 Monte-Carlo standard errors of our 20,000-draw estimate plus 5 of
    the reference's, the per-draw standard deviation of each probability estimated from the
    reference draws.
    """
    post, model, _, x = fitted
    J = full_jacobian(model, x)[:, :, post.subnet_indices]
    f_cov = torch.einsum("bcs,st,bkt->bck", J, post.covariance, J)
    f_mu = model(x).detach()
    g = torch.Generator().manual_seed(1)
    chol = torch.linalg.cholesky(f_cov + 1e-12 * torch.eye(f_cov.shape[-1], dtype=f_cov.dtype))
    z = torch.randn(100_000, *f_mu.shape, generator=g, dtype=f_mu.dtype)
    ref_draws = torch.softmax(f_mu + torch.einsum("bck,nbk->nbc", chol, z), -1)
    ref, sd = ref_draws.mean(0), ref_draws.std(0)
    probs = post.predict_proba(x, "glm_mc", n_samples=20_000, generator=g)
    assert torch.allclose(probs.sum(-1), torch.ones(x.shape[0], dtype=probs.dtype))
    tolerance = 5 * sd / math.sqrt(20_000) + 5 * sd / math.sqrt(100_000)
    assert bool(((probs - ref).abs() <= tolerance).all())
    assert not torch.allclose(probs, post.predict_proba(x, "map"), atol=1e-4)  # not trivial


def test_predictions_are_linearised_at_the_mean_not_the_current_model_weights(fitted):
    post, model, _, x = fitted
    before = post.predict_proba(x)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.allclose(post.predict_proba(x), before, atol=0, rtol=0)


def test_state_dict_holds_tensors_only_and_round_trips(fitted, tmp_path):
    from safetensors.torch import load_file, save_file

    post, model, _, x = fitted
    state = post.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "post.safetensors")
    loaded = load_file(tmp_path / "post.safetensors")
    back = SubnetLaplacePosterior.from_state_dict(loaded, model=model)
    assert torch.equal(back.subnet_indices, post.subnet_indices)
    assert torch.equal(back.precision, post.precision)
    assert torch.allclose(back.predict_proba(x), post.predict_proba(x), atol=0, rtol=0)

    unbound = SubnetLaplacePosterior.from_state_dict(loaded)
    with pytest.raises(InvalidInputError, match="bind"):
        unbound.predict_proba(x)
    assert torch.equal(unbound.bind(model).predict_proba(x), post.predict_proba(x))
    with pytest.raises(InvalidInputError, match="trainable parameters"):
        unbound.bind(torch.nn.Linear(5, 3).double())
    with pytest.raises(InvalidInputError, match="missing"):
        SubnetLaplacePosterior.from_state_dict({"mean": state["mean"]})


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_moves_every_tensor_and_predicts_the_same(fitted, device):
    post, _, _, x = fitted
    moved = post.to(device)
    assert moved.mean.device.type == device
    assert moved.cholesky.device.type == device
    assert moved.subnet_indices.device.type == "cpu"  # laplace-torch needs CPU LongTensor
    probs = moved.predict_proba(x.to(device))
    assert probs.device.type == device
    assert torch.allclose(probs.cpu(), post.predict_proba(x), atol=1e-10)
    assert moved.sample(3).device.type == device


def test_non_positive_definite_precision_is_a_numerical_error():
    mean = torch.zeros(4, dtype=torch.float64)
    ggn = -10.0 * torch.eye(2, dtype=torch.float64)
    with pytest.raises(NumericalError, match="positive definite"):
        SubnetLaplacePosterior(mean, torch.tensor([0, 1]), ggn, torch.ones(2))


def test_bad_predictive_arguments_are_rejected(fitted):
    post, _, _, x = fitted
    with pytest.raises(InvalidInputError, match="method"):
        post.predict_proba(x, "bridge")
    with pytest.raises(InvalidInputError, match="n_samples"):
        post.predict_proba(x, "glm_mc", n_samples=0)
    with pytest.raises(InvalidInputError, match="positive int"):
        post.sample(0)


def test_chunked_prediction_equals_one_chunk(fitted):
    post, _, _, x = fitted
    assert torch.allclose(post.predict_proba(x, chunk_size=3), post.predict_proba(x), atol=1e-14)


def test_fit_restores_the_models_training_flag(mlp_case):
    model, loader, _ = mlp_case
    model.train()
    post = fit_subnet_laplace(model, loader, torch.tensor([1, 2]), 1.0)
    assert model.training
    post.predict_proba(torch.zeros(2, 5, dtype=torch.float64))
    assert model.training
    assert make_mlp().training  # the helper's models start in train mode, as users' do
