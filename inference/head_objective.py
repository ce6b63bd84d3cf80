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
    # A diagonal block's GEMM rounds its (p, q) and (q, p) entries differently: averaged, the
    # result is exactly symmetric (the blocks below mirror those above), which lets the
    # Cholesky factorisations skip their d² symmetrisation (``symmetric=True``).
    on_diagonal = upper[0] == upper[1]
    blocks[on_diagonal] = 0.5 * (blocks[on_diagonal] + blocks[on_diagonal].transpose(1, 2))
    # written through a (C, C, m + 1, m + 1) view of the (d, d) result: no permuted copy
    full = torch.empty(num_classes, width, num_classes, width, dtype=inputs.dtype,
                       device=inputs.device)
    by_block = full.permute(0, 2, 1, 3)
    by_block[upper[0], upper[1]] = blocks
    by_block[upper[1], upper[0]] = blocks.transpose(1, 2)
    return full.reshape(num_classes * width, num_classes * width)


def logit_covariance(covariance: Tensor, inputs: Tensor, num_classes: int) -> Tensor:
    """Every point's ``C × C`` logit covariance under a head covariance ``Σ (d, d)``:
    ``S_n[c, k] = x_nᵀ Σ_ck x_n``, ``(N, C, C)`` for ``inputs (N, m + 1)``.

    By block rows of the upper triangle: ``X Σ[c, c:]`` is one GEMM per class, ``N (m + 1)²
    C (C + 1) / 2`` multiply-adds in all (half the full contraction's, and no ``(N, C, C, m +
    1)`` temporary; issue 41), and the lower triangle is its mirror (``Σ`` is symmetric).
    """
    width, count = inputs.shape[1], inputs.shape[0]
    out = torch.empty(count, num_classes, num_classes, dtype=covariance.dtype,
                      device=covariance.device)
    for c in range(num_classes):
        rows = inputs @ covariance[c * width:(c + 1) * width, c * width:]  # (N, (C - c)(m + 1))
        out[:, c, c:] = torch.einsum("nkq,nq->nk",
                                     rows.reshape(count, num_classes - c, width), inputs)
    lower = torch.triu_indices(num_classes, num_classes, 1, device=covariance.device)
    out[:, lower[1], lower[0]] = out[:, lower[0], lower[1]]
    return out


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


__all__ = ["likelihood_hessian", "likelihood_hessian_diagonal", "logit_covariance",
           "negative_log_posterior", "softmax_curvature"]
