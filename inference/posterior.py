"""The posterior protocol every head in :mod:`inference` satisfies.

A posterior is a distribution over head (or subnetwork) parameters. Whatever the method
(conjugate, Laplace, subnet Laplace, MFVI, SGLD), it offers the same small surface, so the
federation layer and users can swap methods by one string:

``mean``
    The posterior mean (or MAP, where that is what the method has), a tensor.
``sample(n, generator=None)``
    ``n`` parameter draws stacked on a new leading axis: shape ``(n, *mean.shape)``.
``predict_proba(inputs, method=...)``
    Predictive class probabilities, shape ``(B, C)``, rows summing to one.
``to(device)``
    A copy on ``device`` (nothing is moved in place).
``state_dict()`` / ``from_state_dict(state)``
    Tensors only (no pickle): what :func:`save_posterior` writes with safetensors and what
    ``torch.load(..., weights_only=True)`` can read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Posterior(Protocol):
    """Structural type of every posterior object (see the module docstring)."""

    kind: ClassVar[str]

    @property
    def mean(self) -> Tensor: ...

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor: ...

    def predict_proba(self, inputs: Tensor, method: Any = None) -> Tensor: ...

    def to(self, device: torch.device | str) -> Posterior: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> Posterior: ...
