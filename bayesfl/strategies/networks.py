"""Client networks of the parameter-sharing strategies: a body followed by a linear head.

Parameter names are ``body.*`` and ``head.weight`` / ``head.bias``.

**Layers.** The FedLog paper counts what a baseline shares in *layers* (spec fedlog.md §5.1,
§8: "LG-FedAvg 2" = two global layers, "FedPer" = last two layers local, ...). Here a layer
is a module that owns parameters itself (a ``Linear`` or ``Conv2d``: its weight and bias), and
`layer_parameter_names` lists them from input to output, in module registration order.
For `ClassifierNet` over the ``nn.Sequential`` bodies of `bayesfl.bodies` that is
the forward order; e.g. body ``mlp:200`` gives three layers ``body.1`` (input -> 200),
``body.3`` (200 -> d) and ``head`` (d -> C), and the FedLog paper's MNIST CNN gives
conv1, conv2, fc1, head (spec §5.2). `last_layers` names the parameters of the last k.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# re-exported: the per-sample loss of every network here (F.cross_entropy's numbers and
# gradients bit for bit, without the sympy import F.cross_entropy costs under vmap)
from bayesfl.training import cross_entropy_per_sample as cross_entropy_per_sample


def layer_parameter_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Parameter names of ``model`` grouped by layer, input to output (module docstring).

    Every module with parameters of its own is one layer (a normalisation layer with an
    affine weight would count too); modules without parameters (ReLU, pooling, dropout,
    flatten) are not layers.
    """
    groups = []
    for prefix, module in model.named_modules():
        own = tuple(f"{prefix}.{name}" if prefix else name
                    for name, _ in module.named_parameters(recurse=False))
        if own:
            groups.append(own)
    return groups


def last_layers(model: nn.Module, count: int) -> frozenset[str]:
    """Names of the parameters of the last ``count`` layers of ``model`` (0 <= count <= the
    number of layers; see `layer_parameter_names`)."""
    groups = layer_parameter_names(model)
    if not 0 <= count <= len(groups):
        raise ValueError(f"model has {len(groups)} layers, cannot take the last {count}")
    return frozenset(name for group in groups[len(groups) - count:] for name in group)


class ClassifierNet(nn.Module):
    """``logits = head(body(x))``: body (B, *input) -> (B, d), head Linear(d, C)."""

    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class PrototypeNet(ClassifierNet):
    """Like `ClassifierNet` but returns ``(logits (B, C), features (B, d))``."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        features = self.body(x)
        return self.head(features), features


@torch.no_grad()
def batched_apply(module: nn.Module, x: Tensor, chunk: int = 4096):
    """``module(x)`` in eval mode, without gradients, in chunks of ``chunk`` rows (bounded
    memory). A module returning a tuple of tensors gets the tuple of concatenations."""
    was_training = module.training
    module.eval()
    try:
        outs = [module(x[i : i + chunk]) for i in range(0, max(x.shape[0], 1), chunk)]
    finally:
        module.train(was_training)
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return torch.cat(outs)
