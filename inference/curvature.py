"""The curvature of the softmax (categorical) negative log-likelihood, written once.

In logit space the Hessian of ``-log softmax(f)_y`` does not depend on the label ``y``:

    ``Lambda(f) = diag(p) - p p^T``,  ``p = softmax(f)``  (:func:`softmax_nll_hessian`),

a (C, C) positive semidefinite matrix of rank C - 1 (its null space is the all-ones vector:
adding a constant to every logit changes nothing). Chained through a network's Jacobian
``J(x) = df/dtheta`` (C, P) it gives the generalised Gauss-Newton matrix

    ``GGN = sum_x J(x)^T Lambda(x) J(x)``  (P, P)  (:func:`ggn`),

and its diagonal ``sum_x [sum_o p_o J_or^2 - (sum_o p_o J_or)^2]`` (:func:`ggn_diagonal`).
Code that never forms ``J`` (vector-Jacobian products, layer factorisations) contracts the
network with a square root of ``Lambda`` instead: ``Lambda = M M^T``, ``M`` (C, C) with columns
``sqrt(p_k) (e_k - p)`` (:func:`softmax_hessian_sqrt`) or (C, C - 1) by a Householder reflector
(:func:`softmax_hessian_sqrt_reduced`); with ``Z = J^T M`` (P, K) per row, ``GGN = sum Z Z^T``
(:func:`ggn_from_sqrt`) and its diagonal the row sums of ``Z^2``
(:func:`ggn_diagonal_from_sqrt`). The subnetwork Laplace (``inference.subnet``: the full
block, the diagonal, the low-rank factor) computes its curvature through these.

Shapes use B for rows (inputs), C for classes, P for parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.errors import InvalidInputError

__all__ = [
    "ggn",
    "ggn_diagonal",
    "ggn_diagonal_from_sqrt",
    "ggn_from_sqrt",
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
    :func:`softmax_hessian_sqrt` has C (rank C - 1 either way).

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
    K square-root vectors of :func:`softmax_hessian_sqrt` (or its reduced form).

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
    """The diagonal of :func:`ggn_from_sqrt`: row sums of ``Z^2``, (P,).

    Args:
        factor: (P, K), as for :func:`ggn_from_sqrt`.
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
    """Diagonal of :func:`ggn`, (P,): ``sum_b [sum_o p_o J_or^2 - (sum_o p_o J_or)^2]``.

    Written as a variance (``E_p[J_r^2] - E_p[J_r]^2`` per row), which needs only the
    (B, C, P) Jacobian, no square root and no (P, P) matrix.

    Args:
        jacobians: (B, C, P) per-row Jacobians.
        probs: (B, C) softmax probabilities.
    """
    _check_jacobians(jacobians, probs)
    weighted = probs.unsqueeze(-1) * jacobians
    return (weighted * jacobians).sum((0, 1)) - weighted.sum(1).square().sum(0)
