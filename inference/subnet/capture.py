"""Building blocks of the fast curvature path: a functional forward pass at a given flat parameter
vector, activation capture by forward hooks, and output-space vector-Jacobian products.

For ``nn.Linear`` and ``nn.Conv2d`` layers the per-sample gradient of a scalar output w.r.t. the
weight is the outer product of the gradient w.r.t. the layer's output and the layer's input
(unfolded for a convolution). Capturing inputs and output-gradients therefore gives any entry of
the per-sample Jacobian without building the Jacobian of all parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from inference.errors import InvalidInputError
from inference.subnet.parameters import ParameterSlot

__all__ = [
    "ActivationCapture",
    "conv2d_unfold",
    "functional_parameters",
    "generic_jacobians",
    "output_vjps",
]


def functional_parameters(
    slots: Sequence[ParameterSlot], flat: Tensor, requires_grad: set[str]
) -> dict[str, Tensor]:
    """Views of the flat vector ``flat`` (P,) shaped like each trainable parameter.

    The views named in ``requires_grad`` become autograd leaves so that the outputs of the
    layers they feed carry a graph; all others are detached constants.
    """
    params: dict[str, Tensor] = {}
    for s in slots:
        view = flat[s.offset : s.offset + s.numel].detach().view(s.param.shape)
        params[s.name] = view.requires_grad_(True) if s.name in requires_grad else view
    return params


class ActivationCapture:
    """Context manager: forward hooks recording ``(input, output)`` of each call of ``modules``.

    A module called several times in one forward pass (weight sharing) has several records;
    their contributions add up.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list({id(m): m for m in modules}.values())
        self.records: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._handles: list = []

    def _hook(self, module: nn.Module, inputs: tuple, output: Tensor) -> None:
        self.records[id(module)].append((inputs[0], output))

    def __enter__(self) -> ActivationCapture:
        self.records = {id(m): [] for m in self.modules}
        self._handles = [m.register_forward_hook(self._hook) for m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def outputs(self) -> list[Tensor]:
        """Every recorded layer output, module by module, call by call."""
        return [out for m in self.modules for _, out in self.records[id(m)]]


def output_vjps(logits: Tensor, outputs: Sequence[Tensor], grad_outputs: Tensor) -> list[Tensor]:
    """Vector-Jacobian products of ``logits`` (B, C) w.r.t. captured layer ``outputs``.

    Args:
        logits: (B, C), the model output with a graph to each of ``outputs``.
        outputs: layer outputs, each (B, ...).
        grad_outputs: (K, B, C), K output-space vectors per sample.

    Returns:
        One tensor (K, B, ...) per layer output: ``sum_c grad_outputs[k, b, c] d logits[b, c] /
        d output[b]`` (samples are independent in eval mode). Unused outputs give zeros.
    """
    if not outputs:
        return []
    try:
        grads = torch.autograd.grad(
            logits,
            list(outputs),
            grad_outputs=grad_outputs,
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=True,
        )
    except RuntimeError:
        # Some ops have no batching rule for their backward: one backward pass per vector.
        per_k = [
            torch.autograd.grad(
                logits, list(outputs), grad_outputs=v, retain_graph=True, allow_unused=True
            )
            for v in grad_outputs
        ]
        grads = tuple(
            None if per_k[0][i] is None else torch.stack([g[i] for g in per_k])
            for i in range(len(outputs))
        )
    K = grad_outputs.shape[0]
    return [
        torch.zeros((K, *out.shape), dtype=out.dtype, device=out.device) if g is None else g
        for g, out in zip(grads, outputs, strict=True)
    ]


def conv2d_unfold(module: nn.Conv2d, inputs: Tensor) -> Tensor:
    """im2col of a Conv2d input: (B, C_in * kh * kw, L), L = number of output positions."""
    return F.unfold(
        inputs,
        kernel_size=module.kernel_size,
        dilation=module.dilation,
        padding=module.padding,
        stride=module.stride,
    )


def generic_jacobians(
    model: nn.Module, params: dict[str, Tensor], names: Sequence[str], x: Tensor
) -> dict[str, Tensor]:
    """Per-sample Jacobians of the logits w.r.t. the parameters ``names`` only, by torch.func.

    The other parameters are closed over as constants. Returns ``name -> (B, C, *shape)``.
    Used for parameters the fast path does not cover (e.g. normalisation layers, custom
    parameters, tied weights).
    """
    fixed = {k: v.detach() for k, v in params.items() if k not in names}
    wrt = {k: params[k].detach() for k in names}

    def logits_one(w: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, {**fixed, **w}, (xi.unsqueeze(0),)).squeeze(0)

    try:
        return vmap(jacrev(logits_one), in_dims=(None, 0))(wrt, x)
    except RuntimeError as err:
        raise InvalidInputError(
            "could not compute per-sample Jacobians with torch.func.vmap for the parameters "
            f"{list(names)} (the model must treat samples independently in eval mode): {err}"
        ) from err
