"""Turning user arrays into tensors: shapes, dtypes and label checks.

Probabilities/logits must be a 2-D array (N, K) with K >= 2 classes; labels a 1-D array (N,) of
integer class indices in [0, K). numpy arrays are wrapped without a copy; torch tensors stay on
their device. Problems raise :class:`calibration.errors.InvalidInputError` with what was wrong.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.errors import InvalidInputError

ArrayLike = Tensor | np.ndarray


def as_tensor(array: Any, name: str) -> Tensor:
    """Wrap ``array`` (tensor, numpy array or sequence) as a tensor, without copying if possible."""
    if isinstance(array, Tensor):
        return array.detach()
    if isinstance(array, np.ndarray):
        if array.dtype == object:
            raise InvalidInputError(f"{name} has dtype object; pass a numeric array")
        with warnings.catch_warnings():
            # Read-only numpy arrays (e.g. from np.load) are fine: nothing here writes to them.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(array))
    try:
        return torch.as_tensor(np.asarray(array))
    except (TypeError, ValueError, RuntimeError) as err:
        raise InvalidInputError(f"{name} is not a numeric array: {err}") from None


def score_matrix(scores: Any, name: str = "probs") -> Tensor:
    """Validate the shape/dtype of probabilities or logits and return a floating (N, K) tensor.

    float16/bfloat16 and integer inputs are widened to float32; float32/float64 are kept.
    """
    tensor = as_tensor(scores, name)
    if tensor.ndim != 2:
        raise InvalidInputError(
            f"{name} must have shape (N, K) (one row per sample, one column per class); "
            f"got shape {tuple(tensor.shape)}"
        )
    if tensor.shape[0] == 0:
        raise InvalidInputError(f"{name} is empty: no samples to score")
    if tensor.shape[1] < 2:
        raise InvalidInputError(
            f"{name} must have K >= 2 class columns; got {tensor.shape[1]} "
            "(for a binary classifier pass both columns [1 - p, p])"
        )
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidInputError(f"{name} must be real-valued; got dtype {tensor.dtype}")
    if tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.to(torch.float32)
    return tensor.contiguous()


def class_labels(labels: Any, n_samples: int, n_classes: int, device: torch.device) -> Tensor:
    """Validate labels and return them as an int64 tensor (N,) on ``device``.

    Accepts integer dtypes, or floating dtypes whose values are all whole numbers.
    """
    tensor = as_tensor(labels, "labels")
    if tensor.ndim != 1:
        hint = " (for one-hot labels pass labels.argmax(1))" if tensor.ndim == 2 else ""
        raise InvalidInputError(
            "labels must be a 1-D array of class indices (N,); "
            f"got shape {tuple(tensor.shape)}{hint}"
        )
    if tensor.shape[0] != n_samples:
        raise InvalidInputError(
            f"shape mismatch: {n_samples} rows of scores but {tensor.shape[0]} labels"
        )
    if n_samples == 0:
        raise InvalidInputError("labels are empty: no samples to score")
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise InvalidInputError(f"labels must be integer class indices; got dtype {tensor.dtype}")
    if tensor.is_floating_point():
        finite = torch.isfinite(tensor)
        whole = finite & (tensor == tensor.round())
        if not bool(whole.all()):
            bad = int((~whole).nonzero()[0, 0])
            raise InvalidInputError(
                f"labels must be integer class indices; labels[{bad}] = {tensor[bad].item()!r}"
            )
    tensor = tensor.to(device=device, dtype=torch.int64)
    low, high = (int(bound) for bound in torch.aminmax(tensor))  # one pass
    if low < 0 or high >= n_classes:
        bad_value = low if low < 0 else high
        raise InvalidInputError(
            f"label {bad_value} is out of range: labels must lie in [0, {n_classes}) "
            f"for {n_classes} classes"
        )
    return tensor
