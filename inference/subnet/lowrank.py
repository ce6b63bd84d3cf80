"""Marginal variances of the subnet GGN-Laplace posterior through its low-rank GGN (Woodbury).

The subnet precision is ``P = D + H``, ``D = diag(prior_precision)`` (S,) and ``H = sum_b
J_b^T Lambda_b J_b`` over the client's n inputs. For Linear-layer entries the Jacobian factors,
``J[b, o, s] = G[o, b, u_s] A[b, s]`` (`SubnetJacobian.linear_factors`), and with
``Lambda_b = V_b V_b^T``, V_b (C, C - 1)
(`inference.curvature.softmax_hessian_sqrt_reduced`; the softmax Hessian has rank C - 1),
``H = W W^T`` with ``W[s, (b, j)] = A[b, s] Q_b[u_s, j]``,
``Q_b = (V_b^T dlogits/dz)^T`` (U, C - 1) over the subnet's U units. Per sample only the units
that are active (a nonzero row of Q_b) count, so ``Q_b Q_b^T = F_b F_b^T`` with F_b of
``r_b = min(active units, C - 1)`` columns (an LQ factor when fewer units than C - 1 are
active). With ``r = sum_b r_b < S``, Woodbury gives

    ``diag(P^{-1})_s = 1 / D_s - (W_s^T K^{-1} W_s) / D_s^2``,  ``K = I_r + W^T D^{-1} W``,

and the structure keeps everything but K's factorisation small: ``K[(b, j), (b', j')] =
delta + sum_u F_b[u, j] M_u[b, b'] F_b'[u, j']`` with ``M_u = A_u D_u^{-1} A_u^T`` (n x n per
unit), and ``W_s^T K^{-1} W_s = A[:, s]^T Omega_{u_s} A[:, s]`` with ``Omega_u[b, b'] =
sum_{j, j'} F_b[u, j] (K^{-1})[(b, j), (b', j')] F_b'[u, j']``. Cost: ``r^3`` (Cholesky and
inverse of K) plus ``O(n^2 (S + U (C - 1)^2))``, against ``S^2 n + 2 S^3 / 3`` for forming and
factorising the S x S precision (`SubnetLaplacePosterior`). FedSI's upload needs only
these variances, every client every round; at |S| = 3,925 and n = 250, r is 500-2,250.

Same algebra as the dense route in float64 (A and G, like the dense route's, come in the model's
dtype). The subtraction loses relative accuracy where the data shrink an entry's variance far
below its prior's (``1 / D_s``); where that ratio exceeds `MAX_SHRINKAGE` the function
returns None and the caller takes the dense route.

Where the time goes and what is left (issue 41; S1 seed 0, r = 2,250, one thread, CPU-s a call):
Cholesky of K 0.10 and ``potri`` 0.16 (LAPACK, about two thirds of the call), the kernel 0.06,
the unit quadratic forms 0.045. Measured and not taken: writing only K's upper triangle (what
the Cholesky reads) gave no measurable gain (the kernel is bound by its inputs' reads), and
``trtri`` + a Gram of ``L^{-1} F`` costs what ``potri`` + the quadratic forms cost (0.11 + 0.10
against 0.16 + 0.045). Other routes measured on S1's subnets: the unit-space Woodbury (rank
``sum_u min(n_u, active samples of u)``) is no smaller than r (2,444 against 2,250). The data
term is small beside the prior there (the eigenvalues of ``W^T D^{-1} W`` are <= 0.26, K's
condition number <= 1.26, ~960 of them above 1e-12), so a float32 factorisation would keep
~1e-8 relative accuracy at half the LAPACK time; the float64 rule keeps it out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from inference.curvature import softmax_hessian_sqrt_reduced
from inference.errors import InvalidInputError, NumericalError
from inference.subnet.batches import BatchChecks, iterate_batches
from inference.subnet.dense import cholesky_overwrite, lapack_threads, mirror_upper_
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.parameters import check_subnet_indices, flat_trainable_parameters
from inference.subnet.training_mode import eval_mode

__all__ = ["MAX_SHRINKAGE", "softmax_hessian_sqrt_reduced", "subnet_marginal_variance"]

MAX_SHRINKAGE = 1e3
"""Largest ``prior variance / posterior variance`` of an entry the Woodbury route returns: the
subtraction ``1 / D - q / D^2`` then keeps about 13 of float64's 16 digits (measured against the
dense float64 route: agreement to ~1e-13 relative at shrinkage ~1 on FedSI's subnets)."""

ROW_CHUNK_BYTES = 64 * 2**20
"""Working memory of one chunk of rows of K's (U, rows, n, C - 1) intermediate."""

