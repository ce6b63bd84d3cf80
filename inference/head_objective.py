"""The objective of a linear head's MAP and its exact curvature: the negative log posterior
under an isotropic Gaussian prior, and the Hessian of the negative log likelihood (softmax or
Gaussian), full or its diagonal (the softmax head's curvature itself is
`inference.curvature.softmax_curvature`, re-exported here). Shared by the Laplace head's
mode and evidence (`inference.laplace_head`, `inference.laplace_marglik`) and SGLD's
preconditioner."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from inference.curvature import row_products, softmax_curvature
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


def logit_covariance(covariance: Tensor, inputs: Tensor, num_classes: int) -> Tensor:
    """Every point's ``C × C`` logit covariance under a head covariance ``Σ (d, d)``:
    ``S_n[c, k] = x_nᵀ Σ_ck x_n``, ``(N, C, C)`` for ``inputs (N, m + 1)``.

    By block rows of the upper triangle: ``X Σ[c, c:]`` is one GEMM per class, ``N (m + 1)²
    C (C + 1) / 2`` multiply-adds in all (half the full contraction's, and no ``(N, C, C, m +
    1)`` temporary; issue 41), and the lower triangle is its mirror (``Σ`` is symmetric).
    """
    width, count = inputs.shape[1], inputs.shape[0]
    # the gathers below cost about what the halved GEMM saves at N ≈ 4 (m + 1) rows
    products = row_products(inputs) if count >= 4 * width else None
    if products is not None:
        # S_n[c, k] = Σ_{p ≤ q} (x_n x_nᵀ)_pq (Σ_ck[p, q] + Σ_ck[q, p]) (the diagonal once):
        # one (N, T) by (T, K) GEMM against the cached row products, half the products of the
        # block rows below
        first, second, diagonal = _covariance_index(num_classes, width,
                                                    str(covariance.device))
        flat = covariance.reshape(-1)
        folded = flat.take(first) + flat.take(second)  # (K, T)
        folded[:, diagonal] *= 0.5  # the diagonal was taken twice (exact: a power of 2)
        upper = products @ folded.T  # (N, K)
        pairs = torch.triu_indices(num_classes, num_classes, device=covariance.device)
        out = torch.empty(count, num_classes, num_classes, dtype=covariance.dtype,
                          device=covariance.device)
        out[:, pairs[0], pairs[1]] = upper
        out[:, pairs[1], pairs[0]] = upper
        return out
    out = torch.empty(count, num_classes, num_classes, dtype=covariance.dtype,
                      device=covariance.device)
    for c in range(num_classes):
        rows = inputs @ covariance[c * width:(c + 1) * width, c * width:]  # (N, (C - c)(m + 1))
        out[:, c, c:] = torch.einsum("nkq,nq->nk",
                                     rows.reshape(count, num_classes - c, width), inputs)
    lower = torch.triu_indices(num_classes, num_classes, 1, device=covariance.device)
    out[:, lower[1], lower[0]] = out[:, lower[0], lower[1]]
    return out


@functools.lru_cache(maxsize=4)
def _covariance_index(num_classes: int, width: int, device: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """For `logit_covariance`: the flat positions in a ``(d, d)`` covariance of
    ``Σ_ck[p, q]`` and ``Σ_ck[q, p]`` for every upper pair ``(c, k)`` (rows, ``K``) and upper
    ``(p, q)`` (columns, ``T``), and the columns with ``p = q``."""
    pair_rows, pair_cols = torch.triu_indices(num_classes, num_classes, device=device)
    rows, cols = torch.triu_indices(width, width, device=device)
    d = num_classes * width
    first = (pair_rows[:, None] * width + rows[None, :]) * d + pair_cols[:, None] * width + cols
    second = (pair_rows[:, None] * width + cols[None, :]) * d + pair_cols[:, None] * width + rows
    return first, second, rows == cols


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
