"""The parameter index space of subnet Laplace, and validation of indices and priors.

Index space: the flattened vector of the **trainable** parameters (``requires_grad=True``) in
``model.parameters()`` order, i.e. ``torch.nn.utils.parameters_to_vector`` of those
parameters. This is laplace-torch's ``subnetwork_indices`` space too (its ``BaseLaplace`` keeps
only grad-enabled parameters). A frozen head (``requires_grad_(False)``) is therefore outside the
index space: it can never be selected and its entries are not in ``mean``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from inference.errors import InvalidInputError

__all__ = [
    "ParameterSlot",
    "check_prior_mean",
    "check_prior_precision",
    "check_subnet_indices",
    "flat_trainable_parameters",
    "resolve_subnet_size",
    "trainable_slots",
]

# Modules whose per-sample Jacobian the fast path computes from captured activations.
FAST_MODULE_TYPES = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class ParameterSlot:
    """One trainable parameter tensor and where it sits in the flat index space.

    ``module`` and ``role`` ("weight" / "bias") are set when the fast path can compute the
    parameter's Jacobian from the module's input and output-gradient; otherwise ``None`` and the
    parameter goes through the generic ``torch.func`` path.
    """

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    module: nn.Module | None
    role: str | None


def _is_fast_module(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, nn.Conv2d):
        return (
            module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
    return False


def trainable_slots(model: nn.Module) -> list[ParameterSlot]:
    """The trainable parameters of ``model`` in index-space order, with their owning module."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for local_name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, local_name))
    slots: list[ParameterSlot] = []
    offset = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module, role = None, None
        owner_list = owners.get(id(p), [])
        # A tied parameter (owned by two modules) goes through the generic path, which sees
        # every use; the fast path would only see the hooked module's contribution.
        if len(owner_list) == 1 and _is_fast_module(owner_list[0][0]):
            candidate, local_name = owner_list[0]
            if local_name in ("weight", "bias"):
                module, role = candidate, local_name
        slots.append(ParameterSlot(name, p, offset, p.numel(), module, role))
        offset += p.numel()
    if not slots:
        raise InvalidInputError(
            "the model has no trainable parameters (every parameter has requires_grad=False)"
        )
    return slots


def flat_trainable_parameters(model: nn.Module) -> Tensor:
    """Detached copy of the trainable parameters as one flat vector (the index space)."""
    return torch.cat([s.param.detach().reshape(-1) for s in trainable_slots(model)])


def resolve_subnet_size(size: int | float, n_params: int) -> int:
    """Turn a count or a fraction of ``n_params`` into a count in ``[1, n_params]``.

    A float is a fraction in ``(0, 1]``: ``floor(size * n_params)``, at least 1.
    """
    if isinstance(size, bool):
        raise InvalidInputError("subnet size must be an int count or a float fraction, not bool")
    if isinstance(size, int):
        if not 1 <= size <= n_params:
            raise InvalidInputError(
                f"subnet size {size} is outside [1, {n_params}] (the number of trainable "
                "parameters); pick a positive count no larger than the model"
            )
        return size
    if isinstance(size, float):
        if not (math.isfinite(size) and 0.0 < size <= 1.0):
            raise InvalidInputError(f"subnet fraction {size} must be in (0, 1]")
        return max(1, math.floor(size * n_params))
    raise InvalidInputError(f"subnet size must be an int or a float, got {type(size).__name__}")


def check_subnet_indices(indices: Tensor | Sequence[int], n_params: int) -> Tensor:
    """Validate subnet indices; return them as a CPU int64 1-D tensor, order kept.

    Raises:
        InvalidInputError: not 1-D integers, empty, out of ``[0, n_params)`` or duplicated.
    """
    idx = torch.as_tensor(indices)
    if idx.numel() == 0:
        raise InvalidInputError("subnet indices must be non-empty (a subnet of size 0)")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise InvalidInputError(f"subnet indices must be integers, got dtype {idx.dtype}")
    idx = idx.detach().to("cpu", torch.int64)
    if idx.dim() != 1:
        raise InvalidInputError(
            f"subnet indices must be a non-empty 1-D tensor, got shape {tuple(idx.shape)}"
        )
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n_params:
        raise InvalidInputError(
            f"subnet indices must lie in [0, {n_params}) (trainable parameters); "
            f"got min {lo}, max {hi}"
        )
    n_duplicates = idx.numel() - idx.unique().numel()
    if n_duplicates:
        raise InvalidInputError(f"subnet indices contain {n_duplicates} duplicate entries")
    return idx


def _as_vector(value: float | Tensor, n_params: int, what: str) -> Tensor:
    if isinstance(value, bool):
        raise InvalidInputError(f"{what} must be a float or a 1-D tensor, not bool")
    if isinstance(value, int | float):
        vec = torch.full((n_params,), float(value), dtype=torch.float64)
    elif isinstance(value, Tensor):
        vec = value.detach()
        if vec.dim() == 0 or (vec.dim() == 1 and vec.numel() == 1):
            vec = vec.reshape(1).to(torch.float64).expand(n_params).clone()
        elif vec.dim() != 1 or vec.numel() != n_params:
            raise InvalidInputError(
                f"{what} must be a scalar or a 1-D tensor of length {n_params} (one per trainable "
                f"parameter), got shape {tuple(vec.shape)}"
            )
        vec = vec.to(torch.float64)
    else:
        raise InvalidInputError(f"{what} must be a float or a tensor, got {type(value).__name__}")
    if not bool(torch.isfinite(vec).all()):
        raise InvalidInputError(f"{what} contains non-finite values (NaN or inf)")
    return vec


def check_prior_precision(value: float | Tensor, n_params: int) -> Tensor:
    """A prior precision (scalar or per parameter) as a positive float64 vector of length P."""
    vec = _as_vector(value, n_params, "prior_precision")
    if not bool((vec > 0).all()):
        raise InvalidInputError(
            "prior_precision must be > 0 everywhere (an improper prior leaves the posterior "
            "precision singular where the data carry no curvature)"
        )
    return vec


def check_prior_mean(value: float | Tensor | None, n_params: int) -> Tensor:
    """A prior mean (``None`` = 0, scalar or per parameter) as a float64 vector of length P."""
    return _as_vector(0.0 if value is None else value, n_params, "prior_mean")
