"""Client ids of a per-client report: one id per sample, all of one kind.

A client id is an integer, a finite real number or a non-empty string; every id of one call must
be of the same kind (numbers and strings mixed would be compared and named inconsistently: numpy
silently turns ``[1, "a"]`` into the strings ``"1"`` and ``"a"``). Missing ids are refused rather
than grouped: ``None`` and NaN (how pandas marks an empty CSV cell) would otherwise become a
client named "None" or "nan".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor

_ADVICE = "client ids must be integers or strings, one per sample"


def client_id_array(client_ids: Any, n_samples: int) -> np.ndarray:
    """Validated ids (N,) as a numpy array of integers, floats or ``str``.

    ``client_ids``: a sequence, numpy array or tensor of length ``n_samples``. Raises
    `InvalidInputError` for a wrong shape, a missing id (None, NaN), an empty string,
    mixed kinds, or values that are not ids (bools, bytes, dates, objects).
    """
    if isinstance(client_ids, torch.Tensor):
        ids = as_tensor(client_ids, "client_ids").cpu().numpy()
    elif isinstance(client_ids, np.ndarray):
        ids = client_ids
    elif isinstance(client_ids, str | bytes):
        raise InvalidInputError(
            f"client_ids must be a sequence of ids (one per sample); got a single "
            f"{type(client_ids).__name__}"
        )
    else:
        try:
            ids = np.empty(len(client_ids), dtype=object)
            ids[:] = list(client_ids)
        except (TypeError, ValueError):
            raise InvalidInputError(
                f"client_ids must be a sequence of ids (one per sample); got "
                f"{type(client_ids).__name__}"
            ) from None
    if ids.ndim != 1 or ids.shape[0] != n_samples:
        raise InvalidInputError(
            f"client_ids must have shape ({n_samples},) (one id per sample); "
            f"got {tuple(ids.shape)}"
        )
    if ids.dtype == object:
        ids = _from_objects(ids)
    return _checked(ids)


def _from_objects(ids: np.ndarray) -> np.ndarray:
    """Python objects as a typed array, refusing None, mixed kinds and non-id values."""
    types = set(map(type, ids))
    kinds = {_kind(kind) for kind in types}
    if None in kinds:
        first = _first(ids, lambda v: _kind(type(v)) is None)
        value = ids[first]
        what = "missing (None)" if value is None else f"a {type(value).__name__} ({value!r})"
        raise InvalidInputError(f"client_ids[{first}] is {what}; {_ADVICE}")
    has_floats = any(issubclass(kind, float | np.floating) for kind in types)
    if has_floats:
        missing = [i for i, v in enumerate(ids)
                   if isinstance(v, float | np.floating) and math.isnan(v)]
        if missing:  # how pandas marks an empty cell of a text column
            raise InvalidInputError(
                f"client_ids[{missing[0]}] is missing (NaN) ({len(missing)} such ids); every "
                "sample needs a client id (fill or drop the rows without one)"
            )
    if len(kinds) > 1:
        number = _first(ids, lambda v: _kind(type(v)) == "number")
        text = _first(ids, lambda v: _kind(type(v)) == "text")
        raise InvalidInputError(
            f"client ids mix numbers (client_ids[{number}] = {ids[number]!r}) and strings "
            f"(client_ids[{text}] = {ids[text]!r}); use one kind, e.g. all strings"
        )
    if "text" in kinds:
        return ids.astype(str)
    if has_floats:
        return ids.astype(np.float64)
    try:
        return ids.astype(np.int64)
    except OverflowError:
        raise InvalidInputError(
            "client ids hold an integer beyond the int64 range; use strings for such ids"
        ) from None


def _kind(kind: type) -> str | None:
    """"number", "text", or None for a type that is no client id."""
    if issubclass(kind, bool | np.bool_):
        return None
    if issubclass(kind, int | float | np.integer | np.floating):
        return "number"
    if issubclass(kind, str):
        return "text"
    return None


def _first(ids: np.ndarray, test) -> int:
    return next(i for i, value in enumerate(ids) if test(value))


def _checked(ids: np.ndarray) -> np.ndarray:
    """A typed id array: refuse NaN/Inf, empty strings and kinds that are no ids."""
    kind = ids.dtype.kind
    if kind in "iu":
        return ids
    if kind == "f":
        bad = ~np.isfinite(ids)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            what = "missing (NaN)" if math.isnan(ids[first]) else f"{ids[first]}"
            raise InvalidInputError(
                f"client_ids[{first}] is {what} ({int(bad.sum())} such ids); every sample needs "
                "a client id (fill or drop the rows without one)"
            )
        return ids
    if kind == "U":
        empty = ids == ""
        if empty.any():
            first = int(np.flatnonzero(empty)[0])
            raise InvalidInputError(
                f"client_ids[{first}] is an empty string ({int(empty.sum())} such ids); every "
                "sample needs a client id"
            )
        return ids
    raise InvalidInputError(f"client_ids have dtype {ids.dtype}; {_ADVICE}")
