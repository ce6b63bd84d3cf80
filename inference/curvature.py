"""The curvature of the softmax (categorical) negative log-likelihood, written once.

In logit space the Hessian of ``-log softmax(f)_y`` does not depend on the label ``y``:

    ``Lambda(f) = diag(p) - p p^T``,  ``p = softmax(f)``  (`softmax_nll_hessian`),

a (C, C) positive semidefinite matrix of rank C - 1 (its null space is the all-ones vector:
adding a constant to every logit changes nothing). Chained through a network's Jacobian
``J(x) = df/dtheta`` (C, P) it gives the generalised Gauss-Newton matrix

    ``GGN = sum_x J(x)^T Lambda(x) J(x)``  (P, P)  (`ggn`),

and its diagonal ``sum_x [sum_o p_o J_or^2 - (sum_o p_o J_or)^2]`` (`ggn_diagonal`).
Code that never forms ``J`` (vector-Jacobian products, layer factorisations) contracts the
network with a square root of ``Lambda`` instead: ``Lambda = M M^T``, ``M`` (C, C) with columns
``sqrt(p_k) (e_k - p)`` (`softmax_hessian_sqrt`) or (C, C - 1) by a Householder reflector
(`softmax_hessian_sqrt_reduced`); with ``Z = J^T M`` (P, K) per row, ``GGN = sum Z Z^T``
(`ggn_from_sqrt`) and its diagonal the row sums of ``Z^2``
(`ggn_diagonal_from_sqrt`). The subnetwork Laplace (``inference.subnet``: the full
block, the diagonal, the low-rank factor) computes its curvature through these. A linear head on
fixed features (the Laplace head, its KL-optimal refinement, SGLD's preconditioner) has the
Jacobian ``I_C ⊗ x^T``, and its curvature is built by blocks from the rows' products
(`softmax_curvature`, `expected_head_curvature`).

Shapes use B for rows (inputs), C for classes, P for parameters.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from inference.errors import InvalidInputError

__all__ = [
    "expected_head_curvature",
    "expected_softmax_hessian",
    "ggn",
    "ggn_diagonal",
    "ggn_diagonal_from_sqrt",
    "ggn_from_sqrt",
    "logit_covariance",
    "row_products",
    "softmax_curvature",
    "softmax_hessian_sqrt",
    "softmax_hessian_sqrt_reduced",
    "softmax_nll_hessian",
]


def _check_probs(probs: Tensor) -> None:
    if not isinstance(probs, Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        raise InvalidInputError(
            "probs must be a (B, C) floating tensor of softmax probabilities, got "
            f"{getattr(probs, 'shape', type(probs).__name__)}"
        )


def softmax_nll_hessian(probs: Tensor) -> Tensor:
    """``diag(p_b) - p_b p_b^T`` per row: the Hessian of the softmax NLL in logit space.

    Args:
        probs: (B, C) softmax probabilities.

    Returns:
        (B, C, C), each exactly symmetric.
    """
    _check_probs(probs)
    return torch.diag_embed(probs) - probs.unsqueeze(2) * probs.unsqueeze(1)


def softmax_hessian_sqrt(probs: Tensor) -> Tensor:
    """Vectors ``V`` (C, B, C) with ``sum_k V[k, b] V[k, b]^T = diag(p_b) - p_b p_b^T``.

    ``V[k, b] = sqrt(p_bk) (e_k - p_b)``: ``sum_k p_k (e_k - p)(e_k - p)^T = diag(p) - p p^T``
    because ``sum_k p_k = 1``.

    Args:
        probs: (B, C) softmax probabilities.
    """
    _check_probs(probs)
    C = probs.shape[1]
    eye = torch.eye(C, dtype=probs.dtype, device=probs.device)
    return probs.sqrt().T.unsqueeze(-1) * (eye.unsqueeze(1) - probs.unsqueeze(0))


def softmax_hessian_sqrt_reduced(probs: Tensor) -> Tensor:
    """Vectors ``V`` (C - 1, B, C) with ``sum_k V[k, b] V[k, b]^T = diag(p_b) - p_b p_b^T``.

    ``Lambda = diag(sqrt p) (I - v v^T) diag(sqrt p)``, ``v = sqrt p`` (a unit vector), and
    ``I - v v^T = R R^T`` with R the columns but one of the Householder reflector that maps v to
    ``-e_m`` (m the largest entry of v): ``V_b = diag(sqrt p_b) R_b``, C - 1 vectors where
    `softmax_hessian_sqrt` has C (rank C - 1 either way).

    Args:
        probs: (B, C) softmax probabilities.
    """
    _check_probs(probs)
    B, C = probs.shape
    v = probs.sqrt()
    m = v.argmax(dim=1)
    w = v.clone()
    rows = torch.arange(B, device=probs.device)
    w[rows, m] += 1.0  # w = v + e_m (v_m > 0): no cancellation; w^T w = 2 (1 + v_m)
    householder = torch.eye(C, dtype=probs.dtype, device=probs.device) - (
        w.unsqueeze(2) * w.unsqueeze(1)) / (1.0 + v[rows, m]).view(B, 1, 1)
    keep = torch.ones(B, C, dtype=torch.bool, device=probs.device)
    keep[rows, m] = False
    R = householder.transpose(1, 2)[keep].view(B, C - 1, C)  # (B, C - 1, C): columns but m
    return (R * v.unsqueeze(1)).permute(1, 0, 2)  # V[k, b, c] = sqrt(p_bc) R[b, c, k]


def _check_jacobians(jacobians: Tensor, probs: Tensor) -> None:
    _check_probs(probs)
    if not isinstance(jacobians, Tensor) or jacobians.dim() != 3 or \
            jacobians.shape[:2] != probs.shape:
        raise InvalidInputError(
            f"jacobians must be (B, C, P) with (B, C) = {tuple(probs.shape)} of probs, got "
            f"{getattr(jacobians, 'shape', type(jacobians).__name__)}"
        )


def ggn_from_sqrt(factor: Tensor) -> Tensor:
    """``Z Z^T`` (P, P), exactly symmetric, for ``Z = J^T M`` (P, K) stacked over rows and the
    K square-root vectors of `softmax_hessian_sqrt` (or its reduced form).

    Args:
        factor: (P, K), K = rows x vectors, in any floating dtype (the result has it).
    """
    if factor.dim() != 2:
        raise InvalidInputError(f"factor must be (P, K), got {tuple(factor.shape)}")
    # imported here: inference.subnet imports this module
    from inference.subnet.dense import symmetrize_

    # BLAS may round the two triangles of a Gram differently: average them (tile by tile,
    # no transposed pass over the whole matrix)
    return symmetrize_(factor @ factor.T)


def ggn_diagonal_from_sqrt(factor: Tensor) -> Tensor:
    """The diagonal of `ggn_from_sqrt`: row sums of ``Z^2``, (P,).

    Args:
        factor: (P, K), as for `ggn_from_sqrt`.
    """
    if factor.dim() != 2:
        raise InvalidInputError(f"factor must be (P, K), got {tuple(factor.shape)}")
    return factor.square().sum(1)


def ggn(jacobians: Tensor, probs: Tensor) -> Tensor:
    """``sum_b J_b^T (diag(p_b) - p_b p_b^T) J_b``: the GGN of the softmax NLL, (P, P).

    Args:
        jacobians: (B, C, P) per-row Jacobians of the logits with respect to the parameters.
        probs: (B, C) softmax probabilities of the logits (the curvature's point).

    Returns:
        (P, P) in the inputs' dtype, exactly symmetric, positive semidefinite up to rounding.
    """
    _check_jacobians(jacobians, probs)
    root = softmax_hessian_sqrt(probs)  # (K = C, B, C)
    # Z[p, (k, b)] = sum_o J[b, o, p] M[k, b, o]
    factor = torch.einsum("bop,kbo->pkb", jacobians, root).reshape(jacobians.shape[2], -1)
    return ggn_from_sqrt(factor)


def ggn_diagonal(jacobians: Tensor, probs: Tensor) -> Tensor:
    """Diagonal of `ggn`, (P,): ``sum_b [sum_o p_o J_or^2 - (sum_o p_o J_or)^2]``.

    Written as a variance (``E_p[J_r^2] - E_p[J_r]^2`` per row), which needs only the
    (B, C, P) Jacobian, no square root and no (P, P) matrix.

    Args:
        jacobians: (B, C, P) per-row Jacobians.
        probs: (B, C) softmax probabilities.
    """
    _check_jacobians(jacobians, probs)
    weighted = probs.unsqueeze(-1) * jacobians
    return (weighted * jacobians).sum((0, 1)) - weighted.sum(1).square().sum(0)

# -- linear heads on fixed features ----------------------------------------------------------
# A linear head ``W (C, m + 1)`` on features ``x_n`` has the per-row Jacobian ``I_C ⊗ x_nᵀ``, so
# its GGN (the exact Hessian of the softmax NLL) is ``Σ_n Λ_n ⊗ x_n x_nᵀ``: built by blocks
# from the rows' products, without Jacobians (issue 41; moved here from
# ``inference.head_objective`` and ``inference.variational_gaussian``, issue 42).


def expected_softmax_hessian(probs: Tensor) -> Tensor:
    """``E[diag p_n − p_n p_nᵀ]``, ``(N, C, C)``, from probability draws ``probs (S, N, C)``:
    each point's softmax Hessian in its logits, averaged over the draws.

    The products are contracted over ``s`` from one contiguous ``(S, N, C)`` copy: the
    variational fit holds the draws as a view of ``(S, C, N)`` memory (its log-softmax runs
    over a middle axis), and the contraction on that view ran ~4x slower than the copy and the
    contraction together, to the same bits (``(64, 250, 10)``: 1.07 -> 0.28 ms; ``(64, 3,000,
    10)``: 14.7 -> 3.8 ms; issue 41). The mean stays on the caller's layout: its summation
    order there is the former one, so fits are bit for bit what they were."""
    rows = probs.contiguous()
    return (torch.diag_embed(probs.mean(0))
            - torch.einsum("snc,snk->nck", rows, rows) / probs.shape[0])


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
    weights = expected_softmax_hessian(probs)[:, upper[0], upper[1]]  # (N, K), K = C (C + 1) / 2
    # the gather index below is as large as the result (int64): cached only for moderate d
    d = num_classes * width
    products = row_products(inputs) if d * d <= _INDEX_ELEMENTS else None
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


def expected_head_curvature(probs: Tensor, inputs: Tensor, diagonal: bool = False) -> Tensor:
    """``E_q[H] = Σ_n E[diag p − p pᵀ] ⊗ x_n x_nᵀ`` from probability draws ``probs (S, N, C)``
    of a linear head on ``inputs (N, m + 1)``: ``(d, d)`` (`softmax_curvature`), or its
    diagonal ``(d,)`` with ``diagonal`` (the KL-optimal Gaussian's expected curvature,
    `inference.variational_gaussian`)."""
    if diagonal:
        variance = (probs * (1 - probs)).mean(0)  # (N, C): E[p_c (1 − p_c)]
        return (variance.T @ inputs**2).reshape(-1)
    return softmax_curvature(probs, inputs)


#: Elements of the weighted rows `softmax_curvature` holds at once (32 MB of float64).
_CHUNK_ELEMENTS = 4_000_000
#: Elements of the cached row products (`row_products`) at most (128 MB of float64):
#: 1,010-parameter heads (m = 100) up to ~3,100 rows; larger inputs take the block-row path.
_PRODUCT_ELEMENTS = 16_000_000
#: Entries at most of `softmax_curvature`'s cached gather index (``d²``, int64: 36 MB, so
#: ``d`` up to ~2,100; larger heads take the block-row path).
_INDEX_ELEMENTS = 4_500_000
#: ``[(weak reference to inputs, inputs._version, products)]``: the products of the last
#: inputs seen (one Laplace head fit builds its curvature and logit covariances 20-30 times
#: from the same inputs; issue 41).
_PRODUCTS: list[tuple[weakref.ref, int, Tensor]] = []


def row_products(inputs: Tensor) -> Tensor | None:
    """The upper triangles of every row's ``x_n x_nᵀ``, ``(N, T)`` with ``T = (m + 1)(m + 2) /
    2`` in ``torch.triu_indices`` order, cached for the last ``inputs`` (same object, not
    modified in place since); ``None`` above `_PRODUCT_ELEMENTS`."""
    count, width = inputs.shape
    if count * width * (width + 1) // 2 > _PRODUCT_ELEMENTS:
        return None
    for reference, version, products in _PRODUCTS:
        if reference() is inputs and inputs._version == version:
            return products
    # row by row of the triangle into one buffer: the same products (bit for bit) as
    # ``inputs[:, rows] * inputs[:, cols]`` over ``triu_indices``, without its two gathered
    # (N, T) copies (3,000 x 101 inputs: 0.25 -> 0.07 CPU-s; issue 41)
    products = inputs.new_empty(count, width * (width + 1) // 2)
    start = 0
    for p in range(width):
        torch.mul(inputs[:, p:p + 1], inputs[:, p:], out=products[:, start:start + width - p])
        start += width - p
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
    ``(K, T)`` upper blocks of `softmax_curvature` (``d = C (m + 1)``)."""
    pairs, triangle = _pair_numbers(num_classes, device), _pair_numbers(width, device)
    count = width * (width + 1) // 2
    index = pairs[:, None, :, None] * count + triangle[None, :, None, :]
    return index.reshape(num_classes * width, num_classes * width)


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
