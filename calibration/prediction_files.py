"""Reading saved predictions (.npz, .npy, .pt, .csv) without ever unpickling.

Layouts (the kind of score is always stated, never guessed from the values):

* ``.npz`` / ``.pt``: a mapping of arrays/tensors with ``probs`` (N, K) — or ``logits`` (N, K)
  when ``logits=True`` — plus ``labels`` (N,) and optionally ``client_ids`` (N,). ``.npz`` is read
  with ``allow_pickle=False``; ``.pt`` with ``torch.load(weights_only=True)`` and must hold
  tensors only (a dict of tensors, or one tensor of scores).
* ``.npy``: one (N, K) array of scores; labels then come from a separate file.
* ``.csv``: a header row; a ``label`` (or ``labels``) column, an optional ``client_id`` (or
  ``client_ids``) column, and every other column is one class score, in file order.
* a separate labels file: ``.npy`` (N,), ``.npz``/``.pt`` with ``labels`` (or a single
  array/tensor), or ``.csv`` with a ``label``/``labels`` column (or a single column).

Problems raise :class:`calibration.errors.FileFormatError` saying what was found.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from calibration.errors import FileFormatError

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
) -> Predictions:
    """Read predictions (and labels, client ids) from ``path``; see the module docstring.

    ``label_key``/``client_key`` name the entry or column to use instead of the defaults; a
    named client key must exist, the default ones are used when present.
    """
    path = Path(path)
    score_key = "logits" if logits else "probs"
    table = _read_table(path)
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
        labels = _read_labels(Path(labels_path), label_key)
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
        try:
            return np.column_stack([np.asarray(self[name], dtype=np.float64) for name in names])
        except (TypeError, ValueError):
            raise FileFormatError(f"CSV score columns {names} must be numeric") from None


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


def _read_table(path: Path) -> dict | np.ndarray | torch.Tensor:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise FileFormatError(
            f"{path.name}: unsupported file type {suffix!r}; use one of {', '.join(SUFFIXES)}"
        )
    if not path.is_file():
        raise FileFormatError(f"{path}: no such file")
    if suffix == ".npz":
        return _read_npz(path)
    if suffix == ".npy":
        return _read_npy(path)
    if suffix == ".pt":
        return _read_pt(path)
    return _read_csv(path)


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except ValueError as err:
        if "pickle" in str(err).lower() or "object arrays" in str(err).lower():
            raise FileFormatError(f"{path.name}: refusing pickled data (object arrays)") from None
        raise FileFormatError(f"{path.name}: not a readable .npz file ({err})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise FileFormatError(f"{path.name}: not a readable .npz file ({err})") from None


def _read_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err).lower() or "object arrays" in str(err).lower():
            raise FileFormatError(f"{path.name}: refusing pickled data") from None
        raise FileFormatError(f"{path.name}: not a readable .npy file ({err})") from None
    except (OSError, EOFError) as err:
        raise FileFormatError(f"{path.name}: not a readable .npy file ({err})") from None


def _read_pt(path: Path) -> dict[str, torch.Tensor] | torch.Tensor:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileFormatError(
            f"{path.name}: not a tensors-only .pt file (loaded with weights_only=True): {reason}"
        ) from None
    if isinstance(content, torch.Tensor):
        return content
    if isinstance(content, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content.items()
    ):
        return dict(content)
    raise FileFormatError(
        f"{path.name}: expected a tensor or a dict of name -> tensor; got {type(content).__name__}"
    )


def _read_csv(path: Path) -> _Columns:
    import pandas as pd  # pandas comes with seaborn; imported lazily, only for CSV

    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as err:
        raise FileFormatError(f"{path.name}: not a readable CSV file ({err})") from None
    if frame.shape[0] == 0:
        raise FileFormatError(f"{path.name}: the CSV has a header but no rows")
    columns = _Columns()
    for name in frame.columns:
        columns[str(name).strip()] = frame[name].to_numpy()
    return columns


def _read_labels(path: Path, label_key: str | None) -> Any:
    table = _read_table(path)
    if isinstance(table, dict | _Columns):
        if label_key is None and len(table) == 1:
            return next(iter(table.values()))
        return _pick(table, path, label_key, LABEL_KEYS, "labels")
    return table
