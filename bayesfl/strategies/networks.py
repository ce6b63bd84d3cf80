"""Client networks of the parameter-sharing strategies: a body followed by a linear head.

Parameter names are ``body.*`` and ``head.weight`` / ``head.bias``, which is how the
strategies say which part is shared with the server and which part stays personal.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ClassifierNet(nn.Module):
    """``logits = head(body(x))``: body (B, *input) -> (B, d), head Linear(d, C)."""

    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class PrototypeNet(ClassifierNet):
    """Like :class:`ClassifierNet` but returns ``(logits (B, C), features (B, d))``."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        features = self.body(x)
        return self.head(features), features


def cross_entropy_per_sample(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-sample cross-entropy (B,) of logits (B, C) against int labels (B,)."""
    return nn.functional.cross_entropy(logits, labels, reduction="none")


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
