"""Exact diagonal of the classification GGN over all trainable parameters.

``diag GGN_r = sum_x [ sum_o p_o J_or^2 - (sum_o p_o J_or)^2 ]``, with ``p = softmax(f(x))``
(`inference.curvature.ggn_diagonal`, used as it is for parameters outside Linear/Conv2d).
Written with the square root of the softmax Hessian (`inference.curvature`),
``Lambda = diag(p) - p p^T = M M^T`` where ``M[:, k] = sqrt(p_k) (e_k - p)``, it is
``sum_x sum_k (J^T M[:, k])_r^2``: C backward passes of the vectors ``M[:, k]`` per batch (the
BackPACK "DiagGGN exact" scheme). For an ``nn.Linear`` layer with 2-D input the per-sample
squares reduce to one matrix product ``(sum_k g_k^2)^T (a^2)``; no per-sample Jacobian of all
parameters is formed.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from functools import reduce

import torch
from torch import Tensor, nn
from torch.func import functional_call

from inference.curvature import ggn_diagonal, softmax_hessian_sqrt
from inference.subnet.batches import BatchChecks, check_logits, iterate_batches
from inference.subnet.capture import (
    ActivationCapture,
    conv2d_unfold,
    functional_parameters,
    generic_jacobians,
    output_vjps,
)
from inference.subnet.memory import check_memory
from inference.subnet.parameters import ParameterSlot, flat_trainable_parameters, trainable_slots
from inference.subnet.training_mode import eval_mode

__all__ = ["diagonal_ggn", "softmax_hessian_sqrt"]


@torch.no_grad()
def diagonal_ggn(
    model: nn.Module, loader: Iterable, *, max_memory_bytes: int | None = None
) -> Tensor:
    """Diagonal of the GGN ``sum_x J(x)^T Lambda(x) J(x)`` summed over the loader's data.

    Args:
        model: returns (B, C) logits; evaluated in eval mode (restored afterwards).
        loader: yields ``(X, y)`` with integer labels ``y`` (only used for validation: the
            classification GGN does not depend on the labels).
        max_memory_bytes: memory budget override for the preflight of the per-sample
            temporaries (checked on the first batch).

    Returns:
        (P,) float64 on the model's device, in the trainable-parameter index space
        (`inference.subnet.parameters`); entries are >= 0 (up to rounding).
    """
    slots = trainable_slots(model)
    flat = flat_trainable_parameters(model)
    diag = torch.zeros(flat.numel(), dtype=torch.float64, device=flat.device)
    fast = [s for s in slots if s.module is not None]
    generic = [s for s in slots if s.module is None]
    checks = BatchChecks()
    with eval_mode(model):
        for X, y in iterate_batches(loader, flat.device):
            if checks.n_classes is None:
                C = check_logits(model(X[:1]), 1).shape[1]
                _preflight(slots, X.shape[0], C, flat, max_memory_bytes)
            params = functional_parameters(slots, flat, {s.name for s in fast})
            with torch.enable_grad(), ActivationCapture([s.module for s in fast]) as capture:
                logits = functional_call(model, params, (X,))
            logits = check_logits(logits, X.shape[0])
            checks.update(logits, y)
            probs = torch.softmax(logits.detach(), dim=-1)
            if fast:
                with torch.enable_grad():
                    grads = output_vjps(logits, capture.outputs(), softmax_hessian_sqrt(probs))
                by_output = dict(zip([id(o) for o in capture.outputs()], grads, strict=True))
                for slot in fast:
                    calls = [
                        (inputs.detach(), by_output[id(out)])
                        for inputs, out in capture.records[id(slot.module)]
                    ]
                    if calls:  # a layer the forward pass never calls has zero curvature
                        diag[slot.offset : slot.offset + slot.numel] += _fast_diag(slot, calls)
            if generic:
                jac = generic_jacobians(model, params, [s.name for s in generic], X)
                for slot in generic:
                    J = jac[slot.name].reshape(X.shape[0], probs.shape[1], -1)
                    diag[slot.offset : slot.offset + slot.numel] += ggn_diagonal(J, probs)
    checks.finish()
    return diag


def _fast_diag(slot: ParameterSlot, calls: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Sum over samples and vectors k of squared per-sample gradients of one layer parameter.

    Args:
        slot: a Linear / Conv2d weight or bias.
        calls: ``(input, output-gradients (K, B, ...))`` of each call of the layer in the
            forward pass; a layer called several times squares the *summed* gradient.

    Returns:
        (numel,) in the gradients' dtype.
    """
    module = slot.module
    if slot.role == "bias":  # per-sample gradients (K, B, out) are small: all vectors at once
        per_sample = reduce(operator.add, (_per_sample_gradients(slot, None, g) for _, g in calls))
        return per_sample.square().sum((0, 1))
    layer_inputs = [_layer_input(module, inputs) for inputs, _ in calls]
    K, B = calls[0][1].shape[0], calls[0][1].shape[1]
    if len(calls) == 1 and isinstance(module, nn.Linear) and layer_inputs[0].shape[1] == 1:
        # per-sample outer products: the squares factorise
        g = calls[0][1].reshape(K, B, module.out_features)
        return (g.square().sum(0).T @ layer_inputs[0][:, 0].square()).reshape(-1)
    # One output-space vector k at a time: per-sample gradients (B, numel), never (K, B, numel).
    total = None
    for k in range(K):
        per_sample = reduce(
            operator.add,
            (
                _per_sample_gradients(slot, a, grad[k : k + 1])
                for a, (_, grad) in zip(layer_inputs, calls, strict=True)
            ),
        )
        part = per_sample.square().sum((0, 1))
        total = part if total is None else total + part
    return total


