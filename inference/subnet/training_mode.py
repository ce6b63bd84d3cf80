"""Evaluate a model in eval mode and restore each module's previous mode afterwards.

Curvature and linearised predictions need deterministic, per-sample-independent forward passes
(no dropout, BatchNorm on running statistics). laplace-torch calls ``model.eval()`` and leaves
it so; here the user's train/eval flags are put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["eval_mode"]


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: ``model.eval()`` inside, every submodule's ``training`` flag restored."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag
