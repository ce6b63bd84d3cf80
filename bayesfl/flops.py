"""Analytic training FLOPs of one sample, with some parameters frozen (spec fedpart.md §1.7).

Counted: the multiply-adds of every Conv and Linear layer (2 FLOPs each); normalisation,
activations and pooling are elementwise and left out (a few percent of a conv net). Per
layer with forward cost ``f`` (FLOPs per sample):

* forward: ``f``, for every layer, trainable or not;
* backward, input gradient: ``f`` if the layer's input requires grad, i.e. some trainable
  parameter lies upstream of it: autograd computes nothing below the first trainable group
  (nor in a frozen side branch such as a shortcut whose input does not depend on it);
* backward, weight gradient: ``f`` if the layer's weight is trainable.

So a full-network step costs about 3x the forward (minus the first layer's input gradient)
and a FedPart step on group j costs the forward plus the backward from the output down to
group j, as the paper's Eq. 6 says, but counted per layer instead of assuming equal layers.
Which inputs require grad is *measured* by a forward pass with the trainable set's
``requires_grad`` flags (not guessed from the layer order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training sample (forward and backward) for one trainable set."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def layer_forward_flops(module: nn.Module, output: Tensor) -> int:
    """Forward FLOPs per sample of a Conv or Linear ``module`` that produced ``output``
    (B, ...): 2 x multiply-adds (bias additions left out)."""
    per_sample = output[0].numel()
    if isinstance(module, nn.modules.conv._ConvNd):
        fan_in = module.in_channels // module.groups * int(torch.tensor(module.kernel_size).prod())
        return 2 * per_sample * fan_in
    return 2 * per_sample * module.in_features  # nn.Linear


def step_flops(
    model: nn.Module, input_shape: tuple[int, ...], trainable: Callable[[str], bool]
) -> StepFlops:
    """FLOPs of one training sample of ``model`` (inputs of ``input_shape``) when only the
    parameters with ``trainable(name)`` are updated (module docstring).

    Runs one forward pass of a zero batch of one on a copy of the model (train mode, so the
    same branches run as in training); the model itself is not touched.
    """
    probe_model = copy.deepcopy(model).train()
    for name, p in probe_model.named_parameters():
        p.requires_grad_(bool(trainable(name)))
    records: list[tuple[int, bool, bool]] = []

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        weight_trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        records.append((layer_forward_flops(module, output), bool(inputs[0].requires_grad),
                        weight_trainable))

    handles = [m.register_forward_hook(hook) for m in probe_model.modules()
               if isinstance(m, nn.modules.conv._ConvNd | nn.Linear)]
    first = next(probe_model.parameters())
    try:
        with torch.enable_grad():
            probe_model(torch.zeros((2, *input_shape), dtype=first.dtype, device=first.device))
    finally:
        for h in handles:
            h.remove()
    # a batch of two (BatchNorm needs more than one value per channel); FLOPs are per sample
    forward = sum(f for f, _, _ in records)
    backward = sum(f * (int(needs_input) + int(weight)) for f, needs_input, weight in records)
    return StepFlops(forward, backward)
