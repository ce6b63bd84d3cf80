"""The readable tables of a `ShiftReport`
(``shift_report.md``, and what ``bayesfl evaluate`` prints)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bayesfl.shifts import SEVERITY_UNITS, format_severity
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE

_SHIFT_COLUMNS = (("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE"), ("aurc", "AURC"))
_OOD_COLUMNS = (("auroc", "AUROC"), ("aupr_out", "AUPR-out"), ("aupr_in", "AUPR-in"),
                ("fpr_at_95", "FPR@95"))
_SCORE_NAMES = {"entropy": "entropy", "max_prob": "max prob",
                "mutual_information": "mutual information"}


def _number(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.4f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _pair(report: Any, table: str, field: str, **where: Any) -> str:
    """``headline / plug-in`` (or the headline alone) of ``field`` in the row ``where``."""
    values = []
    for key in _keys(report):
        found = report.rows(table, predictive=key, **where)
        values.append(_number(found[0][field]) if found else "—")
    return " / ".join(values)


def _keys(report: Any) -> list[str]:
    return [k for k in (PREDICTIVE, MAP_PLUGIN) if k in report.predictives] or \
        list(report.predictives)


def _spread(report: Any, table: str, field: str, **where: Any) -> str:
    values = [r[field] for r in report.rows(table, scope="client", predictive=PREDICTIVE,
                                            **where)
              if not r.get("novel") and r[field] is not None]
    if not values:
        return "—"
    return f"{min(values):.3f}–{max(values):.3f}"


def report_markdown(report: Any) -> str:
    """The report's tables as Markdown (see the module docstring)."""
    s = report.settings
    keys = _keys(report)
    names = " / ".join({PREDICTIVE: "headline", MAP_PLUGIN: "MAP plug-in"}.get(k, k)
                       for k in keys)
    coverage = f"{100 * s['coverage']:g}%"
    lines = [f"# Shift report: {s['strategy']} on {s['dataset']}", "",
             f"Run `{s['run_dir']}`: {s['clients']} clients ({len(s['novel_clients'])} novel), "
             f"partition `{s['partition']}`, {s['rounds']} rounds. Seed {s['seed']}, "
             f"{s['n_bins']} calibration bins, data range "
             f"[{s['data_range'][0]:.4g}, {s['data_range'][1]:.4g}]"
             + (f", images {'x'.join(map(str, s['image_shape']))}" if s["image_shape"] else "")
             + ".", "",
             f"Each cell: **{names}**. Pooled = the clients that trained, merged "
             "(exactly the figures of their concatenated rows). AURC: area under the "
             f"risk-coverage curve of the maximum probability (lower is better); acc@{coverage}: "
             f"accuracy of the {coverage} most confident rows.", ""]
    kinds = [k for k in s["shifts"]]
    if report.shift:
        lines += ["## Shifted inputs (pooled)", ""]
        for kind in kinds or [None]:
            severities = [0.0, *list(s["shifts"][kind])] if kind else [0.0]
            if kind:
                lines += [f"### {kind} ({SEVERITY_UNITS[kind]})", ""]
            else:
                lines += ["### clean test rows", ""]
            header = ["severity", *[label for _, label in _SHIFT_COLUMNS], f"acc@{coverage}",
                      "accuracy over clients (headline, min–max)"]
            rows = []
            for severity in sorted(severities):
                where = ({"shift": "none"} if severity == 0 else {"shift": kind}) | {
                    "severity": severity}
                rows.append([format_severity(severity),
                             *[_pair(report, "shift", f, scope="pooled", **where)
                               for f, _ in _SHIFT_COLUMNS],
                             _pair(report, "shift", "accuracy_at_coverage", scope="pooled",
                                   **where),
                             _spread(report, "shift", "accuracy", **where)])
            lines += [*_table(header, rows), ""]
        lines += _per_client(report, kinds)
        lines += _novel(report, kinds)
    if report.ood:
        lines += ["## Out-of-distribution detection (pooled)", "",
                  "A higher score flags a row as OOD (entropy; the negated maximum probability; "
                  "the mutual information of posterior draws, headline only). FPR@95: the "
                  "fraction of in-distribution rows flagged when 95% of the OOD rows are.", ""]
        header = ["rows", "score", *[label for _, label in _OOD_COLUMNS],
                  "AUROC over clients (headline, min–max)", "in / OOD rows"]
        rows = []
        for name in s["ood"]:
            for score in ("entropy", "max_prob", "mutual_information"):
                found = report.rows("ood", scope="pooled", ood=name, score=score)
                if not found:
                    continue
                rows.append([name, _SCORE_NAMES[score],
                             *[_pair(report, "ood", f, scope="pooled", ood=name, score=score)
                               for f, _ in _OOD_COLUMNS],
                             _spread(report, "ood", "auroc", ood=name, score=score),
                             f"{found[0]['n_in']} / {found[0]['n_ood']}"])
        lines += [*_table(header, rows), ""]
    if report.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in report.notes] + [""]
    return "\n".join(lines)


def _conditions(report: Any, kinds: Sequence[str]) -> list[tuple[str, float, str]]:
    out = [("none", 0.0, "clean")]
    for kind in kinds:
        out += [(kind, v, f"{kind} {format_severity(v)}") for v in report.settings["shifts"][kind]]
    return out


def _per_client(report: Any, kinds: Sequence[str]) -> list[str]:
    conditions = _conditions(report, kinds)
    clients = sorted({r["client"] for r in report.rows(scope="client")})
    if not clients:
        return []
    lines = ["### Accuracy per client (headline)", ""]
    rows = []
    for k in clients:
        cells = []
        for shift, severity, _ in conditions:
            found = report.rows(scope="client", client=k, shift=shift, severity=severity,
                                predictive=PREDICTIVE)
            cells.append(_number(found[0]["accuracy"]) if found else "—")
        novel = report.rows(scope="client", client=k)[0].get("novel")
        rows.append([f"{k}{' (novel)' if novel else ''}", *cells])
    return lines + _table(["client", *[c[2] for c in conditions]], rows) + [""]


def _novel(report: Any, kinds: Sequence[str]) -> list[str]:
    if not report.rows(scope="novel"):
        return []
    lines = ["### Novel clients (never trained; personalised), merged", ""]
    rows = []
    for shift, severity, label in _conditions(report, kinds):
        where = {"scope": "novel", "shift": shift, "severity": severity}
        rows.append([label, *[_pair(report, "shift", f, **where) for f, _ in _SHIFT_COLUMNS]])
    return lines + _table(["rows", *[label for _, label in _SHIFT_COLUMNS]], rows) + [""]


__all__ = ["report_markdown"]
