"""Reading saved predictions (.npz, .npy, .pt, .csv) without ever unpickling.

Layouts (the kind of score is always stated, never guessed from the values):

* ``.npz`` / ``.pt``: a mapping of arrays/tensors with ``probs`` (N, K) — or ``logits`` (N, K)
  when ``logits=True`` — plus ``labels`` (N,) and optionally ``client_ids`` (N,). ``.npz`` is read
  with ``allow_pickle=False``; ``.pt`` with ``torch.load(weights_only=True)`` and must hold
  tensors only (a dict of tensors, or one tensor of scores).
* ``.npy``: one (N, K) array of scores; labels then come from a separate file.
* ``.csv``: a header row; a ``label`` (or ``labels``) column, an optional ``client_id`` (or
  ``client_ids``) column, and every other column is one class score, in file order. A first
  column without a header name holding distinct integers is the index pandas writes by default
  (``DataFrame.to_csv`` without ``index=False``): it is ignored, with a
  [`calibration.errors.CalibrationWarning`][calibration.errors.CalibrationWarning] saying so.
* a separate labels file: ``.npy`` (N,), ``.npz``/``.pt`` with ``labels`` (or a single
  array/tensor), or ``.csv`` with a ``label``/``labels`` column (or a single column).

Every file is opened and bounded as `calibration.bounded_files` describes: it must be a
regular file (a directory, FIFO, device or symlink loop is named as such), and no file may hold
or decompress to more than ``max_bytes`` (`MAX_FILE_BYTES`, 1 GiB, by default); sizes
are checked from the file's own declarations before anything is allocated. Problems raise
[`calibration.errors.FileFormatError`][calibration.errors.FileFormatError] saying what was found.
"""

from __future__ import annotations

import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from calibration.bounded_files import (
    MAX_FILE_BYTES,
    check_size,
    file_size,
    is_zip_archive,
    open_archive,
    open_regular_file,
    read_npy,
    read_npz,
)
from calibration.errors import CalibrationWarning, FileFormatError, InvalidInputError
from calibration.inputs import flag, path_argument, positive_int

LABEL_KEYS = ("labels", "label")
CLIENT_KEYS = ("client_ids", "client_id")
SUFFIXES = (".npz", ".npy", ".pt", ".csv")


@dataclass(frozen=True, eq=False)
class Predictions:
    """Scores (N, K) as numpy or torch, labels (N,), optional client ids (N,), and their kind."""

    scores: Any
    labels: Any
    client_ids: np.ndarray | None
    from_logits: bool


def load_predictions(
    path: str | Path,
    labels_path: str | Path | None = None,
    *,
    logits: bool = False,
    label_key: str | None = None,
    client_key: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
) -> Predictions:
    """Read predictions (and labels, client ids) from ``path``; see the module docstring.

    ``label_key``/``client_key`` name the entry or column to use instead of the defaults; a
    named client key must exist, the default ones are used when present. ``max_bytes``: the
    most bytes each file may hold or decompress to.
    """
    path = path_argument(path, "path")
    labels_path = None if labels_path is None else path_argument(labels_path, "labels_path")
    logits = flag(logits, "logits")
    for name, key in (("label_key", label_key), ("client_key", client_key)):
        if key is not None and not isinstance(key, str):
            raise InvalidInputError(f"{name} must be a column or entry name (str); got {key!r}")
    max_bytes = positive_int(max_bytes, "max_bytes")
    score_key = "logits" if logits else "probs"
    table = _read_table(path, max_bytes)
    if isinstance(table, _Columns):
        scores = table.score_matrix(exclude=(label_key, client_key, *LABEL_KEYS, *CLIENT_KEYS))
    elif isinstance(table, dict):
        if score_key not in table:
            hint = ""
            if "logits" in table and not logits:
                hint = " (this file holds 'logits': pass --logits / logits=True)"
            elif "probs" in table and logits:
                hint = " (this file holds 'probs': drop --logits)"
            raise FileFormatError(
                f"{path.name}: no '{score_key}' entry; found {sorted(table)}{hint}"
            )
        scores = table[score_key]
    else:
        scores = table

    if labels_path is not None:
        labels = _read_labels(labels_path, label_key, max_bytes)
    elif isinstance(table, dict | _Columns):
        labels = _pick(table, path, label_key, LABEL_KEYS, "labels")
    else:
        raise FileFormatError(
            f"{path.name} holds only scores; give the labels with --labels FILE"
        )
    if labels is None:
        raise FileFormatError(f"{path.name}: no labels found (expected one of {LABEL_KEYS})")

    client_ids = None
    if isinstance(table, dict | _Columns):
        client_ids = _pick(table, path, client_key, CLIENT_KEYS, "client ids", required=False)
    elif client_key is not None:
        raise FileFormatError(f"{path.name} holds only scores; it has no '{client_key}' entry")
    if client_ids is not None:
        client_ids = np.asarray(client_ids.cpu() if isinstance(client_ids, torch.Tensor)
                                else client_ids)
    return Predictions(scores, labels, client_ids, logits)


