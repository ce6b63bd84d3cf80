"""Turning user arrays into tensors: shapes, dtypes and label checks.

Probabilities/logits must be a 2-D array (N, K) with K >= 2 classes; labels a 1-D array (N,) of
integer class indices in [0, K). numpy arrays are wrapped without a copy where torch can hold
them as they are; torch tensors stay on their device. Problems raise
`calibration.errors.InvalidInputError` with what was wrong and what to pass instead.

What is accepted, and how it is converted (nothing is ever guessed from the values):

* numpy arrays of any byte order: a big-endian array (e.g. read from a file written on another
  machine) is copied into native byte order, which torch requires;
* extended precision (``np.longdouble``, "float128" on x86) has no torch dtype: it is rounded to
  float64 (a relative change below 1.2e-16, far below any metric's resolution); values beyond
  float64's range are refused rather than turned into infinities;
* unsigned integers wider than 8 bits are held as int64 (torch supports few operations on
  uint16/32/64); a uint64 value above 2**63 - 1 is refused;
* refused with a reason: text, dates and times, Python objects (e.g. ``None`` or mixed types),
  structured records, complex numbers, and torch tensors that are sparse, nested, quantized or on
  the ``meta`` device (no values).
"""

from __future__ import annotations

import operator
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.errors import InvalidInputError

ArrayLike = Tensor | np.ndarray

_INT64_MAX = np.iinfo(np.int64).max
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_REFUSED_KINDS = {
    "U": ("holds text", "convert the strings to numbers first, e.g. np.asarray(x, dtype=float)"),
    "S": ("holds bytes", "convert them to numbers first, e.g. np.asarray(x, dtype=float)"),
    "M": ("holds dates", "pass numbers"),
    "m": ("holds time spans", "pass numbers"),
    "O": ("holds Python objects (e.g. None, mixed types or ragged rows)", "pass a numeric array"),
    "V": ("is a structured/void array", "pass a plain numeric array (e.g. one of its fields)"),
}


def as_tensor(array: Any, name: str) -> Tensor:
    """Wrap ``array`` (tensor, numpy array or sequence) as a real tensor; see the module notes.

    numpy input is wrapped without a copy where torch can hold it as it is; tensors are detached
    and kept on their device.
    """
    if isinstance(array, Tensor):
        return _checked_tensor(array.detach(), name)
    if not isinstance(array, np.ndarray):
        try:
            array = np.asarray(array)
        except (TypeError, ValueError, OverflowError) as err:
            reason = " ".join(str(err).split())
            raise InvalidInputError(f"{name} is not a numeric array ({reason})") from None
    array = _numeric_array(array, name)
    with warnings.catch_warnings():
        # Read-only numpy arrays (e.g. from np.load) are fine: nothing here writes to them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


