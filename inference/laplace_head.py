"""Laplace approximation of a linear head on fixed features ("laplace" in the factory).

Model: ``W ~ N(μ₀, I/λ)`` over the ``(C, m + 1)`` head (bias in column 0) and
``y ~ Categorical(softmax(W [1, x]))`` (or ``Normal(W [1, x], σ²)`` with ``likelihood="gaussian"``,
``C = 1``). The mode ``W*`` of the log posterior is found in float64 by damped Newton (exact
Hessian) or L-BFGS; the posterior is ``N(W*, (λI + H)⁻¹)`` with ``H`` the exact Hessian of the
negative log likelihood at ``W*``:

    H = Σ_n (diag(p_n) − p_n p_nᵀ) ⊗ x_n x_nᵀ      (softmax; the GGN and the Hessian coincide)

stored full, diagonal (``diag(H)``) or low rank (top ``rank`` eigenpairs of ``H`` plus the
diagonal remainder, so ``diag(H)`` is kept exactly). The returned :class:`GaussianPosterior`'s
likelihood term is ``(H, H W* + λ(W* − μ₀))``: prior + likelihood reproduces the local Laplace
posterior, and K clients combine by adding their terms.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import GaussianPosterior, GaussianTerm, cholesky_with_jitter
from inference.linear_model import log_likelihood, training_tensors
from inference.options import CovarianceStructure, Likelihood, MapSolver

#: Above this many parameters the default solver is L-BFGS (Newton needs a d×d solve per step).
NEWTON_MAX_PARAMETERS = 3000


def negative_log_posterior(
    flat_weight: Tensor, inputs: Tensor, targets: Tensor, num_outputs: int,
    prior_precision: float, prior_mean: float, likelihood: Likelihood, noise_std: float,
) -> Tensor:
    """``−log p(y | W) − log p(W)`` up to a constant, for ``inputs (N, m + 1)`` (scalar)."""
    weight = flat_weight.reshape(num_outputs, inputs.shape[1])
    logits = inputs @ weight.T
    if likelihood is Likelihood.SOFTMAX:
        nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    else:
        nll = 0.5 * (((targets - logits[:, 0]) / noise_std) ** 2).sum()
    return nll + 0.5 * prior_precision * ((flat_weight - prior_mean) ** 2).sum()


def likelihood_hessian(
    flat_weight: Tensor, inputs: Tensor, num_outputs: int, likelihood: Likelihood, noise_std: float
) -> Tensor:
    """Exact ``(d, d)`` Hessian of the negative log likelihood (float64, ``d = C (m + 1)``)."""
    width = inputs.shape[1]
    if likelihood is Likelihood.GAUSSIAN:
        block = inputs.T @ inputs / noise_std**2
        return torch.kron(torch.eye(num_outputs, dtype=block.dtype, device=block.device), block)
    probs = torch.softmax(inputs @ flat_weight.reshape(num_outputs, width).T, dim=-1)  # (N, C)
    d = num_outputs * width
    weighted = torch.einsum("nc,np,nq->cpq", probs, inputs, inputs)  # Σ p_nc x xᵀ per class
    hessian = torch.block_diag(*weighted)
    outer = (probs[:, :, None] * inputs[:, None, :]).reshape(-1, d)  # rows vec(p_n ⊗ x_n)
    return hessian - outer.T @ outer


def likelihood_hessian_diagonal(
    flat_weight: Tensor, inputs: Tensor, num_outputs: int, likelihood: Likelihood, noise_std: float
) -> Tensor:
    """Diagonal of :func:`likelihood_hessian` without forming it, ``(d,)``."""
    if likelihood is Likelihood.GAUSSIAN:
        return ((inputs**2).sum(0) / noise_std**2).repeat(num_outputs)
    probs = torch.softmax(inputs @ flat_weight.reshape(num_outputs, inputs.shape[1]).T, dim=-1)
    return ((probs * (1 - probs)).T @ inputs**2).reshape(-1)


def _newton(objective, hessian_fn, start: Tensor, prior_precision: float, max_iter: int,
            tol: float) -> Tensor:
    """Damped Newton with Armijo backtracking on a strictly convex objective.

    Stops when half the squared Newton decrement, ``gᵀ (λI + H)⁻¹ g / 2``, is at most ``tol``
    (nats: the predicted distance to the minimum's value).
    """
    theta = start.clone()
    decrement = float("nan")
    for _ in range(max_iter):
        theta_req = theta.detach().requires_grad_(True)
        value = objective(theta_req)
        (grad,) = torch.autograd.grad(value, theta_req)
        precision = hessian_fn(theta) + prior_precision * torch.eye(
            theta.shape[0], dtype=theta.dtype, device=theta.device)
        step = torch.cholesky_solve(-grad[:, None], cholesky_with_jitter(precision))[:, 0]
        decrement = float(-(grad @ step))  # Newton decrement², ≥ 0
        if decrement / 2 <= tol:  # in the quadratic regime: one last full step
            return theta + step
        t = 1.0
        with torch.no_grad():
            while objective(theta + t * step) > value - 0.25 * t * decrement and t > 1e-10:
                t *= 0.5
        theta = theta + t * step
    raise NumericalError(
        f"Newton did not converge in {max_iter} iterations (last Newton decrement "
        f"{decrement:.3e}); raise max_iter or the prior precision."
    )


def _lbfgs(objective, start: Tensor, max_iter: int, tol: float) -> Tensor:
    """L-BFGS (strong Wolfe) from ``start``; raises unless the gradient max-norm ends ≤ 1e-6."""
    theta = start.clone().requires_grad_(True)
    optimiser = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, history_size=50,
                                  tolerance_grad=tol, tolerance_change=1e-15,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimiser.zero_grad()
        value = objective(theta)
        value.backward()
        return value

    optimiser.step(closure)
    grad_norm = float(theta.grad.abs().max())
    if not grad_norm <= max(tol * 1e3, 1e-6):
        raise NumericalError(
            f"L-BFGS stopped with gradient max-norm {grad_norm:.3e} after {max_iter} "
            "iterations; raise max_iter or use solver='newton'."
        )
    return theta.detach()


def find_mode(
    inputs: Tensor, targets: Tensor, num_outputs: int, prior_precision: float,
    prior_mean: float = 0.0, likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0, solver: MapSolver | str | None = None, max_iter: int = 100,
    tol: float = 1e-12,
) -> Tensor:
    """Mode of the log posterior as a flat float64 ``(C (m + 1),)`` vector.

    ``inputs`` are bias-augmented features ``(N, m + 1)`` (float64), ``targets`` int64 labels
    ``(N,)`` (or float64 reals, gaussian). ``solver`` defaults to Newton up to
    :data:`NEWTON_MAX_PARAMETERS` parameters, L-BFGS above. ``max_iter`` bounds Newton's
    iterations (L-BFGS gets at least 500 function evaluations); ``tol`` is Newton's stopping
    threshold on half the squared Newton decrement, in nats.

    Raises:
        NumericalError: the solver did not converge.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    if max_iter < 1:
        raise InvalidInputError(f"max_iter must be at least 1; got {max_iter}.")
    d = num_outputs * inputs.shape[1]
    solver = MapSolver.parse(solver or ("newton" if d <= NEWTON_MAX_PARAMETERS else "lbfgs"),
                             "solver")
    start = torch.full((d,), float(prior_mean), dtype=torch.float64, device=inputs.device)

    def objective(theta: Tensor) -> Tensor:
        return negative_log_posterior(theta, inputs, targets, num_outputs, prior_precision,
                                      prior_mean, likelihood, noise_std)

    if solver is MapSolver.NEWTON:
        def hessian_fn(theta: Tensor) -> Tensor:
            return likelihood_hessian(theta, inputs, num_outputs, likelihood, noise_std)

        return _newton(objective, hessian_fn, start, prior_precision, max_iter, tol)
    return _lbfgs(objective, start, max(max_iter, 500), 1e-10)


def fit_laplace_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_precision: float = 1.0,
    prior_mean: float = 0.0,
    structure: CovarianceStructure | str = CovarianceStructure.FULL,
    rank: int = 20,
    solver: MapSolver | str | None = None,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    max_iter: int = 100,
) -> GaussianPosterior:
    """Laplace posterior of a linear head on fixed features.

    Args:
        features: ``(N, m)`` features from a fixed body (any float dtype, any device).
        labels: ``(N,)`` integer labels in ``[0, num_classes)`` (real targets if gaussian).
        num_classes: ``C`` (use 1 for ``likelihood="gaussian"``).
        prior_precision: ``λ`` of the isotropic prior ``N(prior_mean, I/λ)``, ``> 0``.
        structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (top-``rank`` eigenpairs + diagonal).
        prior_mean: ``μ₀``, the prior mean of every weight.
        structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (top-``rank`` eigenpairs + diagonal).
        rank: ``r ≥ 1`` of the low-rank structure (capped at ``d = C (m + 1)``).
        solver: ``"newton"`` or ``"lbfgs"`` for the mode (default by size).
        likelihood: ``"softmax"`` (classification) or ``"gaussian"`` (regression).
        noise_std: observation noise ``σ > 0`` of the Gaussian likelihood.
        max_iter: Newton iterations at most (see :func:`find_mode`).

    Returns:
        A float64 :class:`GaussianPosterior` over the ``(C, m + 1)`` head, on the features'
        device, with ``n_data = N``.

    Raises:
        InvalidInputError: bad features, labels or options. NumericalError: no convergence.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    structure = CovarianceStructure.parse(structure, "structure")
    if structure is CovarianceStructure.LOWRANK and rank < 1:
        raise InvalidInputError(f"rank must be at least 1 for a low-rank structure; got {rank}.")
    if not prior_precision > 0:
        raise InvalidInputError(f"prior_precision must be positive; got {prior_precision}.")
    inputs, targets = training_tensors(features, labels, num_classes, likelihood, noise_std,
                                       torch.float64)
    mode = find_mode(inputs, targets, num_classes, prior_precision, prior_mean, likelihood,
                     noise_std, solver, max_iter)
    shape = (num_classes, inputs.shape[1])
    d = mode.shape[0]
    prior = GaussianTerm.isotropic(d, prior_precision, prior_mean, device=mode.device)
    if structure is CovarianceStructure.DIAG:
        hess_diag = likelihood_hessian_diagonal(mode, inputs, num_classes, likelihood, noise_std)
        lik = GaussianTerm(structure, hess_diag * mode + prior_precision * (mode - prior_mean),
                           diag=hess_diag)
        return GaussianPosterior(prior, lik, shape, n_data=features.shape[0])
    hessian = likelihood_hessian(mode, inputs, num_classes, likelihood, noise_std)
    shift = hessian @ mode + prior_precision * (mode - prior_mean)
    if structure is CovarianceStructure.FULL:
        lik = GaussianTerm(structure, shift, dense=0.5 * (hessian + hessian.T))
        return GaussianPosterior(prior, lik, shape, n_data=features.shape[0])
    eigenvalues, eigenvectors = torch.linalg.eigh(hessian)
    keep = min(int(rank), d)
    factor = eigenvectors[:, d - keep:] * eigenvalues[d - keep:].clamp_min(0.0).sqrt()
    remainder = (hessian.diagonal() - (factor**2).sum(1)).clamp_min(0.0)
    # The low-rank term's shift is Λ_lr W* + λ(W* − μ₀) so that its own mean is still W*.
    lr_hessian = GaussianTerm(structure, torch.zeros_like(mode), diag=remainder, factor=factor)
    lik = GaussianTerm(structure, lr_hessian.matvec(mode) + prior_precision * (mode - prior_mean),
                       diag=remainder, factor=factor)
    return GaussianPosterior(prior, lik, shape, n_data=features.shape[0])


def log_marginal_likelihood(
    posterior: GaussianPosterior,
    features: Tensor,
    labels: Tensor,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
) -> float:
    """Laplace approximation of the log evidence ``log p(y | X, λ)``, in nats.

    ``log p(y|W*) + log p(W*) + (d/2) log 2π − ½ log|Λ|`` for a posterior from
    :func:`fit_laplace_head` on the same data (its mean is the mode ``W*``, its precision
    ``Λ``; a diag or low-rank posterior uses its own ``Λ``). Exact for the Gaussian likelihood.
    Use it to choose ``prior_precision`` on a grid (larger is better).

    Args:
        posterior: a Laplace posterior over a ``(C, m + 1)`` head with a diagonal prior.
        features: ``(N, m)`` training features; ``labels``: ``(N,)`` (same device as features).
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    prior = posterior.prior
    if prior.structure is not CovarianceStructure.DIAG or len(posterior.shape) != 2:
        raise InvalidInputError(
            "log_marginal_likelihood needs a posterior over a (C, m + 1) head with a diagonal "
            f"prior; got shape {posterior.shape} and a {prior.structure} prior."
        )
    inputs, targets = training_tensors(features, labels, posterior.shape[0], likelihood,
                                       noise_std, torch.float64)
    inputs, targets = inputs.to(posterior.device), targets.to(posterior.device)
    mode = posterior.mean.to(torch.float64)
    log_lik = log_likelihood(mode, inputs, targets, likelihood, noise_std)
    prior_diag = prior.diag.to(torch.float64)
    prior_mean = prior.shift.to(torch.float64) / prior_diag
    flat = mode.reshape(-1)
    d = flat.shape[0]
    log_prior = 0.5 * (torch.log(prior_diag).sum() - d * math.log(2 * math.pi)
                       - (prior_diag * (flat - prior_mean) ** 2).sum())
    log_det = posterior.log_det_precision()
    return float(log_lik + log_prior + 0.5 * d * math.log(2 * math.pi) - 0.5 * log_det)

