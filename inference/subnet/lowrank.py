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

and the structure keeps everything but K's factorisation small: ``E = K - I = W^T D^{-1} W``
has entries ``E[(b, j), (b', j')] = sum_u F_b[u, j] M_u[b, b'] F_b'[u, j']`` with ``M_u =
A_u D_u^{-1} A_u^T`` (n x n per unit).

K is neither formed nor inverted. With ``f_bu = |F_b[u]|^2`` and ``F^_b[u] = F_b[u] /
sqrt(f_bu)``, ``E = sum_u Phi_u^T M~_u Phi_u`` where ``M~_u = diag(sqrt f_u) M_u diag(sqrt
f_u)`` and ``Phi_u`` (n, r) has the unit rows ``F^_b[u]`` at columns (b, .). The M~_u are
numerically of low rank (a unit's subnet entries are few and their input activations
collinear; confident samples have tiny f_bu): each is cut by a pivoted Cholesky (LAPACK
``dpstrf``) stopped once every residual diagonal entry is ``<= truncation / (U n)``, ``M~_u =
T_u T_u^T + R_u``, R_u PSD. On S1's subnets m = sum_u m_u = 580-1,020 columns survive at
`TRUNCATION` = 1e-12 against r = 1,740-2,250 (E's own eigenvalues above 1e-12 number
about as many). Then ``E = C C^T + Delta``, ``C[(b, j), i] = F^_b[u_i, j] T[b, i]`` (r, m),
``Delta = sum_u Phi_u^T R_u Phi_u`` PSD with ``trace(Delta) = sum_u trace(R_u) <=
truncation`` (Phi_u's rows have norm 1 or 0). With ``K_t = I + C C^T``: ``K_t^{-1} = I - Y
Y^T``, ``Y = C G^{-T}``, ``G G^T = I + C^T C`` (m x m), whose unit blocks are ``T_u^T
diag_b(F^_b[u] . F^_b[v]) T_v`` (n m^2 flops, not r m^2), and

    ``W_s^T K_t^{-1} W_s = A[:, s]^T (diag_b f_bu - V_u V_u^T) A[:, s]``,
    ``V_u[b] = sum_j F_b[u, j] Y[(b, j)]`` (n, m) per unit (u = u_s).

Bound (what the truncation may move): with ``b_s = W_s / sqrt(D_s)`` the variance is
``v_s = (1 - b_s^T K^{-1} b_s) / D_s``, and ``K = K_t + Delta`` gives ``0 <= K_t^{-1} - K^{-1}
<= K_t^{-1} Delta K_t^{-1}`` (Woodbury on Delta; ``K_t >= I``), so ``0 <= v_s - v_t,s <=
trace(Delta) |b_s|^2 / D_s <= truncation (H_ss / D_s) / D_s``: at most 1e-12 x (H_ss / D_s,
<= 0.26 on S1) of the prior variance, below the ~1e-13 relative rounding of the exact route.
Cost: the unit Grams and their pivoted Cholesky (U n^2 each), G (n m^2) and its Cholesky
(m^3 / 3), the triangular solve for Y (r m^2 / 2) and the ``A_u^T V_u`` products (S n m),
against r^3 for K's Cholesky and inverse and ``n^2 J^2 U`` for forming K; and against
``S^2 n + 2 S^3 / 3`` for forming and factorising the S x S precision
(`SubnetLaplacePosterior`). FedSI's upload needs only these variances, every client every
round; at |S| = 3,925 and n = 250, r is 500-2,250.

The projected route (the marginal variances alone, FedSI's upload; issue 41). ``V``, ``Y``
and the ``A_u^T V_u`` products (``r m^2 + S n m``, two thirds of a call) are avoided by taking
each entry's vector in unit coordinates. Let ``x_s = diag(root_u) A[:, s] / sqrt(D_s)`` (n,),
so ``b_s = W_s / sqrt(D_s)`` is x_s spread by the unit rows ``F^_b[u]`` (``|b_s| = |x_s|``),
and ``Q_u R_u = T_u`` (QR, Q_u orthonormal, zero on the rows T_u is). With ``c_s = Q_u^T x_s``
and ``eps_s = x_s - Q_u c_s``, ``b'_s = C' c_s`` where ``C'`` is C with Q for T, and ``C = C'
R`` (R block diagonal). Woodbury on ``K_t = I + C' R R^T C'^T`` gives ``C'^T K_t^{-1} C' = N -
B^T G^{-1} B`` with ``N = C'^T C'`` (unit blocks ``Q_u^T diag(g[:, u, v]) Q_v``; ``N_uu =
I``), ``B = R^T N`` and ``G = I + B R = I + C^T C`` (the same kernel), so ``b'^T K_t^{-1} b' =
|c_s|^2 - |Z_u c_s|^2``, ``Z = chol(G)^{-1} B`` (m x m): ``m^3`` in all, then ``m m_u`` an
entry. Bound: ``K_t^{-1} <= I`` and ``|b'| <= |b|`` give ``|b^T K_t^{-1} b - b'^T K_t^{-1} b'|
<= 2 |b_s| |eps_s| + |eps_s|^2``, and with the truncation's ``tau |b_s|^2`` each variance is
within ``(tau |b_s|^2 + 2 |b_s| |eps_s| + |eps_s|^2) / D_s`` of the exact one. The bound is
computed for every entry and the route is taken only where it is <= `PROJECTION_TOLERANCE`
(1e-9) of the variance, else the Y route above runs. ``|eps_s|^2 = |x_s|^2 - |c_s|^2`` (Q_u
orthonormal) is first bounded from the two norms the route computes anyway, plus ``gamma
(|x_s|^2 + |c_s|^2)`` for their rounding and Q_u's departure from orthonormality (``gamma = (2
n + m_u + 4) eps``; on S1 that bound is ~1e-10 of each variance); only where it does not suffice
is ``eps_s`` formed explicitly (one more product a run). (A priori
``sum_s |eps_s|^2 <= trace(R_u)``: the Nystrom factor's range holds ``X_u``'s projection on
the pivot rows' span; in practice the unit Grams have an exact rank and ``eps_s`` is rounding.)
On S1 (seed 0, the 20 upload calls of rounds 1 and 30 replayed): the variances equal the Y
route's to 1.7e-13 relative, the float32 stds sent bit for bit the same (39,250 entries), 99
-> 71 and 139 -> 96 ms a call.

How the projected route is computed (issue 41's fourth pass, 284cdef): the entries' vectors
``x_s`` are the rows of one contiguous X (S, n) (`_entry_rows`); the unit Grams ``M~_u = X_u^T
X_u`` come from BLAS ``dsyrk`` (the lower triangle, half a GEMM) straight into ``dpstrf``'s
buffer; N's diagonal blocks are ``Q_u^T Q_u = I`` (``g[b, u, u] = 1`` wherever Q_u's row is not
zero), only its blocks below the diagonal are products, mirrored block by block; and ``|Z_u
c_s|^2 = c_s^T (Z_u^T Z_u) c_s`` with one m_u x m_u Gram a unit (m m_u^2) instead of an (m,
run) product an entry run (m m_u an entry: 3x more on S1). The 20 calls replayed: 69.6-73.1
-> 53.6-58.1 ms a call on average (a loaded machine), the variances within 1.1e-15 of the
former route's, the float32 stds bit for bit the same.

The predictive (`subnet_lowrank_posterior`, `lowrank_logit_variance`; FedSI's personal
posterior, issue 41). The same truncated kernel defines a Gaussian, ``Sigma_t = D^{-1} - D^{-1}
W K_t^{-1} W^T D^{-1}``, whose marginals are the variances above; a logit o of a new input with
Jacobian row ``J_o[s] = G[o, u_s] A_x[s]`` has the linearised variance ``J_o Sigma_t J_o^T =
J_o D^{-1} J_o^T - |z|^2 + |Y^T z|^2``, ``z = W^T D^{-1} J_o^T``, ``z[(b, j)] = sum_u F_b[u, j]
a[b, u]`` with ``a[b, u] = G[o, u] N_u[b, x]`` and ``N_u[b, x] = sum_{s in u} A[b, s] A_x[s] /
D_s`` (the training x new inputs Gram of the prior covariance, per unit). Neither z (n J
numbers a logit) nor Y (n J x m) is formed: ``|z|^2 = sum_b a_b^T (F_b F_b^T) a_b``, and with
``Y = C chol^{-T}``, ``Y^T z = chol^{-1} C^T z`` where ``(C^T z)[i] = sum_b T[b, i] w[b,
u_i]``, ``w[b, v] = sum_u (F^_b[v] . F_b[u]) a[b, u]`` (C's unit structure). Kept: A, F, T (and
its columns' units), chol(I + C^T C) and 1/D (n S + n U J + n m + m^2 numbers, ~20 MB on S1
against the S x S GGN's 123 MB); per logit ``U^2 n`` for |z|^2 and w, ``n m`` for ``C^T z``
and ``m^2 / 2`` for the triangular solve, against ``n J m`` for ``Y^T z`` (3x more on S1, J =
9) and the dense route's ``S^3 / 3`` Cholesky, ``S^3 / 3`` triangular inverse and ``S^2`` per
input. Bound, as for the marginals: ``K = K_t + Delta`` gives ``0 <= J_o (Sigma - Sigma_t)
J_o^T = z^T (K_t^{-1} - K^{-1}) z <= trace(Delta) |K_t^{-1} z|^2 <= truncation |z|^2`` (``K_t
>= I``). On S1's personal posteriors (float64, the posteriors of a 3-round run) the logit
variances equal the dense route's to 8e-16 relative.

Same algebra as the dense route in float64 (A and G, like the dense route's, come in the model's
dtype). The subtraction loses relative accuracy where the data shrink an entry's variance far
below its prior's (``1 / D_s``); where that ratio exceeds `MAX_SHRINKAGE` the function
returns None and the caller takes the dense route.

Where the time goes (issue 41; S1 seed 0, the 30 calls of a 3-round run replayed, one thread,
process time, before and after interleaved): 9.48 -> 3.40 CPU-s in all, median call 0.28 ->
0.097 s, the variances equal to the exact route's to <= 1.8e-16 relative. Before, at r = 2,250:
K's Cholesky 0.10 and ``potri`` 0.16, forming K 0.06, the unit quadratic forms 0.045. Measured
on the way and not taken: the pivoted Cholesky of E itself (k = 580-990, the same bound): 0.19
s a call, forming E (0.05) and ``dpstrf`` at r = 2,250 (0.07) remaining; dropping whole columns
of W by their norms (drops nothing on S1: E's low rank is collinearity, not scale); a float32
factorisation (the float64 rule).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor, nn

from inference.curvature import softmax_hessian_sqrt_reduced
from inference.errors import InvalidInputError, NumericalError
from inference.inputs import as_network_inputs
from inference.subnet.batches import BatchChecks, iterate_batches
from inference.subnet.dense import lapack_threads
from inference.subnet.fit import unit_factor_ggn
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.parameters import check_subnet_indices, flat_trainable_parameters
from inference.subnet.predictive import probit_softmax
from inference.subnet.training_mode import eval_mode

__all__ = ["LOWRANK_KEYS", "MAX_SHRINKAGE", "TRUNCATION", "lowrank_ggn",
           "lowrank_logit_variance", "lowrank_predict_proba", "softmax_hessian_sqrt_reduced",
           "subnet_lowrank_posterior", "subnet_marginal_variance"]

MAX_SHRINKAGE = 1e3
"""Largest ``prior variance / posterior variance`` of an entry the Woodbury route returns: the
subtraction ``1 / D - q / D^2`` then keeps about 13 of float64's 16 digits (measured against the
dense float64 route: agreement to ~1e-13 relative at shrinkage ~1 on FedSI's subnets)."""

TRUNCATION = 1e-12
"""Default trace of the Woodbury kernel's dropped part (summed over the unit Grams' residuals):
each variance moves by at most ``1e-12 * H_ss / D_s`` (``<= 0.26e-12`` on S1's subnets) times
its prior variance, float64's rounding level of the r x r factorisation it replaces."""


@torch.no_grad()
def subnet_marginal_variance(
    model: nn.Module,
    loader: Iterable,
    subnet_indices: Tensor,
    prior_precision: Tensor,
    *,
    truncation: float = TRUNCATION,
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
        truncation: trace of the Woodbury kernel's part that may be dropped (module
            docstring): each variance moves by at most ``truncation * H_ss / D_s`` times its
            prior variance ``1 / D_s``; 0 drops nothing.
    """
    factors = _woodbury(model, loader, subnet_indices, prior_precision, truncation)
    return None if factors is None else factors["variance"]


@torch.no_grad()
def subnet_lowrank_posterior(
    model: nn.Module,
    loader: Iterable,
    subnet_indices: Tensor,
    prior_precision: Tensor,
    *,
    truncation: float = TRUNCATION,
) -> dict[str, Tensor] | None:
    """The subnet posterior in the truncated Woodbury form of `subnet_marginal_variance`
    (module docstring, "The predictive"), as tensors (`LOWRANK_KEYS`): ``subnet`` (S,) int64,
    ``dinv`` (S,) the prior variances, ``A`` (n, S) and ``F`` (n, U, J) the training set's
    Jacobian factors, ``T`` (n, m) the unit Grams' factors side by side with ``unit`` (m,)
    int64 the unit of each column (each unit's columns consecutive, in unit order), and
    ``chol`` (m, m) the lower Cholesky factor of the kernel ``I + C^T C`` (``K_t^{-1} = I - Y
    Y^T``, ``Y = C chol^{-T}``); None where that route does not apply (then the caller fits the
    dense posterior). Arguments as `subnet_marginal_variance`'s, whose variances are this
    Gaussian's marginals. `lowrank_logit_variance` predicts with it (and returns None where its
    subtraction would lose the digits `MAX_SHRINKAGE` guards)."""
    return _woodbury(model, loader, subnet_indices, prior_precision, truncation, keep=True)


def _woodbury(model: nn.Module, loader: Iterable, subnet_indices: Tensor,
              prior_precision: Tensor, truncation: float, keep: bool = False) -> dict | None:
    """The marginal variances and, with ``keep``, the factors the predictive needs."""
    mean = flat_trainable_parameters(model)
    idx = check_subnet_indices(subnet_indices, mean.numel())
    S, device = idx.numel(), mean.device
    prior = prior_precision.detach().to(device, torch.float64).reshape(-1)
    if not truncation >= 0.0:
        raise InvalidInputError(f"truncation must be >= 0, got {truncation}")
    if prior.numel() != S or not bool(((prior > 0) & torch.isfinite(prior)).all()):
        raise InvalidInputError(f"prior_precision must hold {S} finite values > 0")
    checks = BatchChecks()
    A_parts, G_parts = [], []
    with eval_mode(model):
        engine = SubnetJacobian(model, idx, mean)
        if not engine.factorable or engine.unit_runs() is None:
            return None  # before reading any batch
        plan = None
        for X, y in iterate_batches(loader, device):
            factors = engine.unit_factors(X, output_vectors=_reduced_sqrt)
            if factors is None:
                return None
            A, G, logits, plan = factors
            checks.update(logits, y)
            A_parts.append(A)
            G_parts.append(G)
    checks.finish()
    # A^T (S, n) in the model's dtype, each entry's n values in one row
    At = A_parts[0].T if len(A_parts) == 1 else torch.cat([a.T for a in A_parts], dim=1)
    Q = torch.cat(G_parts, dim=1).to(torch.float64).permute(1, 2, 0).contiguous()  # (n, U, J)
    n, U, _ = Q.shape
    F, valid = _sample_factors(Q)
    r = int(valid.sum())
    if r >= S or U * n * n > S * S:
        return None
    dinv = prior.reciprocal()
    root, unit_F = _unit_rows(F)
    # x_s = diag(root_u) A[:, s] / sqrt(D_s), the rows of X (S, n); M~_u = X_u^T X_u ~ T_u
    # T_u^T (n, m_u), residuals PSD of traces summing to <= truncation (pivoted Cholesky per
    # unit); T holds the T_u side by side, unit[i] the unit of column i
    X = _entry_rows(At, root, dinv, plan)
    T, unit = _unit_factors(X, plan.runs, U, truncation)
    g = torch.bmm(unit_F, unit_F.transpose(1, 2))  # (n, U, U): g[b, u, v] = F^_b[u].F^_b[v]
    ends = torch.bincount(unit, minlength=U).cumsum(0).tolist()
    if keep:  # the predictive's factors (it checks its own subtraction, a logit at a time)
        return {"subnet": idx, "dinv": dinv, "A": At.to(torch.float64).T, "F": F, "T": T,
                "unit": unit, "chol": _kernel_cholesky(T, unit, ends, g)}
    # the marginals by the unit bases where their bound allows (the upload's route), else
    # through the kernel's factor Y
    variance = _projected_variance(X, dinv, T, unit, ends, g, plan, truncation)
    if variance is None:
        chol = _kernel_cholesky(T, unit, ends, g)
        variance = _kernel_variance(At.to(torch.float64).T, F, unit_F, T, unit, chol, plan,
                                    dinv)
    ok = torch.isfinite(variance) & (variance * MAX_SHRINKAGE > dinv)
    return {"variance": variance} if bool(ok.all()) else None


def _unit_rows(F: Tensor) -> tuple[Tensor, Tensor]:
    """``(|F_b[u]| (n, U), F^ (n, U, J))``: each sample's unit rows and their norms, ``F^_b[u] =
    F_b[u] / |F_b[u]|`` (0 where the unit is inactive)."""
    root = F.square().sum(2).sqrt()
    return root, torch.where(root[..., None] > 0, F / root.clamp_min(1e-300)[..., None], 0.0)


def _kernel_cholesky(T: Tensor, unit: Tensor, ends: list[int], g: Tensor) -> Tensor:
    """Lower ``chol(I + C^T C)`` (m, m), ``C[(b, j), i] = F^_b[unit_i, j] T[b, i]``: E_t = C C^T.

    ``I + C^T C`` by unit blocks, ``C_u^T C_v = T_u^T diag(g[:, u, v]) T_v`` (n m^2, not n J
    m^2); the units' columns are consecutive, and only the lower triangle is formed (v <= u: the
    Cholesky reads no other; the upper stays zero)."""
    m = T.shape[1]
    Tt = T.T.contiguous()  # (m, n): each column's rows contiguous, as the weights'
    gram = T.new_zeros(m, m)
    weights = _unit_weights(g, ends)
    for u, end in enumerate(ends):
        start = ends[u - 1] if u else 0
        if end > start:
            gram[start:end, :end] = Tt[start:end] @ (Tt[:end] * weights(u)).T
    gram.diagonal().add_(1.0)
    chol, info = torch.linalg.cholesky_ex(gram)
    if info != 0:  # I + C^T C >= I: only non-finite curvature gets here
        raise NumericalError("the truncated Woodbury kernel I + C^T C is not positive definite "
                             "(non-finite curvature?)")
    return chol


def _unit_weights(g: Tensor, ends: list[int]):
    """``u -> g[:, u, unit[:ends[u]]].T`` (ends[u], n), contiguous: unit u's row of ``g`` (n,
    U, U) spread over the columns of the units up to u (each unit's columns consecutive,
    ``ends`` their ends), one row a column, to scale the rows of a transposed factor. The same
    numbers as that gather, by `torch.repeat_interleave` over a (U, U, n) copy of ``g`` (~7x
    cheaper than 25 advanced-indexing gathers at S1's U = 25; issue 41)."""
    by_unit = g.permute(1, 2, 0).contiguous()  # (U, U, n)
    counts = torch.tensor([end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)],
                          device=g.device)

    def weights(u: int) -> Tensor:
        return torch.repeat_interleave(by_unit[u, : u + 1], counts[: u + 1], dim=0,
                                       output_size=ends[u])
    return weights


def _kernel_variance(A: Tensor, F: Tensor, unit_F: Tensor, T: Tensor, unit: Tensor,
                     chol: Tensor, plan, dinv: Tensor) -> Tensor:
    """The marginal variances through ``K_t^{-1} = I - Y Y^T``, ``Y = C chol^{-T}`` (n J, m)
    (module docstring; the route where `_projected_variance`'s bound declines)."""
    n, _, J = F.shape
    m = T.shape[1]
    C = (unit_F[:, unit, :].transpose(1, 2) * T[:, None, :]).reshape(n * J, m)
    Y = torch.linalg.solve_triangular(chol.mT, C, upper=True, left=False)  # row (b, j)
    del C
    # V[b, u] = sum_j F_b[u, j] Y[(b, j)]: Omega_u = diag_b(|F_b[u]|^2) - V_u V_u^T
    V = torch.bmm(F, Y.view(n, J, m))  # (n, U, m)
    f = F.square().sum(2)  # (n, U)
    q = torch.empty_like(dinv)
    for start, end, u in plan.runs:
        block = A[:, start:end]
        q[start:end] = f[:, u] @ block.square() - torch.mm(block.T, V[:, u]).square().sum(1)
    return dinv - q * dinv.square()



PROJECTION_TOLERANCE = 1e-9
"""Largest a-posteriori bound, relative to the variance, `_projected_variance` accepts (60x
below float32's rounding of the uploaded std's square); above it the Y route runs."""


def _projected_variance(X: Tensor, dinv: Tensor, T: Tensor, unit: Tensor, ends: list[int],
                        g: Tensor, plan, truncation: float) -> Tensor | None:
    """The marginal variances by the unit bases (module docstring, "The projected route"), or
    None where their a-posteriori bound exceeds `PROJECTION_TOLERANCE` of a variance. ``X``
    (S, n): the entries' vectors ``x_s`` (`_entry_rows`)."""
    n, m = T.shape
    U = len(ends)
    starts = [0, *ends[:-1]]
    # Q_u R_u = T_u: orthonormal bases of the unit Grams' ranges (rows zero where T_u's are);
    # Qt holds the Q_u^T stacked (m, n), rows contiguous like X's
    Qt = T.new_empty(m, n)
    R = []
    for u in range(U):
        a, e = starts[u], ends[u]
        if e > a:
            Q_u, R_u = torch.linalg.qr(T[:, a:e])
            Qt[a:e] = Q_u.T
            R.append(R_u)
        else:
            R.append(T.new_zeros(0, 0))
    # N = C'^T C' (C' = C with Q for T): N_uv = Q_u^T diag(g[:, u, v]) Q_v for v < u, mirrored
    # above; N_uu = Q_u^T Q_u = I (g[b, u, u] = |F^_b[u]|^2 is 1 on the rows where Q_u is not
    # zero)
    N = torch.eye(m, dtype=T.dtype, device=T.device)
    # g[:, u, v] spread over the columns of unit v: one gather into a buffer a unit, scaled in
    # place (no temporaries of up to m x n a unit)
    by_unit = g.permute(1, 2, 0).contiguous()  # (U, U, n)
    scaled = torch.empty_like(Qt)
    for u in range(1, U):
        a, e = starts[u], ends[u]
        if e > a and a > 0:
            torch.index_select(by_unit[u], 0, unit[:a], out=scaled[:a]).mul_(Qt[:a])
            torch.mm(Qt[a:e], scaled[:a].T, out=N[a:e, :a])
            N[:a, a:e] = N[a:e, :a].T
    # B = R^T N, G = I + B R = I + C^T C (R block diagonal; G symmetric, so its rows of unit u
    # are (B[:, u] R_u)^T: row blocks, each written contiguously)
    B = torch.empty_like(N)
    for u in range(U):
        a, e = starts[u], ends[u]
        if e > a:
            B[a:e] = R[u].T @ N[a:e]
    G = N  # N is spent: G and then its factor take its buffer, Z takes B's (fewer m x m
    # allocations a call: each a fresh 6.5 MB at S1's m, page-faulted in)
    for u in range(U):
        a, e = starts[u], ends[u]
        if e > a:
            G[a:e] = R[u].T @ B[:, a:e].T
    G.diagonal().add_(1.0)
    chol, info = torch.linalg.cholesky_ex(G, out=(G, torch.empty((), dtype=torch.int32)))
    if info != 0:
        return None
    Z = torch.linalg.solve_triangular(chol, B, upper=False, out=B)  # chol^{-1} B (m, m)
    # |Z_u c_s|^2 = c_s^T (Z_u^T Z_u) c_s: one m_u x m_u Gram a unit (m m_u^2), then m_u^2 an
    # entry, instead of m m_u an entry (3x fewer multiply-adds on S1, and no (run, m) product)
    ZZ = [Z[:, a:e].T @ Z[:, a:e] if e > a else None for a, e in zip(starts, ends, strict=True)]
    S = dinv.numel()
    q = torch.empty(S, dtype=torch.float64, device=dinv.device)
    size = torch.empty_like(q)  # |b_s|^2 = |x_s|^2
    projected = torch.empty_like(q)  # |c_s|^2
    for start, end, u in plan.runs:
        a, e = starts[u], ends[u]
        x = X[start:end]  # (run, n)
        size[start:end] = torch.linalg.vector_norm(x, dim=1).square_()  # while x is in cache
        if e > a:
            c = x @ Qt[a:e].T  # (run, m_u): c_s = Q_u^T x_s
            projected[start:end] = c.square().sum(1)
            q[start:end] = projected[start:end] - ((c @ ZZ[u]) * c).sum(1)
        else:
            projected[start:end] = q[start:end] = 0.0
    # |eps_s|^2 = |x_s|^2 - |c_s|^2 + c_s^T (Q_u^T Q_u - I) c_s: at most their computed
    # difference plus gamma (|x_s|^2 + |c_s|^2), gamma covering both sums' rounding (n and
    # m_u terms) and Q_u's departure from orthonormality (~n eps for Householder QR)
    gamma = (2 * n + max(e - a for a, e in zip(starts, ends, strict=True)) + 4) * \
        torch.finfo(torch.float64).eps
    residual = ((size - projected).clamp_min_(0.0) + gamma * (size + projected)).sqrt_()
    variance = dinv * (1.0 - q)
    refuse = _bound(size, residual, truncation) * dinv > PROJECTION_TOLERANCE * variance
    if bool(refuse.any()):
        # where that cheap upper bound does not suffice, |eps_s| itself (one more product a
        # run); on S1 the cheap bound holds everywhere (~1e-10 of the variances)
        for start, end, u in plan.runs:
            if not bool(refuse[start:end].any()):
                continue
            a, e = starts[u], ends[u]
            x = X[start:end]
            eps = x - (x @ Qt[a:e].T) @ Qt[a:e] if e > a else x
            residual[start:end] = torch.linalg.vector_norm(eps, dim=1)
        bound = _bound(size, residual, truncation)
        if not bool((bound * dinv <= PROJECTION_TOLERANCE * variance).all()):
            return None
    return variance


def _bound(size: Tensor, residual: Tensor, truncation: float) -> Tensor:
    """``tau |b_s|^2 + 2 |b_s| |eps_s| + |eps_s|^2`` (module docstring, "The projected
    route") from ``size = |b_s|^2`` and ``residual = |eps_s|`` (or an upper bound of it)."""
    norm = size.sqrt()
    return truncation * size + (2.0 * norm + residual) * residual


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


def _entry_rows(At: Tensor, root: Tensor, dinv: Tensor, plan) -> Tensor:
    """``X`` (S, n) float64, ``X[s] = diag(root[:, u_s]) A[:, s] / sqrt(D_s)`` from ``At = A^T``
    (S, n, any float dtype): entry s's vector in unit coordinates (``|X[s]| = |b_s|``; module
    docstring), one contiguous row an entry (the unit Grams' ``dsyrk`` and the entries'
    products read their rows so). One pass converts, scales and lays out."""
    X = torch.mul(At, dinv.sqrt()[:, None], out=dinv.new_empty(At.shape))  # rows contiguous
    for start, end, u in plan.runs:  # in place on contiguous rows
        X[start:end] *= root[:, u]
    return X


def _unit_factors(X: Tensor, runs: list[tuple[int, int, int]], U: int, truncation: float, *,
                  lapack: bool | None = None) -> tuple[Tensor, Tensor]:
    """``(T (n, m), unit (m,))``: for each unit's Gram ``M~_u = X_u^T X_u`` (n x n; ``X_u``
    the rows of ``X`` (S, n) in ``runs``' spans ``(start, end, u)`` of unit u), ``T_u =
    T[:, unit == u]`` with ``M~_u = T_u T_u^T + R_u``, ``R_u`` PSD and ``sum_u trace(R_u) <=
    truncation``: pivoted Cholesky stopped once every residual diagonal entry is ``<=
    truncation / (U n)``. A unit without rows gets no column.

    ``lapack`` (default: float64 on the CPU): the Gram's lower triangle by BLAS ``dsyrk`` (half
    a GEMM's work) and LAPACK ``dpstrf`` in place; otherwise each Gram's eigendecomposition,
    its smallest eigenvalues dropped while their sum is ``<= truncation / U`` (the same bound).
    """
    n = X.shape[1]
    if lapack is None:
        lapack = X.device.type == "cpu" and X.dtype == torch.float64
    spans: list[list[tuple[int, int]]] = [[] for _ in range(U)]
    for start, end, u in runs:
        spans[u].append((start, end))
    parts, units = [], []
    with lapack_threads():
        for u in range(U):
            rows = [X[start:end] for start, end in spans[u]]
            if not rows:
                part = X.new_zeros(n, 0)
            elif lapack:
                part = _pivoted_factor(rows, truncation / (U * n))
            else:
                part = _eigen_factor(rows, truncation / U)
            parts.append(part)
            units.append(torch.full((part.shape[1],), u, dtype=torch.int64, device=X.device))
    return torch.cat(parts, dim=1), torch.cat(units)


def _pivoted_factor(rows: list[Tensor], tol: float) -> Tensor:
    """``T`` (n, rank) with ``sum_r rows_r^T rows_r = T T^T + R``, every diagonal entry of the
    PSD R ``<= tol``: the Gram's lower triangle (``dsyrk``, accumulated over the row blocks)
    and its pivoted Cholesky (``dpstrf``), in one column-major n x n buffer."""
    from scipy.linalg import blas, lapack

    gram = None
    for block in rows:  # (k, n) contiguous rows: their transpose is column-major, not copied
        a = block.numpy().T
        gram = (blas.dsyrk(1.0, a, lower=1) if gram is None
                else blas.dsyrk(1.0, a, beta=1.0, c=gram, lower=1, overwrite_c=1))
    factor, piv, rank, info = lapack.dpstrf(gram, tol=tol, lower=1, overwrite_a=1)
    if info < 0:
        raise NumericalError(f"dpstrf rejected argument {-info}")
    part = np.empty((factor.shape[0], rank))
    part[piv - 1] = np.tril(factor[:, :rank])  # rows in pivot order; above: the Gram's entries
    return torch.from_numpy(part)


def _eigen_factor(rows: list[Tensor], budget: float) -> Tensor:
    """``T`` (n, k) with ``sum_r rows_r^T rows_r = T T^T + R``, ``trace(R) <= budget``: the
    Gram's eigenvectors, its smallest eigenvalues dropped while their sum is ``<= budget``."""
    gram = sum(block.T @ block for block in rows)
    values, vectors = torch.linalg.eigh(gram)
    values = values.clamp_min(0.0)
    drop = int((values.cumsum(0) <= budget).sum())  # the smallest
    return vectors[:, drop:] * values[drop:].sqrt()


LOWRANK_KEYS = ("subnet", "dinv", "A", "F", "T", "unit", "chol")
"""The tensors `lowrank_logit_variance` reads from `subnet_lowrank_posterior`'s dict."""


@torch.no_grad()
def lowrank_logit_variance(
    model: nn.Module, mean: Tensor, factors: dict[str, Tensor], x: Tensor, *,
    rows: int = 64, engine: SubnetJacobian | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Linearised logit variances ``var[b, o] = J_bo Sigma_t J_bo^T`` (B, C) float64 and the
    logits (B, C) at ``mean``, of the truncated Woodbury posterior
    ``Sigma_t = D^{-1} - D^{-1} W (I - Y Y^T) W^T D^{-1}`` (`subnet_lowrank_posterior`'s
    ``factors``; module docstring, "The predictive"); None where the Linear factorisation
    does not apply to ``model`` or the subtraction would cancel (the caller then takes the
    dense posterior).

    Args:
        model: the network the factors were computed on (eval mode is the caller's).
        mean: (P,) its trainable parameters, the point of linearisation.
        factors: ``subnet, dinv, A, F, T, unit, chol`` (`LOWRANK_KEYS`).
        x: (B, ...) inputs on the model's device.
        rows: inputs per chunk of the (rows, C, n, U) intermediates and of the triangular
            solve's right-hand sides (rows C of them).
        engine: the Jacobian engine of ``(model, factors["subnet"], mean)`` if the caller
            holds one.
    """
    idx, dinv, A, F, T, unit, chol = (factors[k] for k in LOWRANK_KEYS)
    engine = SubnetJacobian(model, idx, mean) if engine is None else engine
    out = engine.unit_factors(x)
    if out is None:
        return None
    Ax, Gx, logits, plan = out
    Ax = Ax.to(torch.float64)
    Gx = Gx.to(torch.float64).permute(1, 0, 2)  # (B, C, U)
    B, C, U = Gx.shape
    n = F.shape[0]
    m = T.shape[1]
    if (F.shape[1] != U or A.shape != (n, idx.numel()) or T.shape[0] != n
            or chol.shape != (m, m) or unit.shape != (m,)
            or not bool((unit[1:] >= unit[:-1]).all())):
        raise InvalidInputError("the low-rank factors do not belong to this model's subnet")
    # per unit u: prior[b', u] = sum_{s in u} Ax[b', s]^2 / D_s; N[u, b', b] = sum_{s in u}
    # Ax[b', s] A[b, s] / D_s (the test x training Gram of the prior covariance)
    prior = Ax.new_zeros(B, U)
    N = Ax.new_zeros(U, B, n)
    for start, end, u in plan.runs:
        scaled = Ax[:, start:end] * dinv[start:end]
        prior[:, u] += (scaled * Ax[:, start:end]).sum(1)
        N[u] += scaled @ A[:, start:end].T
    variance = torch.einsum("bou,bu->bo", Gx.square(), prior)  # J D^{-1} J^T
    # z[(b, j)] = sum_u Gx[b', o, u] N[u, b', b] F_b[u, j]. Its square, |z|^2 = Gx^T P Gx with
    # P[b', u, v] = sum_b N[u, b', b] (F_b F_b^T)[u, v] N[v, b', b] (one U x U a test input)
    FF = torch.bmm(F, F.transpose(1, 2))  # (n, U, U)
    P = Ax.new_empty(B, U, U)
    for u in range(U):
        for v in range(u + 1):
            P[:, u, v] = P[:, v, u] = ((N[u] * FF[:, u, v]) * N[v]).sum(1)
    squared = torch.einsum("bou,buv,bov->bo", Gx, P, Gx)
    # C^T z: column i of unit v is sum_b T[b, i] sum_u (F^_b[v] . F_b[u]) Gx[o, u] N[u, b', b]
    # = sum_u Gx[o, u] M_vu[b', i], M_vu = N[u] diag(FH[:, v, u]) T_v (B x m_v, a GEMM)
    FH = torch.bmm(_unit_rows(F)[1], F.transpose(1, 2))  # (n, U, U): FH[b, v, u] = F^_b[v] . F_b[u]
    # T's columns by unit: unit v's are [bounds[v], bounds[v + 1]) (`_unit_factors`' order,
    # checked above)
    bounds = [0, *torch.bincount(unit, minlength=U).cumsum(0).tolist()]
    projected = Ax.new_empty(B, C, m)
    for v in range(U):
        low, high = bounds[v], bounds[v + 1]
        if high > low:
            weighted = FH[:, v, :].T[:, :, None] * T[None, :, low:high]  # (U, n, m_v)
            M = torch.bmm(N, weighted)  # (U, B, m_v)
            projected[:, :, low:high] = torch.bmm(Gx, M.transpose(0, 1))
    # z^T K_t^{-1} z = |z|^2 - |Y^T z|^2, Y^T z = chol^{-1} C^T z (rows C right-hand sides a
    # solve)
    quadratic = squared.clone()
    for i in range(0, B, rows):
        solved = torch.linalg.solve_triangular(chol, projected[i : i + rows].reshape(-1, m).T,
                                               upper=False)
        quadratic[i : i + rows] -= solved.square().sum(0).view(-1, C)
    f_var = variance - quadratic
    # the subtraction keeps ~13 digits while the data shrink a logit's variance at most
    # MAX_SHRINKAGE-fold below its prior's (as for the marginal variances)
    if not bool((torch.isfinite(f_var) & (f_var * MAX_SHRINKAGE >= variance)).all()):
        return None
    return f_var, logits


@torch.no_grad()
def lowrank_ggn(model: nn.Module, mean: Tensor, factors: dict[str, Tensor]) -> Tensor:
    """The subnet GGN ``H_S`` (S, S) float64, exactly symmetric, of the training set
    `subnet_lowrank_posterior`'s ``factors`` were taken on, rebuilt from them: ``H = W W^T``
    (module docstring), ``H[s, t] = sum_b A[b, s] A[b, t] (F_b F_b^T)[u_s, u_t]``, the factor
    before any truncation, so the GGN itself (`inference.subnet.fit.subnet_ggn`'s numbers,
    which sum float32 products, to their rounding). ``S^2 n`` multiply-adds (~0.1-0.2 s at S1's
    |S| = 3,925, n = 250): the dense posterior on demand, where a caller keeps these factors
    (~20 MB on S1) instead of the 123 MB GGN (FedSI's personal state).

    Args:
        model: the network the factors were computed on.
        mean: (P,) its trainable parameters, where they were computed.
        factors: `subnet_lowrank_posterior`'s dict (``subnet``, ``A``, ``F`` are read).
    """
    missing = [k for k in ("subnet", "A", "F") if k not in factors]
    if missing:
        raise InvalidInputError(f"the low-rank factors lack {missing}: the GGN cannot be rebuilt")
    idx, A, F = factors["subnet"], factors["A"], factors["F"]
    plan = SubnetJacobian(model, idx, mean).unit_runs()
    if (plan is None or A.dim() != 2 or A.shape[1] != idx.numel() or F.dim() != 3
            or F.shape[:2] != (A.shape[0], plan.present.numel())):
        raise InvalidInputError("the low-rank factors do not belong to this model's subnet")
    gamma = torch.bmm(F, F.transpose(1, 2))  # (n, U, U): F_b F_b^T = Q_b Q_b^T
    return unit_factor_ggn(A, gamma, plan)


@torch.no_grad()
def lowrank_predict_proba(
    model: nn.Module, mean: Tensor, factors: dict[str, Tensor], inputs: Tensor, *,
    chunk_size: int,
) -> tuple[Tensor, Tensor] | None:
    """``(GLM-probit predictive, MAP plug-in)`` class probabilities (B, C) in the model's dtype
    of the truncated Woodbury posterior ``factors`` (`subnet_lowrank_posterior`), chunk by
    chunk of ``chunk_size`` rows as `inference.subnet.predictive.glm_predict` does (the
    plug-in is the same softmax of the same logits); None where `lowrank_logit_variance`
    declines a chunk."""
    x = as_network_inputs(inputs, mean.dtype).to(mean.device)
    engine = SubnetJacobian(model, factors["subnet"], mean)
    probit, plugin = [], []
    with eval_mode(model):
        for start in range(0, x.shape[0], chunk_size):
            chunk = x[start : start + chunk_size]
            out = lowrank_logit_variance(model, mean, factors, chunk, engine=engine)
            if out is None:
                return None
            f_var, logits = out
            probit.append(probit_softmax(f_var.to(logits.dtype), logits))
            plugin.append(torch.softmax(engine.logits(chunk), dim=-1))
    return torch.cat(probit), torch.cat(plugin)
