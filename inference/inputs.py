"""The input boundary of [`inference`][inference]: user arrays become checked tensors.

Every public entry point that takes data (`inference.fit_head`, the posteriors'
``predict_proba``) accepts a torch tensor, a NumPy array, or a (nested) list of numbers, and
turns it into a tensor here, so that a bad input fails at the boundary with an
`InvalidInputError` that says what was wrong and what to pass instead.

Dtype policy (what a caller gets back):

* ``float32`` and ``float64`` are kept as they are (NumPy arrays are wrapped without a copy when
  they are contiguous and in native byte order); the posteriors compute in float64 and return
  probabilities in the dtype of the features they were given.
* ``float16``, ``bfloat16`` and integer arrays are widened to ``float32`` (as the calibration
  API does); NumPy's ``longdouble`` (float128) is narrowed to ``float64``, which holds every
  value a feature can meaningfully carry.
* Big-endian NumPy arrays are converted to native byte order.
* Booleans, complex numbers, strings, bytes, Python objects, datetimes and structured records are
  refused, as are sparse, quantized and ``meta`` tensors.
* Labels may be any integer dtype, or floats that are whole numbers; they come back as
  ``int64`` on the features' device. Values must lie in ``[0, num_classes)``.

Tensors stay on their device; nothing here moves data between devices except labels, which are
put beside their features.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from inference.errors import InvalidInputError

#: Floating dtypes kept as they are; every other real dtype is converted (module docstring).
KEPT_FLOAT_DTYPES = (torch.float32, torch.float64)

_NUMPY_KIND_NAMES = {
    "b": "booleans",
    "c": "complex numbers",
    "U": "strings",
    "S": "bytes",
    "O": "Python objects",
    "M": "datetimes",
    "m": "time differences",
    "V": "structured records",
}


def as_tensor(value: Any, name: str) -> Tensor:
    """``value`` (tensor, NumPy array, nested list of numbers) as a real-valued tensor.

    Tensors are returned detached and unchanged otherwise (same device and dtype); NumPy arrays
    are wrapped without a copy where possible. No dtype conversion happens here beyond what
    NumPy needs (byte order, ``longdouble``); see `as_floating`.

    Raises:
        InvalidInputError: ``value`` is not numeric (strings, objects, ragged lists, ...), is
            complex or boolean, or is a sparse, quantized or ``meta`` tensor.
    """
    if isinstance(value, Tensor):
        return _checked_tensor(value.detach(), name)
    if isinstance(value, np.ndarray | np.generic):
        return _from_numpy(np.asarray(value), name)
    if isinstance(value, str | bytes) or value is None or isinstance(value, dict | set):
        raise InvalidInputError(
            f"{name} must be a tensor or an array of numbers; got a {type(value).__name__}."
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPy warns before it refuses ragged lists
            array = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidInputError(
            f"{name} is not an array of numbers ({error}); pass a tensor or a NumPy array."
        ) from None
    return _from_numpy(array, name)


def _from_numpy(array: np.ndarray, name: str) -> Tensor:
    kind = array.dtype.kind
    if kind in _NUMPY_KIND_NAMES:
        raise InvalidInputError(
            f"{name} holds {_NUMPY_KIND_NAMES[kind]} (NumPy dtype {array.dtype}); pass real "
            "numbers (a float32 or float64 array)."
        )
    if kind == "f" and array.dtype.itemsize > 8:  # longdouble: torch has no such dtype
        array = array.astype(np.float64)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # Read-only arrays (np.load, broadcast views) are fine: nothing here writes to them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


def _checked_tensor(tensor: Tensor, name: str) -> Tensor:
    if tensor.layout != torch.strided:
        raise InvalidInputError(
            f"{name} is a {tensor.layout} tensor; pass a dense one (call .to_dense())."
        )
    if tensor.is_quantized:
        raise InvalidInputError(f"{name} is a quantized tensor; pass .dequantize() of it.")
    if tensor.device.type == "meta":
        raise InvalidInputError(f"{name} is a 'meta' tensor, which holds no values.")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidInputError(
            f"{name} has dtype {tensor.dtype}; pass real numbers (float32 or float64)."
        )
    return tensor


def as_floating(value: Any, name: str) -> Tensor:
    """`as_tensor`, then the dtype policy of the module docstring (float32 / float64
    kept; narrower floats and integers widened to float32)."""
    tensor = as_tensor(value, name)
    if tensor.dtype not in KEPT_FLOAT_DTYPES:
        tensor = tensor.to(torch.float32)
    return tensor


def check_finite(tensor: Tensor, name: str) -> None:
    """Raise `InvalidInputError` naming how many entries of ``tensor`` are NaN or inf."""
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise InvalidInputError(
            f"{bad} of the {tensor.numel()} values in {name} are NaN or infinite; remove or "
            "impute them before fitting or predicting."
        )


def as_features(value: Any, num_features: int | None = None, name: str = "features") -> Tensor:
    """Features ``(B, m)`` as a finite floating tensor (dtype policy: module docstring).

    Args:
        value: tensor, NumPy array or nested list, shape ``(B, m)``.
        num_features: the ``m`` a fitted head expects, or None to accept any width.
        name: what the caller calls the argument, for messages.

    Raises:
        InvalidInputError: not numeric, not 2-D, the wrong width, or NaN / inf entries.
    """
    tensor = as_floating(value, name)
    if tensor.ndim != 2:
        hint = (" (one sample? pass it as a row: x.reshape(1, -1))" if tensor.ndim == 1
                else "")
        raise InvalidInputError(
            f"{name} must be 2-D (B, m), one row per sample; got shape {tuple(tensor.shape)}"
            f"{hint}."
        )
    if num_features is not None and tensor.shape[1] != num_features:
        raise InvalidInputError(
            f"{name} have {tensor.shape[1]} columns but the head was fitted on {num_features} "
            "features; pass the same body features it was fitted on (without a constant 1)."
        )
    check_finite(tensor, name)
    return tensor


def as_labels(
    value: Any, num_rows: int, num_classes: int, device: torch.device | str | None = None,
    name: str = "labels",
) -> Tensor:
    """Class labels ``(N,)`` as an int64 tensor on ``device`` (default: where they are).

    Integer dtypes, and floating dtypes whose values are all whole numbers, are accepted.

    Raises:
        InvalidInputError: not numeric, not 1-D of length ``num_rows``, booleans, fractions,
            NaN, or a value outside ``[0, num_classes)``.
    """
    tensor = as_tensor(value, name)
    if tensor.ndim != 1:
        hint = " (one-hot labels? pass labels.argmax(1))" if tensor.ndim == 2 else ""
        raise InvalidInputError(
            f"{name} must be a 1-D array of class indices (N,); got shape "
            f"{tuple(tensor.shape)}{hint}."
        )
    if tensor.shape[0] != num_rows:
        raise InvalidInputError(f"{num_rows} rows of features but {tensor.shape[0]} {name}.")
    if tensor.is_floating_point():
        whole = torch.isfinite(tensor) & (tensor == tensor.round())
        if not bool(whole.all()):
            index = int((~whole).nonzero()[0, 0])
            raise InvalidInputError(
                f"{name} must be integer class indices; {name}[{index}] = "
                f"{tensor[index].item()!r}."
            )
    tensor = tensor.to(device=tensor.device if device is None else device, dtype=torch.int64)
    if tensor.numel():
        low, high = (int(v) for v in torch.aminmax(tensor))
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise InvalidInputError(
                f"{name} must lie in [0, {num_classes}) for {num_classes} classes; found {bad}."
            )
    return tensor


def as_targets(value: Any, num_rows: int, device: torch.device | str | None = None,
               name: str = "targets") -> Tensor:
    """Real regression targets ``(N,)`` (Gaussian likelihood) as a finite floating tensor."""
    tensor = as_floating(value, name)
    if tensor.ndim != 1 or tensor.shape[0] != num_rows:
        raise InvalidInputError(
            f"{name} must have shape ({num_rows},) to match the features; got "
            f"{tuple(tensor.shape)}."
        )
    check_finite(tensor, name)
    return tensor.to(tensor.device if device is None else device)


def as_num_classes(value: Any, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum`` (NumPy integers accepted; bools refused)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral) \
            or int(value) < minimum:
        raise InvalidInputError(f"num_classes must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def as_network_inputs(value: Any, dtype: torch.dtype | None, name: str = "inputs") -> Tensor:
    """A batch of network inputs ``(B, ...)`` as a tensor the network can take.

    Floating inputs are cast to ``dtype``, the network's floating parameter dtype (None: kept),
    so float64 inputs work with a float32 network and the other way round, and must be finite.
    Integer inputs are kept as they are (a network may embed token or category indices).

    Raises:
        InvalidInputError: not numeric, no leading batch axis, an empty batch, or NaN / inf.
    """
    tensor = as_tensor(value, name)
    if tensor.ndim == 0 or tensor.shape[0] == 0:
        raise InvalidInputError(
            f"{name} must be a non-empty batch (B, ...) with a leading batch axis; got shape "
            f"{tuple(tensor.shape)}."
        )
    if tensor.is_floating_point():
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        check_finite(tensor, name)
    return tensor


def as_model_inputs(value: Any, *, input_shape: tuple[int, ...] | None, dtype: torch.dtype | None,
                    device: torch.device | str, name: str = "inputs") -> Tensor:
    """`as_network_inputs`, checked to be shaped ``(B, *input_shape)`` (None: not checked)
    and put on ``device``: the default input boundary of the posteriors that hold a network
    ([`NetworkGaussian`][inference.network_gaussian.NetworkGaussian],
    [`BodyPosterior`][inference.body_posterior.BodyPosterior]).

    Raises:
        InvalidInputError: what `as_network_inputs` refuses, or a per-sample shape other
            than ``input_shape``.
    """
    tensor = as_network_inputs(value, dtype, name)
    if input_shape is not None and tuple(tensor.shape[1:]) != tuple(input_shape):
        want = ", ".join(["B", *map(str, input_shape)])
        raise InvalidInputError(f"{name} has shape {tuple(tensor.shape)} but the network takes "
                                f"({want}); pass inputs shaped like the ones it was trained on.")
    return tensor.to(device)


def module_dtype(module: torch.nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The floating dtype of ``module``'s first floating parameter or buffer (``default`` if it
    has none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return default


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (CPU if it has none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


__all__ = [
    "KEPT_FLOAT_DTYPES",
    "as_features",
    "as_floating",
    "as_labels",
    "as_model_inputs",
    "as_network_inputs",
    "as_num_classes",
    "as_targets",
    "as_tensor",
    "check_finite",
    "module_device",
    "module_dtype",
]
