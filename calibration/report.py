"""Per-client calibration report with pooled (micro) and macro rows.

* a row per client, scored on that client's samples only;
* ``pooled (micro)``: all samples scored together, i.e. the merge of the client accumulators;
* ``macro (mean over clients)``: the unweighted mean of the client rows' metrics;
* ``sd over clients``: their standard deviation (ddof = 1; 0 for one client), how unevenly the
  model serves its clients; the JSON also has each metric's range over clients.

Without client ids there is a single ``all`` row (the pooled row) and no macro or sd row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from calibration.accumulator import Accumulator
from calibration.bin_stats import BinStats
from calibration.binning import MAX_BIN_CELLS, Binning, check_n_bins
from calibration.client_ids import client_id_array
from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, score_matrix
from calibration.metrics import evaluate, evaluate_with_bins
from calibration.row_scores import row_scores

POOLED = "pooled (micro)"
MACRO = "macro (mean over clients)"
SPREAD = "sd over clients"
ALL = "all"
if TYPE_CHECKING:
    from matplotlib.figure import Figure

_COLUMNS = ("count", "accuracy", "ece", "mce", "brier", "nll")


@dataclass(frozen=True)
class ReportRow:
    """Metrics of one group of samples. ``kind`` is "client", "pooled", "macro" or "spread"."""

    name: str
    kind: str
    count: int
    accuracy: float
    ece: float
    mce: float
    brier: float
    nll: float

    @classmethod
    def from_metrics(cls, name: str, kind: str, metrics: Mapping[str, float]) -> ReportRow:
        return cls(name, kind, int(metrics["count"]),
                   *(float(metrics[key]) for key in _COLUMNS[1:]))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind,
                **{key: getattr(self, key) for key in _COLUMNS}}


@dataclass(frozen=True, eq=False)
class CalibrationReport:
    """Client rows, the pooled row, the macro and sd rows (None without clients), and the
    pooled table."""

    clients: tuple[ReportRow, ...]
    pooled: ReportRow
    macro: ReportRow | None
    pooled_bins: BinStats = field(repr=False)
    n_bins: int = 15
    binning: str = "uniform"

    @property
    def spread(self) -> ReportRow | None:
        """Standard deviation of each metric over the client rows (None without clients)."""
        return _spread(self.clients) if self.clients else None

    @property
    def rows(self) -> tuple[ReportRow, ...]:
        """Client rows, then pooled, then macro and sd (when there are clients)."""
        summary = (self.macro, self.spread) if self.clients else ()
        return (*self.clients, self.pooled, *summary)

    @classmethod
    def from_accumulators(cls, accumulators: Mapping[Any, Accumulator]) -> CalibrationReport:
        """Report from per-client accumulators (client id -> Accumulator); pooled = their merge."""
        if not isinstance(accumulators, Mapping) or not accumulators:
            raise InvalidInputError("no client accumulators to report on: pass a non-empty "
                                    "mapping of client id -> Accumulator")
        client_id_array(list(accumulators), len(accumulators))  # one kind, none missing
        strangers = [k for k, v in accumulators.items() if not isinstance(v, Accumulator)]
        if strangers:
            raise InvalidInputError(
                f"client {strangers[0]!r}: expected an Accumulator, got "
                f"{type(accumulators[strangers[0]]).__name__}"
            )
        names = _client_names(list(accumulators))
        clients = []
        for client_id in _sorted_ids(accumulators):
            accumulator = accumulators[client_id]
            if accumulator.count == 0:
                raise InvalidInputError(f"client {names[client_id]!r} has no samples")
            clients.append(ReportRow.from_metrics(names[client_id], "client",
                                                  accumulator.compute()))
        merged = Accumulator.merged(accumulators.values())
        pooled = ReportRow.from_metrics(POOLED, "pooled", merged.compute())
        return cls(tuple(clients), pooled, _macro(clients), merged.bin_stats(), merged.n_bins)

    # -- renderings ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "n_bins": self.n_bins,
            "binning": self.binning,
            "clients": [row.to_dict() for row in self.clients],
            "pooled": self.pooled.to_dict(),
            "macro": self.macro.to_dict() if self.macro else None,
            "spread": self.spread.to_dict() if self.clients else None,
            "client_range": {
                key: [min(getattr(row, key) for row in self.clients),
                      max(getattr(row, key) for row in self.clients)]
                for key in _COLUMNS
            } if self.clients else None,
            "pooled_bins": {
                "edges": self.pooled_bins.edges.tolist(),
                "counts": self.pooled_bins.counts.tolist(),
                "mean_confidence": _nan_to_none(self.pooled_bins.mean_confidence),
                "accuracy": _nan_to_none(self.pooled_bins.accuracy),
            },
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        header = "| group | N | accuracy | ECE | MCE | Brier | NLL |"
        lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
        for row in self.rows:
            cells = _formatted(row)
            name = f"**{row.name}**" if row.kind != "client" else row.name
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        headers = ("group", "N", "accuracy", "ECE", "MCE", "Brier", "NLL")
        body = [(row.name, *_formatted(row)) for row in self.rows]
        widths = [max(len(str(r[i])) for r in (headers, *body)) for i in range(len(headers))]

        def line(cells: tuple[str, ...]) -> str:
            first = cells[0].ljust(widths[0])
            rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
            return "  ".join([first, *rest])

        rule = "-" * len(line(headers))
        out = [f"Calibration report ({self.n_bins} {self.binning} bins; ECE/MCE top-label)",
               line(headers), rule]
        for row, cells in zip(self.rows, body, strict=True):
            if row.kind == "pooled" and self.clients:
                out.append(rule)
            out.append(line(cells))
        return "\n".join(out)

    def plot(self, path: str | Path | None = None, title: str | None = None) -> Figure:
        """Reliability diagram of the pooled samples; saved to ``path`` (.png/.svg/.pdf) if set."""
        # Plotting (matplotlib, seaborn) is imported only when a diagram is asked for.
        from calibration.diagram import reliability_diagram, save_figure

        figure = reliability_diagram(self.pooled_bins, title=title or "Reliability diagram "
                                     f"({self.pooled.name}, {self.n_bins} {self.binning} bins)")
        if path is not None:
            save_figure(figure, path)
        return figure


def report(
    probs: Any,
    labels: Any,
    client_ids: Any = None,
    n_bins: int = 15,
    binning: Binning | str = "uniform",
    from_logits: bool = False,
) -> CalibrationReport:
    """Calibration report of ``probs`` (N, K) against ``labels`` (N,), per client if given.

    ``client_ids`` (N,) holds one id per sample, all integers or all strings (see
    `calibration.client_ids`). With uniform bins the pooled row is the merge of per-client
    accumulators; with quantile bins every group gets its own equal-mass edges (computed from its
    samples). Invalid rows are reported with their count and position in the whole input.
    """
    binning = Binning.parse(binning)
    n_bins = check_n_bins(n_bins)
    kind = "logits" if from_logits else "probs"
    given = as_tensor(probs, kind)  # kept in its dtype: the row-sum tolerance depends on it
    scores = score_matrix(given, kind)
    if client_ids is None:
        metrics, stats = evaluate_with_bins(given, labels, n_bins, binning, from_logits)
        pooled = ReportRow.from_metrics(ALL, "pooled", metrics)
        return CalibrationReport((), pooled, None, stats, n_bins, binning.value)

    groups = _group_rows(client_ids, scores.shape[0])
    if len(groups) * n_bins > MAX_BIN_CELLS:
        raise InvalidInputError(
            f"{len(groups):,} clients x {n_bins:,} bins = {len(groups) * n_bins:,} cells exceeds "
            f"the limit of {MAX_BIN_CELLS:,} (MAX_BIN_CELLS); use fewer bins"
        )
    label_tensor = as_tensor(labels, "labels")
    if label_tensor.ndim != 1 or label_tensor.shape[0] != scores.shape[0]:
        raise InvalidInputError(
            f"shape mismatch: {scores.shape[0]} rows of scores but labels of shape "
            f"{tuple(label_tensor.shape)}"
        )
    label_tensor = label_tensor.to(given.device)
    try:
        clients = _client_rows(given, label_tensor, groups, n_bins, binning, from_logits)
    except InvalidInputError as client_error:
        # A client's rows are numbered and counted within that client: re-examine the whole
        # input so that the message gives the count and the first row of all of it.
        row_scores(given, label_tensor, from_logits=from_logits, confidence=False)
        raise client_error
    if binning is Binning.UNIFORM:
        return CalibrationReport.from_accumulators(clients)
    names = _client_names(list(clients))
    rows = [ReportRow.from_metrics(names[client], "client", clients[client])
            for client in _sorted_ids(clients)]
    metrics, stats = evaluate_with_bins(given, label_tensor, n_bins, binning, from_logits)
    pooled = ReportRow.from_metrics(POOLED, "pooled", metrics)
    return CalibrationReport(tuple(rows), pooled, _macro(rows), stats, n_bins, binning.value)


def _client_rows(
    scores: torch.Tensor, labels: torch.Tensor, groups: dict[Any, np.ndarray], n_bins: int,
    binning: Binning, from_logits: bool,
) -> dict[Any, Any]:
    """Per client: an Accumulator (uniform bins) or its metrics dict (quantile bins)."""
    out = {}
    for client_id, rows in groups.items():
        index = torch.as_tensor(rows, device=scores.device)
        try:
            if binning is Binning.UNIFORM:
                out[client_id] = Accumulator(n_bins).update(scores[index], labels[index],
                                                            from_logits=from_logits)
            else:
                out[client_id] = evaluate(scores[index], labels[index], n_bins, binning,
                                          from_logits)
        except InvalidInputError as error:
            raise InvalidInputError(f"client {client_id!r}: {error}") from None
    return out


def _group_rows(client_ids: Any, n_samples: int) -> dict[Any, np.ndarray]:
    """Map each distinct client id to the row indices (int64) holding it."""
    ids = client_id_array(client_ids, n_samples)
    distinct, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    splits = np.split(order, np.cumsum(np.bincount(inverse))[:-1])
    return {_plain(value): rows for value, rows in zip(distinct, splits, strict=True)}


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _sorted_ids(client_ids: Any) -> list[Any]:
    """Ids in natural order (numeric ids numerically), falling back to their text."""
    try:
        return sorted(client_ids)
    except TypeError:
        return sorted(client_ids, key=str)


def _client_names(client_ids: list[Any]) -> dict[Any, str]:
    names = {client_id: str(client_id) for client_id in client_ids}
    if len(set(names.values())) != len(names):
        raise InvalidInputError("client ids must stay distinct when written as text")
    reserved = {POOLED, MACRO, SPREAD, ALL} & set(names.values())
    if reserved:
        raise InvalidInputError(f"client id {reserved.pop()!r} is reserved for a summary row")
    return names


def _macro(clients: list[ReportRow]) -> ReportRow:
    means = {key: float(np.mean([getattr(row, key) for row in clients])) for key in _COLUMNS[1:]}
    means["count"] = sum(row.count for row in clients)
    return ReportRow.from_metrics(MACRO, "macro", means)


def _spread(clients: tuple[ReportRow, ...]) -> ReportRow:
    ddof = 1 if len(clients) > 1 else 0
    spreads = {key: float(np.std([getattr(row, key) for row in clients], ddof=ddof))
               for key in _COLUMNS[1:]}
    spreads["count"] = sum(row.count for row in clients)
    return ReportRow.from_metrics(SPREAD, "spread", spreads)


def _formatted(row: ReportRow) -> tuple[str, ...]:
    return (f"{row.count:,}", f"{row.accuracy:.4f}", f"{row.ece:.4f}", f"{row.mce:.4f}",
            f"{row.brier:.4f}", f"{row.nll:.4f}")


def _nan_to_none(values: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in values]