class _Columns(dict):
    """CSV columns by header name, in file order."""

    def score_matrix(self, exclude: tuple[str | None, ...]) -> np.ndarray:
        names = [name for name in self if name not in exclude]
        if len(names) < 2:
            raise FileFormatError(
                f"CSV needs at least 2 class-score columns besides labels/client ids; got {names}"
            )
        columns = []
        for name in names:
            try:
                columns.append(np.asarray(self[name], dtype=np.float64))
            except (TypeError, ValueError):
                raise FileFormatError(_not_numeric(name, self[name])) from None
        return np.column_stack(columns)


def _not_numeric(name: str, values: Any) -> str:
    """Why column ``name`` cannot be a class score, and what to do about it."""
    bad = [(i, v) for i, v in enumerate(values) if not _is_number(v)]
    row, value = bad[0]
    if len(bad) < len(values):  # a score column with a stray entry
        return (f"CSV column {name!r} holds a non-number in row {row + 1} ({value!r}; "
                f"{len(bad)} such row(s)); class scores must be numbers: fix or drop those rows")
    flag = shlex.quote(name)
    return (f"CSV column {name!r} is not numeric (row {row + 1}: {value!r}), so it cannot be a "
            f"class score; if it holds client ids pass --client-column {flag} (Python: "
            f"client_key={name!r}), if it holds the labels --label-column {flag} "
            f"(label_key={name!r})")


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _pick(table: dict, path: Path, key: str | None, defaults: tuple[str, ...], what: str,
          required: bool = True) -> Any:
    if key is not None:
        if key not in table:
            raise FileFormatError(
                f"{path.name}: no '{key}' entry for {what}; found {sorted(table)}"
            )
        return table[key]
    for name in defaults:
        if name in table:
            return table[name]
    if required:
        raise FileFormatError(
            f"{path.name}: no {what} (expected one of {list(defaults)}); found {sorted(table)}"
        )
    return None


def _read_table(path: Path, max_bytes: int) -> dict | np.ndarray | torch.Tensor:
    with open_regular_file(path) as handle:  # first: say what the path is, whatever its name
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            raise FileFormatError(
                f"{path.name}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)}"
            )
        if suffix == ".npz":
            return read_npz(handle, path.name, max_bytes)
        if suffix == ".npy":
            return read_npy(handle, path.name, max_bytes)
        if suffix == ".pt":
            return _read_pt(handle, path.name, max_bytes)
        return _read_csv(handle, path.name, max_bytes)


def _read_pt(handle: BinaryIO, name: str, max_bytes: int) -> dict[str, torch.Tensor] | torch.Tensor:
    # torch.save writes a zip archive (since torch 1.6): its declared sizes bound what loading
    # allocates. The older format declares storage sizes inside the pickle, unbounded: refused.
    if not is_zip_archive(handle):
        raise FileFormatError(
            f"{name}: not a zip-format .pt file (torch.save has written zip archives since "
            "torch 1.6); re-save it with a current torch, or save the arrays as .npz"
        )
    open_archive(handle, name, max_bytes).close()
    handle.seek(0)
    try:
        content = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt or unsafe content fails in many ways (IndexError, ...)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(
            f"{name}: not a tensors-only .pt file (loaded with weights_only=True): {reason}"
        ) from None
    if isinstance(content, torch.Tensor):
        return content
    if isinstance(content, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content.items()
    ):
        return dict(content)
    raise FileFormatError(
        f"{name}: expected a tensor or a dict of name -> tensor; got {type(content).__name__}"
    )


_UNNAMED = "Unnamed: 0"  # what pandas calls a first column whose header cell is empty


def _read_csv(handle: BinaryIO, name: str, max_bytes: int) -> _Columns:
    check_size(file_size(handle), f"{name}: the CSV file holds", max_bytes)
    import pandas as pd  # pandas comes with seaborn; imported lazily, only for CSV

    try:
        frame = pd.read_csv(handle)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError,
            ValueError) as err:
        reason = " ".join(str(err).split())
        raise FileFormatError(f"{name}: not a readable CSV file ({reason})") from None
    if frame.shape[0] == 0:
        raise FileFormatError(f"{name}: the CSV has a header but no rows")
    if len(frame.columns) and str(frame.columns[0]) == _UNNAMED:
        frame = _without_index_column(frame, name)
    columns = _Columns()
    for column in frame.columns:
        columns[str(column).strip()] = frame[column].to_numpy()
    return columns


def _without_index_column(frame: Any, name: str) -> Any:
    """Drop a first column with an empty header that holds distinct integers: the row index
    pandas writes unless told ``index=False``. Anything else there is kept as it is."""
    values = frame.iloc[:, 0].to_numpy()
    if values.dtype.kind not in "iu" or len(np.unique(values)) != len(values):
        return frame
    if np.array_equal(values, np.arange(len(values))):
        what = f"rows numbered 0..{len(values) - 1}"
    else:
        what = "distinct integers"
    warnings.warn(
        f"{name}: ignoring the first column: it has no header name and holds {what}, the "
        "index pandas writes by default (save with DataFrame.to_csv(..., index=False) to leave "
        "it out)", CalibrationWarning, stacklevel=4,
    )
    return frame.iloc[:, 1:]


def _read_labels(path: Path, label_key: str | None, max_bytes: int) -> Any:
    table = _read_table(path, max_bytes)
    if isinstance(table, dict | _Columns):
        if label_key is None and len(table) == 1:
            return next(iter(table.values()))
        return _pick(table, path, label_key, LABEL_KEYS, "labels")
    return table
