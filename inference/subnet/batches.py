"""Validation of what subnet Laplace reads: loader batches ``(X, y)`` and model logits ``(B, C)``.

Checks that would need a device sync per batch (label range, finiteness) are accumulated on
the device and resolved once, by `BatchChecks.finish`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError

__all__ = ["BatchChecks", "check_logits", "iterate_batches"]


def iterate_batches(loader: Iterable, device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(X, y)`` moved to ``device``; raise on anything else.

    ``X`` is a tensor with a leading batch axis; ``y`` holds integer class labels, shape ``(B,)``.
    """
    n_batches = 0
    for i, batch in enumerate(loader):
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            kind = type(batch).__name__
            size = f" of length {len(batch)}" if isinstance(batch, tuple | list) else ""
            raise InvalidInputError(
                f"batch {i} of the loader is a {kind}{size}; subnet Laplace needs (X, y) pairs"
            )
        X, y = batch
        if not isinstance(X, Tensor) or not isinstance(y, Tensor):
            raise InvalidInputError(
                f"batch {i}: X and y must be tensors, got {type(X).__name__} and {type(y).__name__}"
            )
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise InvalidInputError(
                f"batch {i}: labels y must be integer class indices (e.g. int64), got {y.dtype}; "
                "one-hot or probability targets are not accepted"
            )
        if y.dim() != 1 or X.dim() == 0 or X.shape[0] != y.shape[0]:
            raise InvalidInputError(
                f"batch {i}: y must be 1-D with one label per row of X; got X {tuple(X.shape)}, "
                f"y {tuple(y.shape)}"
            )
        if y.numel() == 0:
            continue
        n_batches += 1
        yield X.to(device), y.to(device)
    if n_batches == 0:
        raise InvalidInputError("the loader yielded no (non-empty) batches")


def check_logits(logits: object, batch_size: int) -> Tensor:
    """The model output must be a floating ``(B, C)`` tensor of logits with ``C >= 2``."""
    if not isinstance(logits, Tensor):
        raise InvalidInputError(
            f"the model must return a (B, C) logits tensor, got {type(logits).__name__}"
        )
    if logits.dim() != 2 or logits.shape[0] != batch_size or logits.shape[1] < 2:
        raise InvalidInputError(
            f"the model must return (B, C) logits with B = {batch_size} and C >= 2 classes, got "
            f"shape {tuple(logits.shape)}; flatten extra output axes or add a classifier head"
        )
    if not logits.dtype.is_floating_point:
        raise InvalidInputError(f"the model's logits must be floating point, got {logits.dtype}")
    return logits


class BatchChecks:
    """Accumulates label-range and finiteness checks on the device; one sync in `finish`."""

    def __init__(self) -> None:
        self._label_min: Tensor | None = None
        self._label_max: Tensor | None = None
        self._finite: Tensor | None = None
        self.n_classes: int | None = None
        self.n_data = 0

    def update(self, logits: Tensor, y: Tensor) -> None:
        """Record one batch: (B, C) logits and (B,) integer labels, on the same device."""
        if self.n_classes is None:
            self.n_classes = logits.shape[1]
        elif logits.shape[1] != self.n_classes:
            raise InvalidInputError(
                f"the number of classes changed between batches: {self.n_classes} then "
                f"{logits.shape[1]}"
            )
        self.n_data += y.shape[0]
        lo, hi, fin = y.min(), y.max(), torch.isfinite(logits).all()
        if self._label_min is None:
            self._label_min, self._label_max, self._finite = lo, hi, fin
        else:
            self._label_min = torch.minimum(self._label_min, lo)
            self._label_max = torch.maximum(self._label_max, hi)
            self._finite = self._finite & fin

    def finish(self) -> None:
        """Raise if any label was outside ``[0, C)`` or any logit was not finite."""
        if self._label_min is None:
            raise InvalidInputError("the loader yielded no (non-empty) batches")
        lo, hi, fin = torch.stack(
            [self._label_min.double(), self._label_max.double(), self._finite.double()]
        ).tolist()
        if lo < 0 or hi >= self.n_classes:
            raise InvalidInputError(
                f"labels must lie in [0, {self.n_classes}) for a model with {self.n_classes} "
                f"outputs; got min {int(lo)}, max {int(hi)}"
            )
        if fin < 1.0:
            raise NumericalError("the model produced non-finite logits (NaN or inf) on the data")
