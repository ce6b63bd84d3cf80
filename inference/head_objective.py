"""The objective of a linear head's MAP and its exact curvature: the negative log posterior
under an isotropic Gaussian prior, and the Hessian of the negative log likelihood (softmax or
Gaussian), full or its diagonal. Shared by the Laplace head's mode and evidence
(:mod:`inference.laplace_head`, :mod:`inference.laplace_marglik`) and SGLD's preconditioner."""

from __future__ import annotations

import torch
from torch import Tensor

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


def softmax_curvature(probs: Tensor, inputs: Tensor) -> Tensor:
    """``Σ_n E[diag p_n − p_n p_nᵀ] ⊗ x_n x_nᵀ`` from probability draws ``probs (S, N, C)``
    (``S = 1``: the softmax likelihood's Hessian at one head), ``(d, d)`` with ``d = C (m + 1)``
    for ``inputs (N, m + 1)``.

    Block ``(c, k)`` is ``Xᵀ diag(w_ck) X`` with ``w_nck = E[δ_ck p_nc − p_nc p_nk]``: the
    ``C (C + 1) / 2`` blocks on and above the diagonal are one GEMM ``Xᵀ [w ⊙ X]`` of
    ``(m + 1, N)`` by ``(N, C (C + 1) / 2 · (m + 1))`` per chunk of rows, and the blocks below
    are their transposes (each block is symmetric): ``N C² (m + 1)² / 2`` multiply-adds, against
    ``N C² (m + 1)²`` for the product of the ``(N C, d)`` Jacobian-weighted rows with themselves.
    """
    num_classes, width = probs.shape[-1], inputs.shape[1]
    upper = torch.triu_indices(num_classes, num_classes, device=inputs.device)
    weights = (torch.diag_embed(probs.mean(0))
               - torch.einsum("snc,snk->nck", probs, probs) / probs.shape[0])
    weights = weights[:, upper[0], upper[1]]  # (N, K), K = C (C + 1) / 2
    pairs = weights.shape[1]
    blocks = torch.zeros(width, pairs * width, dtype=inputs.dtype, device=inputs.device)
    rows = max(1, _CHUNK_ELEMENTS // (pairs * width))
    for start in range(0, inputs.shape[0], rows):
        x = inputs[start:start + rows]
        weighted = (weights[start:start + rows, :, None] * x[:, None, :]).reshape(len(x), -1)
        blocks.addmm_(x.T, weighted)
    blocks = blocks.reshape(width, pairs, width).permute(1, 0, 2)  # (K, m + 1, m + 1)
    full = torch.empty(num_classes, num_classes, width, width, dtype=inputs.dtype,
                       device=inputs.device)
    full[upper[0], upper[1]] = blocks
    full[upper[1], upper[0]] = blocks.transpose(1, 2)
    return full.permute(0, 2, 1, 3).reshape(num_classes * width, num_classes * width)


#: Elements of the weighted rows :func:`softmax_curvature` holds at once (32 MB of float64).
_CHUNK_ELEMENTS = 4_000_000


def likelihood_hessian_diagonal(
    flat_weight: Tensor, inputs: Tensor, num_outputs: int, likelihood: Likelihood, noise_std: float
) -> Tensor:
    """Diagonal of :func:`likelihood_hessian` without forming it, ``(d,)``."""
    if likelihood is Likelihood.GAUSSIAN:
        return ((inputs**2).sum(0) / noise_std**2).repeat(num_outputs)
    probs = torch.softmax(inputs @ flat_weight.reshape(num_outputs, inputs.shape[1]).T, dim=-1)
    return ((probs * (1 - probs)).T @ inputs**2).reshape(-1)


__all__ = ["likelihood_hessian", "likelihood_hessian_diagonal", "negative_log_posterior",
           "softmax_curvature"]