QUADRATIC_CHUNK_BYTES = 2 * 2**20
"""Working memory of one chunk of the unit quadratic forms' (rows, n (C - 1), U) intermediate:
about a core's L2 cache, so that it is read back from there (2.4x faster than one piece)."""


@torch.no_grad()
def subnet_marginal_variance(
    model: nn.Module,
    loader: Iterable,
    subnet_indices: Tensor,
    prior_precision: Tensor,
) -> Tensor | None:
    """``diag((H_S + diag(prior_precision))^{-1})`` (S,) float64, H_S the subnet GGN block
    summed over ``loader``, by Woodbury on its low-rank factor (module docstring); None where
    that route does not apply or is not the cheaper one (a subnet entry outside an
    ``nn.Linear``, rank r >= S, per-unit matrices larger than an S x S one, or an entry whose
    variance the data shrink more than `MAX_SHRINKAGE`-fold): the caller then fits the
    dense posterior.

    Args:
        model: returns (B, C) logits; evaluated in eval mode at its current parameters.
        loader: yields ``(X, y)`` with integer labels (labels only validated).
        subnet_indices: (S,) indices into the trainable-parameter vector.
        prior_precision: (S,) prior precision of the subnet entries, > 0.
    """
    mean = flat_trainable_parameters(model)
    idx = check_subnet_indices(subnet_indices, mean.numel())
    S, device = idx.numel(), mean.device
    prior = prior_precision.detach().to(device, torch.float64).reshape(-1)
    if prior.numel() != S or not bool(((prior > 0) & torch.isfinite(prior)).all()):
        raise InvalidInputError(f"prior_precision must hold {S} finite values > 0")
    checks = BatchChecks()
    A_parts, G_parts = [], []
    with eval_mode(model):
        engine = SubnetJacobian(model, idx, mean)
        if not engine.factorable:
            return None
        plan = engine.unit_runs()
        if plan is None:
            return None
        for X, y in iterate_batches(loader, device):
            factors = engine.linear_factors(X, output_vectors=_reduced_sqrt)
            if factors is None:
                return None
            A, G, logits = factors
            checks.update(logits, y)
            A_parts.append(A)
            G_parts.append(G.index_select(2, plan.present))
    checks.finish()
    A = torch.cat(A_parts).to(torch.float64)  # (n, S)
    Q = torch.cat(G_parts, dim=1).to(torch.float64).permute(1, 2, 0).contiguous()  # (n, U, J)
    n, U, J = Q.shape
    F, valid = _sample_factors(Q)
    r = int(valid.sum())
    if r >= S or U * n * n > S * S:
        return None
    dinv = prior.reciprocal()
    M = A.new_zeros(U, n, n)  # M_u = A_u D_u^{-1} A_u^T
    for start, end, u in plan.runs:
        block = A[:, start:end]
        M[u].addmm_(block * dinv[start:end], block.T)
    kept = valid.reshape(-1).nonzero().flatten() if r < n * J else None
    K = _woodbury_kernel(M, F)
    if kept is not None:
        K = K.index_select(0, kept).index_select(1, kept)
    K.diagonal().add_(1.0)
    K_inv = _spd_inverse(K)
    if kept is not None:  # K^{-1} back on the (b, j) grid, zero where j >= r_b
        K_inv = _pad(K_inv, kept, valid.reshape(-1))
    omega = _unit_quadratic(K_inv.view(n, J, n * J), F)  # (U, n, n)
    q = torch.empty(S, dtype=torch.float64, device=device)
    for start, end, u in plan.runs:
        block = A[:, start:end]
        q[start:end] = (omega[u] @ block).mul_(block).sum(0)
    variance = dinv - q * dinv.square()
    ok = torch.isfinite(variance) & (variance * MAX_SHRINKAGE > dinv)
    if not bool(ok.all()):
        return None
    return variance


def _pad(K_inv: Tensor, kept: Tensor, valid: Tensor) -> Tensor:
    """``K_inv`` (r, r) on the (n J, n J) grid: rows and columns ``kept`` (sorted) hold it, the
    other n J - r rows and columns are zero. Written into one uninitialised matrix whose few
    dropped rows and columns are then cleared (zero-filling it all and an (r, n J) staging
    matrix cost two more passes over ~(n J)^2 values)."""
    N = valid.numel()
    padded = K_inv.new_empty(N, N)
    padded[kept.unsqueeze(1), kept] = K_inv
    dropped = (~valid).nonzero().flatten()
    padded[dropped] = 0.0
    padded[:, dropped] = 0.0
    return padded


def _reduced_sqrt(logits: Tensor) -> Tensor:
    return softmax_hessian_sqrt_reduced(torch.softmax(logits, dim=-1))


