"""Fit a subnetwork GGN-Laplace posterior: ``fit_subnet_laplace``.

Two curvature backends compute the same (S, S) GGN block ``H_S = sum_x J_S^T Lambda J_S``:

``"subnet_jacobian"`` (default)
    `inference.subnet.jacobian.SubnetJacobian`: Jacobian columns of the subnet only,
    contracted on the output side with a square root ``M`` of the softmax Hessian
    (``Lambda = diag(p) - p p^T = M M^T``, ``M[:, k] = sqrt(p_k) (e_k - p)``) by C
    vector-Jacobian products, so that ``H_S`` is one Gram matrix ``(J^T M)(J^T M)^T`` per chunk.
``"laplace_torch"``
    laplace-torch's ``FullSubnetLaplace`` (the reference implementation), on a deep copy of the
    model (laplace-torch hooks and mutates the model it is given), with the curvature class
    ``laplace_backend`` (default ``AsdlGGN``). It builds the full (B, C, P) Jacobian per batch;
    the preflight accounts for it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from inference.curvature import ggn_diagonal_from_sqrt, ggn_from_sqrt, softmax_hessian_sqrt
from inference.errors import InvalidInputError
from inference.subnet.batches import BatchChecks, check_logits, iterate_batches
from inference.subnet.dense import mirror_upper_
from inference.subnet.jacobian import SubnetJacobian, UnitRuns
from inference.subnet.memory import check_memory, tensor_bytes
from inference.subnet.parameters import (
    check_prior_mean,
    check_prior_precision,
    check_subnet_indices,
    flat_trainable_parameters,
    trainable_slots,
)
from inference.subnet.posterior import SubnetLaplacePosterior
from inference.subnet.selection import select_subnet
from inference.subnet.training_mode import eval_mode

__all__ = ["fit_subnet_laplace", "subnet_ggn", "subnet_laplace_state", "unit_factor_ggn"]

CurvatureBackend = Literal["subnet_jacobian", "laplace_torch"]
HessianStructure = Literal["full", "diag"]


def fit_subnet_laplace(
    model: nn.Module,
    loader: Iterable,
    subnet: Tensor | Sequence[int] | int | float,
    prior_precision: float | Tensor = 1.0,
    prior_mean: float | Tensor | None = None,
    *,
    backend: CurvatureBackend = "subnet_jacobian",
    hessian_structure: HessianStructure = "full",
    laplace_backend: type | None = None,
    chunk_size: int | None = None,
    max_memory_bytes: int | None = None,
    filter_zero_curvature: bool = True,
) -> SubnetLaplacePosterior:
    """GGN Laplace over a subnet (dense |S| x |S| precision), at the model's current parameters.

    The model's current trainable parameters are taken as the MAP (``mean``); parameters
    outside the subnet are point masses there.

    Args:
        model: returns (B, C) logits; evaluated in eval mode (flags restored afterwards).
        loader: yields ``(X, y)`` with integer labels; the GGN is **summed** over all of it.
        subnet: (S,) indices into the trainable-parameter vector (tensor or sequence; kept in
            the given order), or a size (int count / float fraction) handed to
            [`inference.subnet.select_subnet`][inference.subnet.select_subnet] with the same prior.
        prior_precision: scalar or (P,) per-parameter prior precision; the subnet's entries are
            added to the diagonal of the GGN block.
        prior_mean: ``None`` (0), scalar or (P,); recorded on the posterior, as in laplace-torch
            it does not change the precision (the mean is the model's MAP).
        backend: ``"subnet_jacobian"`` (fast, default) or ``"laplace_torch"`` (reference).
        hessian_structure: ``"full"`` (FedSI: dense |S| x |S| GGN block) or ``"diag"`` (keep
            only its diagonal, laplace-torch's ``DiagSubnetLaplace``).
        laplace_backend: laplace-torch curvature class for ``backend="laplace_torch"``.
        chunk_size: rows per Jacobian chunk (default: the loader's batch).
        max_memory_bytes: memory budget override for the preflight.
        filter_zero_curvature: passed to the selection when ``subnet`` is a size.

    Returns:
        `SubnetLaplacePosterior` holding a reference to ``model``.
    """
    mean, indices, ggn, prior_S, prior_mean_S, n_data = _subnet_terms(
        model, loader, subnet, prior_precision, prior_mean, backend=backend,
        hessian_structure=hessian_structure, laplace_backend=laplace_backend,
        chunk_size=chunk_size, max_memory_bytes=max_memory_bytes,
        filter_zero_curvature=filter_zero_curvature)
    # subnet_ggn assembles an exactly symmetric float64 block: held as it is, not symmetrised
    # into a copy (issue 41: 0.12 of the 0.79 s of a FedSI client's 3,925-entry fit); the
    # laplace-torch reference is symmetrised
    return SubnetLaplacePosterior(mean, indices, ggn, prior_S, prior_mean_S, model=model,
                                  n_data=n_data,
                                  assume_symmetric=backend == "subnet_jacobian")


def subnet_laplace_state(
    model: nn.Module,
    loader: Iterable,
    subnet: Tensor | Sequence[int],
    prior_precision: float | Tensor = 1.0,
    prior_mean: float | Tensor | None = None,
    *,
    hessian_structure: HessianStructure = "full",
    chunk_size: int | None = None,
    max_memory_bytes: int | None = None,
) -> dict[str, Tensor]:
    """`SubnetLaplacePosterior.state_dict` of `fit_subnet_laplace`'s posterior,
    the same tensors, without factorising the precision (a client that stores its posterior
    and rebuilds it with `SubnetLaplacePosterior.from_state_dict` to predict factorises
    it there, once; positive definiteness is checked then)."""
    mean, indices, ggn, prior_S, prior_mean_S, n_data = _subnet_terms(
        model, loader, subnet, prior_precision, prior_mean, backend="subnet_jacobian",
        hessian_structure=hessian_structure, laplace_backend=None, chunk_size=chunk_size,
        max_memory_bytes=max_memory_bytes, filter_zero_curvature=True)
    if ggn.shape != (indices.numel(), indices.numel()):
        raise InvalidInputError(f"the GGN block has shape {tuple(ggn.shape)} for "
                                f"{indices.numel()} subnet indices")
    device = mean.device
    return {
        "mean": mean.detach(),
        "subnet_indices": indices,
        # exactly symmetric already (subnet_ggn), as the posterior's symmetric part would be
        "ggn": ggn.detach().to(device, torch.float64),
        "prior_precision": prior_S.detach().to(device, torch.float64).reshape(-1),
        "prior_mean": prior_mean_S.detach().to(device, torch.float64).reshape(-1),
        "n_data": torch.tensor(int(n_data), dtype=torch.int64),
    }


def _subnet_terms(model, loader, subnet, prior_precision, prior_mean, *, backend,
                  hessian_structure, laplace_backend, chunk_size, max_memory_bytes,
                  filter_zero_curvature):
    """``(mean, indices, ggn, prior_S, prior_mean_S, n_data)`` of `fit_subnet_laplace`."""
    if backend not in ("subnet_jacobian", "laplace_torch"):
        raise InvalidInputError(
            f"backend must be 'subnet_jacobian' or 'laplace_torch', got {backend!r}"
        )
    if hessian_structure not in ("full", "diag"):
        raise InvalidInputError(
            f"hessian_structure must be 'full' or 'diag', got {hessian_structure!r}"
        )
    n_params = sum(s.numel for s in trainable_slots(model))
    prior = check_prior_precision(prior_precision, n_params)
    prior_mu = check_prior_mean(prior_mean, n_params)
    if isinstance(subnet, int | float) and not isinstance(subnet, bool):
        indices = select_subnet(
            model,
            loader,
            subnet,
            prior,
            filter_zero_curvature=filter_zero_curvature,
            max_memory_bytes=max_memory_bytes,
        )
    else:
        indices = check_subnet_indices(subnet, n_params)
    if backend == "subnet_jacobian":
        ggn, n_data = subnet_ggn(
            model,
            loader,
            indices,
            diagonal_only=hessian_structure == "diag",
            chunk_size=chunk_size,
            max_memory_bytes=max_memory_bytes,
        )
    else:
        ggn, n_data = _laplace_torch_ggn(
            model,
            loader,
            indices,
            laplace_backend,
            hessian_structure=hessian_structure,
            max_memory_bytes=max_memory_bytes,
        )
    mean = flat_trainable_parameters(model)
    on = mean.device
    return (mean, indices, ggn, prior.to(on)[indices.to(on)], prior_mu.to(on)[indices.to(on)],
            n_data)


@torch.no_grad()
def subnet_ggn(
    model: nn.Module,
    loader: Iterable,
    subnet_indices: Tensor,
    *,
    diagonal_only: bool = False,
    chunk_size: int | None = None,
    max_memory_bytes: int | None = None,
) -> tuple[Tensor, int]:
    """The subnet GGN block ``sum_x J_S(x)^T (diag(p) - p p^T) J_S(x)``, summed over ``loader``.

    Args:
        model: returns (B, C) logits; evaluated in eval mode at its current parameters.
        loader: yields ``(X, y)`` with integer labels.
        subnet_indices: (S,) CPU int64 indices (validated by the caller).
        diagonal_only: keep only the diagonal (returned as a diagonal (S, S) matrix).
        chunk_size: rows per Jacobian chunk, a positive int (default: the loader's batch).
        max_memory_bytes: memory budget override for the preflight.

    Returns:
        ``(H_S, n_data)``: (S, S) float64 on the model's device, and the number of data points.
    """
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    mean = flat_trainable_parameters(model)
    ggn: Tensor | None = None
    preflown = False
    checks = BatchChecks()
    with eval_mode(model):
        engine = SubnetJacobian(model, subnet_indices, mean)
        for X, y in iterate_batches(loader, mean.device):
            rows = chunk_size or X.shape[0]
            if not preflown:  # before the first allocation
                C = engine.logits(X[:1]).shape[1]
                _preflight_fit(engine, C, rows, max_memory_bytes)
                preflown = True
            for start in range(0, X.shape[0], rows):
                chunk = _chunk_ggn(engine, X[start : start + rows], y[start : start + rows],
                                   checks, diagonal_only)
                ggn = chunk.to(torch.float64) if ggn is None else ggn.add_(chunk)
    checks.finish()
    # every chunk is exactly symmetric, and so is their sum
    return ggn, checks.n_data


FACTORED_GGN = True
"""Use `factored_ggn` where it applies (False: the Gram of the full subnet Jacobian;
tests compare the two)."""


def _chunk_ggn(engine: SubnetJacobian, X: Tensor, y: Tensor, checks: BatchChecks,
               diagonal_only: bool) -> Tensor:
    """One chunk's (S, S) GGN in the model's dtype, exactly symmetric (float64 accumulation
    across chunks is the caller's)."""
    if not diagonal_only:
        factored = factored_ggn(engine, X, y, checks)
        if factored is not None:
            return factored
    # J^T M with Lambda = M M^T: the chunk's GGN is one Gram matrix.
    JtM, logits = engine(X, output_vectors=_hessian_sqrt)
    checks.update(logits, y)
    JtM = JtM.reshape(engine.n_subnet, -1)
    if diagonal_only:
        return torch.diag(ggn_diagonal_from_sqrt(JtM))
    return ggn_from_sqrt(JtM)


def factored_ggn(engine: SubnetJacobian, X: Tensor, y: Tensor,
                 checks: BatchChecks) -> Tensor | None:
    """The chunk's (S, S) GGN by the Linear-layer factorisation (model dtype, exactly
    symmetric); None if the factorisation does not apply (the chunk is then not consumed).

    With ``J[b, o, s] = G_o[b, u_s] A[b, s]`` (`SubnetJacobian.linear_factors`) and
    ``Lambda = M M^T``, ``H[s, t] = sum_b A[b, s] A[b, t] Gamma[b, u_s, u_t]`` where
    ``Gamma[b] = sum_k g_k g_k^T`` (U x U, ``g_k`` the unit gradients of ``M[:, k]``). Each run
    of positions of one unit u is then one product ``A[:, run]^T (A * Gamma[:, u, unit])``
    over the positions from the run on (the upper triangle; mirrored at the end): about
    ``S^2 B`` flops against ``C S^2 B`` for the Gram of ``J^T M``. The products are written
    straight into the result and mirrored tile by tile: at |S| = 3,925 the S x S passes, not
    the products, were most of the time.
    """
    if not (FACTORED_GGN and engine.factorable):
        return None
    plan = engine.unit_runs()
    if plan is None:
        return None
    factors = engine.linear_factors(X, output_vectors=_hessian_sqrt)
    if factors is None:
        return None
    A, G, logits = factors
    checks.update(logits, y)
    G = G.index_select(2, plan.present)  # (K, B, U)
    gamma = torch.einsum("kbu,kbv->buv", G, G)  # (B, U, U)
    return unit_factor_ggn(A, gamma, plan)


def unit_factor_ggn(A: Tensor, gamma: Tensor, plan: UnitRuns) -> Tensor:
    """``H[s, t] = sum_b A[b, s] A[b, t] gamma[b, u_s, u_t]`` (S, S), exactly symmetric, in
    ``A``'s dtype: the GGN of the Linear-layer factorisation (`factored_ggn`), from ``A``
    (B, S), ``gamma`` (B, U, U) the per-sample Gram of the unit gradients (``Lambda``'s
    square root pushed through to the units) and ``plan`` the subnet's unit runs. Each run
    of positions of one unit u is one product ``A[:, run]^T (A * gamma[:, u, unit])`` over
    the positions from the run on (the upper triangle), mirrored at the end."""
    S = A.shape[1]
    upper = A.new_empty(S, S)  # the lower triangle is written by the mirror
    for start, end, u in plan.runs:
        # index_select and an in-place product: the same numbers as ``A[:, start:] *
        # gamma[:, u, unit[start:]]`` (bit for bit), without advanced indexing's slower
        # gather and a second temporary (issue 41: bench/subnet_laplace.py's fit 0.127 ->
        # 0.070 s, 800 entries, 500 rows)
        weighted = gamma[:, u].index_select(1, plan.compact[start:]).mul_(A[:, start:])
        torch.mm(A[:, start:end].T, weighted, out=upper[start:end, start:])
    return mirror_upper_(upper)




def _hessian_sqrt(logits: Tensor) -> Tensor:
    """(C, B, C) vectors M[:, k] with sum_k M M^T = diag(p) - p p^T, p = softmax(logits)."""
    return softmax_hessian_sqrt(torch.softmax(logits, dim=-1))


def _preflight_fit(engine: SubnetJacobian, C: int, rows: int, max_memory_bytes: int | None) -> None:
    """Raise MemoryBudgetError if the S x S matrices and one Jacobian chunk would not fit."""
    S, mean = engine.n_subnet, engine.mean
    check_memory(
        {
            "GGN, precision and Cholesky (S x S float64, x3)": 3
            * tensor_bytes((S, S), torch.float64),
            **engine.workspace_bytes(rows, C),
            "GGN chunk": tensor_bytes((S, S), mean.dtype),
        },
        device=mean.device,
        max_memory_bytes=max_memory_bytes,
        advice=f"With |S| = {S}, C = {C} and {rows} rows per chunk: use a smaller subnet, a "
        "smaller chunk_size or a smaller loader batch size.",
    )


def _laplace_torch_ggn(
    model: nn.Module,
    loader: Iterable,
    subnet_indices: Tensor,
    laplace_backend: type | None,
    *,
    hessian_structure: str,
    max_memory_bytes: int | None,
) -> tuple[Tensor, int]:
    """``H_S`` from laplace-torch's ``FullSubnetLaplace`` / ``DiagSubnetLaplace`` (reference)."""
    from laplace import Laplace
    from laplace.curvature import AsdlGGN

    mean = flat_trainable_parameters(model)
    first = next(iter(iterate_batches(loader, mean.device)))
    with torch.no_grad(), eval_mode(model):
        C = check_logits(model(first[0][:1]), 1).shape[1]
    S, B = subnet_indices.numel(), first[0].shape[0]
    check_memory(
        {
            "full per-batch Jacobian (B x C x P, laplace-torch)": tensor_bytes(
                (B, C, mean.numel()), mean.dtype
            ),
            "GGN, precision and scale (S x S, x3)": 3 * tensor_bytes((S, S), mean.dtype),
        },
        device=mean.device,
        max_memory_bytes=max_memory_bytes,
        advice="laplace-torch builds the Jacobian of all parameters: use the default "
        "backend='subnet_jacobian', or a smaller loader batch size.",
    )
    reference = copy.deepcopy(model)  # laplace-torch mutates and hooks its model
    la = Laplace(
        reference,
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure=hessian_structure,
        subnetwork_indices=subnet_indices.cpu(),
        backend=laplace_backend or AsdlGGN,
    )
    la.fit(loader if hasattr(loader, "dataset") else _BatchList(loader, mean.device))
    H = la.H.detach().to(torch.float64)
    return (torch.diag(H) if H.dim() == 1 else H), int(la.n_data)


class _BatchList:
    """A list of validated ``(X, y)`` batches with the ``dataset`` length laplace-torch reads."""

    def __init__(self, loader: Iterable, device: torch.device) -> None:
        self.batches = list(iterate_batches(loader, device))
        self.dataset = range(sum(y.shape[0] for _, y in self.batches))

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
