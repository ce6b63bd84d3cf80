"""The objective of a linear head's MAP and its exact curvature: the negative log posterior
under an isotropic Gaussian prior, and the Hessian of the negative log likelihood (softmax or
Gaussian), full or its diagonal. Shared by the Laplace head's mode and evidence
(:mod:`inference.laplace_head`, :mod:`inference.laplace_marglik`) and SGLD's preconditioner."""

from __future__ import annotations

import functools
import weakref

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
    products = _row_products(inputs)
    if products is not None:
        # block (c, k)'s upper triangle is Σ_n w_nck (x_n x_nᵀ)_upper: one (K, N) by (N, T) GEMM,
        # T = (m + 1)(m + 2) / 2, half the products of the full blocks and no weighted copy
        # of the rows; every entry of the result is gathered from it, so the mirrored
        # entries are the same numbers (exactly symmetric)
        upper_blocks = weights.T @ products  # (K, T)
        index = _curvature_index(num_classes, width, str(inputs.device))
        return upper_blocks.reshape(-1).take(index.to(inputs.device))
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
    # the gathers below cost about what the halved GEMM saves at N ≈ 4 (m + 1) rows
    products = _row_products(inputs) if count >= 4 * width else None
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


#: Elements of the weighted rows :func:`softmax_curvature` holds at once (32 MB of float64).
_CHUNK_ELEMENTS = 4_000_000
#: Elements of the cached row products (:func:`_row_products`) at most (128 MB of float64):
#: 1,010-parameter heads (m = 100) up to ~3,100 rows; larger inputs take the block-row path.
_PRODUCT_ELEMENTS = 16_000_000
#: ``[(weak reference to inputs, inputs._version, products)]``: the products of the last
#: inputs seen (one Laplace head fit builds its curvature and logit covariances 20-30 times
#: from the same inputs; issue 41).
_PRODUCTS: list[tuple[weakref.ref, int, Tensor]] = []


def _row_products(inputs: Tensor) -> Tensor | None:
    """The upper triangles of every row's ``x_n x_nᵀ``, ``(N, T)`` with ``T = (m + 1)(m + 2) /
    2`` in ``torch.triu_indices`` order, cached for the last ``inputs`` (same object, not
    modified in place since); ``None`` above :data:`_PRODUCT_ELEMENTS`."""
    count, width = inputs.shape
    if count * width * (width + 1) // 2 > _PRODUCT_ELEMENTS:
        return None
    for reference, version, products in _PRODUCTS:
        if reference() is inputs and inputs._version == version:
            return products
    rows, cols = torch.triu_indices(width, width, device=inputs.device)
    products = inputs[:, rows] * inputs[:, cols]
    _PRODUCTS[:] = [(weakref.ref(inputs, lambda _: _PRODUCTS.clear()), inputs._version,
                     products)]
    return products


def _pair_numbers(size: int, device: str) -> Tensor:
    """``(size, size)`` int64: entry ``(i, j)`` is the position of ``(min, max)`` in
    ``torch.triu_indices(size, size)``."""
    rows, cols = torch.triu_indices(size, size)
    numbers = torch.empty(size, size, dtype=torch.int64)
    numbers[rows, cols] = torch.arange(len(rows))
    numbers[cols, rows] = torch.arange(len(rows))
    return numbers.to(device)


@functools.lru_cache(maxsize=4)
def _curvature_index(num_classes: int, width: int, device: str) -> Tensor:
    """``(d, d)`` int64: where entry ``((c, p), (k, q))`` of the curvature lies in the flat
    ``(K, T)`` upper blocks of :func:`softmax_curvature` (``d = C (m + 1)``)."""
    pairs, triangle = _pair_numbers(num_classes, device), _pair_numbers(width, device)
    count = width * (width + 1) // 2
    index = pairs[:, None, :, None] * count + triangle[None, :, None, :]
    return index.reshape(num_classes * width, num_classes * width)


@functools.lru_cache(maxsize=4)
def _covariance_index(num_classes: int, width: int, device: str
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """For :func:`logit_covariance`: the flat positions in a ``(d, d)`` covariance of
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
    """Diagonal of :func:`likelihood_hessian` without forming it, ``(d,)``."""
    if likelihood is Likelihood.GAUSSIAN:
        return ((inputs**2).sum(0) / noise_std**2).repeat(num_outputs)
    probs = torch.softmax(inputs @ flat_weight.reshape(num_outputs, inputs.shape[1]).T, dim=-1)
    return ((probs * (1 - probs)).T @ inputs**2).reshape(-1)


__all__ = ["likelihood_hessian", "likelihood_hessian_diagonal", "logit_covariance",
           "negative_log_posterior", "softmax_curvature"]