def _sample_factors(Q: Tensor) -> tuple[Tensor, Tensor]:
    """``(F (n, U, J), valid (n, J))`` with ``F_b F_b^T = Q_b Q_b^T`` and F_b's columns
    ``j >= r_b = min(active units of b, J)`` zero (``valid`` marks the others).

    A sample with fewer active units (nonzero rows of Q_b) than J gets the transposed R of the QR
    of its active rows' transpose (``Q_a = R^T Z``, so ``Q_a Q_a^T = R^T R``)."""
    n, _, J = Q.shape
    active = (Q != 0).any(dim=2)  # (n, U)
    count = active.sum(dim=1)
    F = Q.clone()
    valid = torch.ones(n, J, dtype=torch.bool, device=Q.device)
    for k in torch.unique(count[count < J]).tolist():
        samples = torch.nonzero(count == k).flatten()
        F[samples] = 0.0
        valid[samples, k:] = False
        if k == 0:
            continue
        units = torch.nonzero(active[samples])[:, 1].view(-1, k)  # active units, ascending
        rows = Q[samples.unsqueeze(1), units]  # (m, k, J)
        R = torch.linalg.qr(rows.transpose(1, 2), mode="r").R  # (m, k, k)
        F[samples.unsqueeze(1), units, :k] = R.transpose(1, 2)
    return F, valid


def _woodbury_kernel(M: Tensor, F: Tensor) -> Tensor:
    """``sum_u F_b[u, j] M_u[b, b'] F_b'[u, j']`` as an (n J, n J) matrix, in row chunks.

    Each chunk's ``M_u[b, b'] F_b'[u, j']`` is written in the (rows, U, n, J) layout the
    product reads, into one buffer reused by every chunk (a permuted temporary was copied once
    more, and a fresh buffer a chunk costs page faults)."""
    U, n, _ = M.shape
    J = F.shape[2]
    out = M.new_empty(n, J, n, J)
    F_units = F.permute(1, 0, 2)  # (U, n, J)
    F_T = F.transpose(1, 2)  # (n, J, U)
    M_rows = M.permute(1, 0, 2)  # (n, U, n): M_rows[b, u, b'] = M_u[b, b']
    rows = max(1, min(n, ROW_CHUNK_BYTES // max(1, U * n * J * M.element_size())))
    buffer = M.new_empty(rows, U, n, J)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        P = torch.mul(M_rows[a:b, :, :, None], F_units[None], out=buffer[: b - a])
        torch.bmm(F_T[a:b], P.view(b - a, U, n * J), out=out[a:b].view(b - a, J, n * J))
    return out.view(n * J, n * J)


def _unit_quadratic(K_inv: Tensor, F: Tensor) -> Tensor:
    """``Omega_u[b, c] = sum_{j, j'} F_b[u, j] K_inv[(b, j), (c, j')] F_c[u, j']``, (U, n, n),
    from the symmetric ``K_inv`` viewed (n, J, n J).

    In chunks of c whose (c, (b, j), u) intermediate stays within `QUADRATIC_CHUNK_BYTES`
    (cache-sized: the whole intermediate is n^2 J U values, 100 MB at FedSI's n = 250, U = 23,
    written once and read J times when it was built in one piece)."""
    n, U, J = F.shape
    F_T = F.transpose(1, 2)  # (n, J, U): F_T[c, j', u] = F_c[u, j']
    omega = K_inv.new_empty(U, n, n)
    rows = max(1, min(n, QUADRATIC_CHUNK_BYTES // max(1, n * J * U * K_inv.element_size())))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        # T[c, (b, j), u] = sum_j' K_inv[(c, j'), (b, j)] F_c[u, j']  (K_inv symmetric)
        T = torch.bmm(K_inv[a:b].transpose(1, 2), F_T[a:b]).view(b - a, n, J, U)
        omega[:, :, a:b] = (T * F_T).sum(2).permute(2, 1, 0)  # [c, b, u] -> [u, b, c]
    return omega


def _spd_inverse(K: Tensor) -> Tensor:
    """The inverse of a symmetric positive definite (r, r) float64 ``K`` (destroyed)."""
    factor, info = cholesky_overwrite(K)
    if info != 0:
        raise NumericalError(f"the Woodbury kernel I + W^T D^-1 W is not positive definite "
                             f"(Cholesky failed at column {info}): non-finite curvature?")
    if factor.device.type == "cpu" and factor.dtype in (torch.float32, torch.float64):
        from scipy.linalg import lapack

        potri = lapack.dpotri if factor.dtype == torch.float64 else lapack.spotri
        with lapack_threads():  # factor: column-major lower; its inverse's lower triangle
            inverse, info = potri(factor.numpy(), lower=1, overwrite_c=1)
        if info == 0:  # the column-major lower triangle is the rows' upper one
            return mirror_upper_(torch.from_numpy(inverse).mT)
    return torch.cholesky_inverse(factor)