def _layer_input(module: nn.Module, inputs: Tensor) -> Tensor:
    """A Linear layer's input as (B, T, in_features), a Conv2d layer's unfolded, (B, J, L)."""
    if isinstance(module, nn.Linear):
        return inputs.reshape(inputs.shape[0], -1, module.in_features)
    return conv2d_unfold(module, inputs)


def _per_sample_gradients(slot: ParameterSlot, a: Tensor | None, grad: Tensor) -> Tensor:
    """Per-sample gradients (K, B, numel) of one layer parameter for one call of the layer.

    Args:
        a: the call's input from `_layer_input` (unused, may be None, for a bias).
        grad: (K, B, ...) output-space VJPs w.r.t. the call's output.
    """
    module = slot.module
    K, B = grad.shape[0], grad.shape[1]
    if isinstance(module, nn.Linear):
        g = grad.reshape(K, B, -1, module.out_features)  # (K, B, T, out)
        if slot.role == "bias":
            return g.sum(2)
        return torch.einsum("kbto,bti->kboi", g, a).reshape(K, B, -1)
    g = grad.reshape(K, B, module.out_channels, -1)  # Conv2d: (K, B, C_out, L)
    if slot.role == "bias":
        return g.sum(-1)
    return torch.einsum("kbcl,bjl->kbcj", g, a).reshape(K, B, -1)


def _preflight(
    slots: list[ParameterSlot], rows: int, C: int, flat: Tensor, max_memory_bytes: int | None
) -> None:
    """Largest per-batch temporaries: per-sample gradients outside the Linear closed form."""
    itemsize = flat.element_size()
    n_generic = sum(s.numel for s in slots if s.module is None)
    n_per_sample = max(
        [s.numel for s in slots if s.module is not None and not isinstance(s.module, nn.Linear)]
        + [0]
    )
    check_memory(
        {
            "per-sample Jacobian outside Linear/Conv2d (B x C x n)": rows
            * C
            * n_generic
            * itemsize,
            "per-sample Conv2d weight gradients (B x n)": 2 * rows * n_per_sample * itemsize,
        },
        device=flat.device,
        max_memory_bytes=max_memory_bytes,
        advice="Use a smaller loader batch size.",
    )