def _numeric_array(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` in a dtype and byte order torch can wrap, or InvalidInputError."""
    kind = array.dtype.kind
    if kind in _REFUSED_KINDS:
        what, advice = _REFUSED_KINDS[kind]
        raise InvalidInputError(f"{name} {what} (dtype {array.dtype}); {advice}")
    if kind == "c":
        raise _complex_error(name, array.dtype)
    if not array.dtype.isnative:  # big-endian data on a little-endian machine (or vice versa)
        array = array.astype(array.dtype.newbyteorder("="))
    if kind == "f" and array.dtype.itemsize > 8:  # np.longdouble: no torch dtype
        with np.errstate(over="ignore"):  # overflow is detected and reported below
            wide = array.astype(np.float64)
        if np.count_nonzero(np.isfinite(wide)) != np.count_nonzero(np.isfinite(array)):
            raise InvalidInputError(
                f"{name} ({array.dtype}) holds values beyond float64's range (about 1.8e308); "
                "pass float64 values"
            )
        return wide
    if kind == "u" and array.dtype.itemsize > 1:
        if array.dtype.itemsize == 8 and array.size and int(array.max()) > _INT64_MAX:
            raise InvalidInputError(
                f"{name} holds {int(array.max())}, beyond the int64 range of indices; "
                "pass values below 2**63"
            )
        return array.astype(np.int64)
    return array


def _checked_tensor(tensor: Tensor, name: str) -> Tensor:
    """A dense, real tensor with values, or InvalidInputError saying what it is instead."""
    if tensor.is_nested:
        raise InvalidInputError(
            f"{name} is a nested tensor; pass a regular (N, K) tensor (e.g. torch.stack its rows)"
        )
    if tensor.layout != torch.strided:
        raise InvalidInputError(
            f"{name} is a sparse tensor (layout {tensor.layout}); pass a dense one "
            "(tensor.to_dense())"
        )
    if tensor.is_quantized:
        raise InvalidInputError(
            f"{name} is a quantized tensor (dtype {tensor.dtype}); pass tensor.dequantize()"
        )
    if tensor.device.type == "meta":
        raise InvalidInputError(
            f"{name} is on the 'meta' device and holds no values; pass a tensor with data"
        )
    if tensor.is_complex():
        raise _complex_error(name, tensor.dtype)
    if tensor.dtype in _WIDE_UNSIGNED:  # few torch operations support them
        if tensor.dtype == torch.uint64:
            return as_tensor(tensor.cpu().numpy(), name).to(tensor.device)
        return tensor.to(torch.int64)
    return tensor


def _complex_error(name: str, dtype: Any) -> InvalidInputError:
    return InvalidInputError(
        f"{name} must be real-valued; got complex dtype {dtype} (pass x.real if the imaginary "
        "parts are zero)"
    )


def flag(value: Any, name: str, why: str = "") -> bool:
    """``value`` as a bool: True/False (or numpy's bools), never a truthy stand-in."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidInputError(f"{name} must be True or False; got {value!r}{why}")
    return bool(value)


def path_argument(value: Any, name: str) -> Path:
    """``value`` (a str or os.PathLike) as a Path, or InvalidInputError."""
    if isinstance(value, str | os.PathLike) and str(value).strip():
        return Path(value)
    raise InvalidInputError(f"{name} must be a file path (str or pathlib.Path); got {value!r}")


def positive_int(value: Any, name: str, limit: int | None = None, why: str = "") -> int:
    """``value`` as a Python int >= 1 (any integer type: int, numpy or 0-d integer tensor).

    Floats (even 15.0) and bools are refused. ``limit``: the largest value allowed, with ``why``
    saying what the limit protects.
    """
    if isinstance(value, bool | np.bool_):
        raise InvalidInputError(f"{name} must be a positive integer; got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidInputError(f"{name} must be a positive integer; got {value!r}") from None
    if number < 1:
        raise InvalidInputError(f"{name} must be a positive integer; got {number}")
    if limit is not None and number > limit:
        raise InvalidInputError(f"{name} = {number:,} exceeds the limit of {limit:,}{why}")
    return number


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
    if tensor.dtype == torch.bool:
        raise InvalidInputError(f"{name} must be real-valued numbers; got dtype {tensor.dtype}")
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
    if tensor.dtype == torch.bool:
        raise InvalidInputError(f"labels must be integer class indices; got dtype {tensor.dtype}")
    return index_array(tensor, "labels", n_classes, f"for {n_classes} classes", device,
                       kind="class indices")


def index_array(tensor: Tensor, name: str, upper: int, meaning: str,
                device: torch.device, kind: str = "indices") -> Tensor:
    """Whole numbers in ``[0, upper)`` as int64 on ``device``, or InvalidInputError.

    Floating input must hold whole numbers; its range is checked before the conversion, so a
    value such as 1e30 is reported as it is rather than as the integer it would wrap to.
    """
    if tensor.is_floating_point():
        finite = torch.isfinite(tensor)
        whole = finite & (tensor == tensor.round())
        if not bool(whole.all()):
            bad = int((~whole).nonzero()[0, 0])
            raise InvalidInputError(
                f"{name} must be integer {kind}; {name}[{bad}] = {tensor[bad].item()!r}"
            )
        _check_range(tensor, name, upper, meaning)
    tensor = tensor.to(device=device, dtype=torch.int64)
    _check_range(tensor, name, upper, meaning)
    return tensor


def _check_range(tensor: Tensor, name: str, upper: int, meaning: str) -> None:
    if tensor.numel() == 0:
        return
    low, high = (bound.item() for bound in torch.aminmax(tensor))  # one pass
    if low < 0 or high >= upper:
        bad = low if low < 0 else high
        shown = int(bad) if float(bad).is_integer() and abs(bad) < 2**63 else bad
        singular = name[:-1] if name.endswith("s") else name
        raise InvalidInputError(
            f"{singular} {shown} is out of range: {name} must lie in [0, {upper}) {meaning}"
        )
