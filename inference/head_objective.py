"""The objective of a linear head's MAP and its exact curvature: the negative log posterior
under an isotropic Gaussian prior, and the Hessian of the negative log likelihood (softmax or
Gaussian), full or its diagonal (the softmax head's curvature itself is
`inference.curvature.softmax_curvature`, and its logit covariances
`inference.curvature.logit_covariance`, both re-exported here). Shared by the Laplace head's
mode and evidence (`inference.laplace_head`, `inference.laplace_marglik`) and SGLD's
preconditioner."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.curvature import logit_covariance, softmax_curvature
from inference.gaussian.cholesky import cholesky_with_jitter
from inference.options import Likelihood


def negative_log_posterior(
    flat_weight: Tensor, inputs: Tensor, targets: Tensor, num_outputs: int,
    prior_precision: float, prior_mean: float | Tensor, likelihood: Likelihood, noise_std: float,
) -> Tensor:
    """``−log p(y | W) − log p(W)`` up to a constant, for ``inputs (N, m + 1)`` (scalar);
    ``prior_mean`` is a number or a flat ``(C (m + 1),)`` tensor."""
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
    return softmax_curvature(probs[None], inputs)


def laplace_precision(
    flat_weight: Tensor, inputs: Tensor, num_outputs: int, prior_precision: float,
    likelihood: Likelihood, noise_std: float,
) -> tuple[Tensor, Tensor]:
    """The Laplace precision ``λI + H(W)`` ``(d, d)`` at a flat float64 head ``W`` and its
    lower Cholesky factor (jittered if needed). A softmax curvature is assembled exactly
    symmetric (mirrored blocks) and a diagonal added in place keeps it so: the factorisation
    skips its symmetrising pass (issue 41); a Gaussian likelihood's ``XᵀX`` is symmetrised."""
    precision = likelihood_hessian(flat_weight, inputs, num_outputs, likelihood, noise_std)
    precision.diagonal().add_(prior_precision)
    chol = cholesky_with_jitter(precision, symmetric=likelihood is Likelihood.SOFTMAX)
    return precision, chol


def likelihood_hessian_diagonal(
    flat_weight: Tensor, inputs: Tensor, num_outputs: int, likelihood: Likelihood, noise_std: float
) -> Tensor:
    """Diagonal of `likelihood_hessian` without forming it, ``(d,)``."""
    if likelihood is Likelihood.GAUSSIAN:
        return ((inputs**2).sum(0) / noise_std**2).repeat(num_outputs)
    probs = torch.softmax(inputs @ flat_weight.reshape(num_outputs, inputs.shape[1]).T, dim=-1)
    return ((probs * (1 - probs)).T @ inputs**2).reshape(-1)


__all__ = ["laplace_precision", "likelihood_hessian", "likelihood_hessian_diagonal",
           "logit_covariance",
           "negative_log_posterior", "softmax_curvature"]
