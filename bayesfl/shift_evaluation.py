"""Shift suites on a finished run: shifted inputs, rows off the training distribution, and
selective prediction, per client and pooled: `evaluate_shift` -> `ShiftReport`.

What is measured (every figure for the headline predictive and, for posterior strategies, the
MAP plug-in beside it):

* **Shifted inputs** (`bayesfl.shifts`): each client's own test rows under each shift at
  each severity (severity 0, the clean rows, is always included): accuracy, NLL, ECE, Brier,
  and selective prediction by the maximum probability: AURC and the accuracy at a coverage
  (default 80%).
* **Out-of-distribution rows** (``ood``), scored by predictive entropy, maximum probability
  and, where the strategy has a posterior to draw from, mutual information of the posterior
  draws: AUROC, AUPR (OOD rows positive, and in-distribution rows positive) and FPR at 95% TPR.
  ``"unseen-labels"``: for client k, the in-distribution rows are its test rows whose label
  it trained on; the OOD rows are the test rows of every client (pooled) whose label is absent
  from k's training labels. ``"novel-clients"``: the OOD rows are the novel clients' test rows
  (runs with ``novel_fraction``), the in-distribution rows client k's own test rows. A client
  with no OOD rows (it trained on every label) is left out, and said so in ``notes``.

**Federated by construction.** Each client's part is `client_shift_states`: mergeable
states only (`calibration.Accumulator` for accuracy/NLL/ECE/Brier; for selective
prediction and OOD detection the exact `calibration.AurocAccumulator`, a count of rows
per distinct score). The pooled figures are the merge of the clients' states: exactly those
of the concatenated rows (the selective table keys rows by their confidence and counts the
errors among them, so the pooled risk-coverage curve, AURC and accuracy at a coverage are
the concatenated rows' too). Pooled is over the clients that trained; the novel clients'
merge is reported apart (``scope="novel"``).

The data: a run directory does not keep them, so they are rebuilt from the run's configuration
exactly as the run built them (`bayesfl.engine.setup.run_setup`), and checked against
the digest the run recorded (``summary["data"]["sha256"]``). A run on your own data
(``simulate(data=...)``) needs them again: ``evaluate_shift(run, data=(x, y))``.

Randomness: the noise draws come from ``seed`` (per client, the same draws at every severity),
the posterior draws of the mutual information from ``seed`` too; the same run, settings and
seed give the same report.

What can be evaluated: a run (what `bayesfl.load_run` or `bayesfl.simulate` return), or any
`ShiftSubject`: an object that rebuilds to a run's clients and predicts for each of them, such
as a federated deep ensemble (`bayesfl.ensemble.DeepEnsemble`: its headline is the members'
mean predictive, it has no plug-in row, and its mutual information takes each member as one
posterior draw).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from bayesfl.errors import BayesFLError, ConfigError, DataError
from bayesfl.shifts import (
    SEVERITY_UNITS,
    Shift,
    apply_shift,
    as_shifts,
    data_range,
    format_severity,
    image_shape_of,
)
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE, derived_seed
from calibration import Accumulator, AurocAccumulator, accuracy_at_coverage, aurc, ood_scores
from calibration import risk_coverage as risk_coverage_curve
from calibration.errors import CalibrationError

OOD_KINDS = ("unseen-labels", "novel-clients")
"""The out-of-distribution row sets `evaluate_shift` knows (module notes)."""

SCORES = ("entropy", "max_prob", "mutual_information")
"""OOD scores (higher = more likely OOD; ``max_prob`` is negated): see
`calibration.ood_scores`. ``mutual_information`` needs posterior draws."""

CLEAN = "none"
"""The shift name of the clean rows (severity 0)."""

PREDICTIVE_NAMES = {PREDICTIVE: "headline", MAP_PLUGIN: "plug-in"}
"""How the tables and plots name each predictive."""

_NOISE_KEY = 0x5A1F  # derived-seed words of the noise draws and the posterior draws
_DRAWS_KEY = 0x5A20


@dataclass
class ClientShiftStates:
    """One client's part of a shift report: mergeable states only (no rows, no predictions).

    Attributes:
        client_id: the client.
        calibration: ``(shift, severity, predictive)`` -> `calibration.Accumulator`.
        selective: ``(shift, severity, predictive)`` -> exact
            `calibration.AurocAccumulator` whose "scores" are the negated confidences
            and whose "OOD" rows are the errors (the rows per distinct confidence: everything
            risk-coverage needs).
        detection: ``(ood, predictive, score)`` -> exact `calibration.AurocAccumulator`.
    """

    client_id: int
    calibration: dict[tuple[str, float, str], Accumulator] = field(default_factory=dict)
    selective: dict[tuple[str, float, str], AurocAccumulator] = field(default_factory=dict)
    detection: dict[tuple[str, str, str], AurocAccumulator] = field(default_factory=dict)


def selective_state(probs: Tensor, labels: Tensor) -> AurocAccumulator:
    """The selective table of ``probs`` (N, C) and ``labels`` (N,): rows per distinct maximum
    probability, errors counted apart (see `ClientShiftStates`)."""
    confidence, predicted = probs.max(dim=1)
    wrong = predicted.cpu() != labels.cpu()
    return AurocAccumulator().update(confidence.cpu(), wrong, higher_is_ood=False)


def selective_rows(state: AurocAccumulator) -> tuple[Tensor, Tensor]:
    """(confidence (N,), correct (N,)) rebuilt from a selective table: one row per counted row,
    the same multiset of rows as the ones that made it (order aside, which no selective metric
    depends on)."""
    table = state.state_dict()
    confidence = -table["values"]
    correct = torch.cat([torch.ones(int(table["in_counts"].sum()), dtype=torch.bool),
                         torch.zeros(int(table["ood_counts"].sum()), dtype=torch.bool)])
    values = torch.cat([confidence.repeat_interleave(table["in_counts"]),
                        confidence.repeat_interleave(table["ood_counts"])])
    return values + 0.0, correct


def client_shift_states(
    predict: Any,
    x: Tensor,
    y: Tensor,
    *,
    shifts: Sequence[Shift],
    image_shape: tuple[int, int, int] | None,
    value_range: tuple[float, float],
    n_bins: int,
    noise_generator: torch.Generator | None = None,
    ood_rows: Mapping[str, tuple[Tensor, Tensor]] | None = None,
    draws: Any = None,
    client_id: int = 0,
) -> ClientShiftStates:
    """One client's states (federated: run where its model and data are).

    Args:
        predict: ``predict(x) -> {predictive: probs (B, C)}`` (a strategy's ``predict`` of this
            client's state).
        x, y: the client's test rows.
        shifts: the input shifts; the clean rows are always evaluated.
        image_shape, value_range: as `bayesfl.shifts.apply_shift` takes them.
        n_bins: the calibration bins.
        noise_generator: draws the noise once (the same draws at every severity).
        ood_rows: ood name -> (in-distribution rows, OOD rows) of this client.
        draws: ``draws(x) -> (S, B, C)`` posterior draws of probabilities, or None (no mutual
            information).
        client_id: the client's id (recorded).
    """
    states = ClientShiftStates(client_id)
    eps = None
    if any(s.kind == "noise" for s in shifts) and x.shape[0]:
        eps = torch.randn(x.shape, generator=noise_generator, dtype=torch.float64)
    conditions = [(CLEAN, 0.0)] + [(s.kind, v) for s in shifts for v in s.severities]
    for kind, severity in conditions:
        if x.shape[0] == 0:
            break
        shifted = x if kind == CLEAN else apply_shift(
            kind, severity, x, image_shape=image_shape, data_range=value_range, eps=eps)
        for key, probs in predict(shifted).items():
            probs = probs.detach().to("cpu", torch.float64)
            states.calibration[(kind, severity, key)] = Accumulator(n_bins).update(probs, y.cpu())
            states.selective[(kind, severity, key)] = selective_state(probs, y)
    for name, (inside, outside) in (ood_rows or {}).items():
        if inside.shape[0] == 0 or outside.shape[0] == 0:
            continue
        rows = torch.cat([inside, outside])
        is_ood = torch.cat([torch.zeros(inside.shape[0], dtype=torch.bool),
                            torch.ones(outside.shape[0], dtype=torch.bool)])
        for key, probs in predict(rows).items():
            probs = probs.detach().to("cpu", torch.float64)
            for score in ("entropy", "max_prob"):
                states.detection[(name, key, score)] = AurocAccumulator().update(
                    ood_scores(probs, kind=score), is_ood)
        if draws is not None:
            samples = draws(rows).detach().to("cpu", torch.float64)
            states.detection[(name, PREDICTIVE, "mutual_information")] = \
                AurocAccumulator().update(ood_scores(samples, kind="mutual_information"), is_ood)
    return states


# ==== the report ==============================================================================
@dataclass
class ShiftReport:
    """What `evaluate_shift` returns: flat rows of figures, ready for tables and plots.

    Attributes:
        settings: what was evaluated (run directory, strategy, shifts, ood, seed, bins,
            coverage, image shape, data range, posterior draws).
        predictives: the predictives evaluated (``"predictive"``: the headline; ``"map_plugin"``
            beside it for posterior strategies).
        shift: one dict per (scope, client, shift, severity, predictive): ``scope``
            (``"client"``, ``"pooled"``: the clients that trained, merged; ``"novel"``: the
            novel clients merged), ``client`` (None when merged), ``shift`` (``"none"`` for the
            clean rows), ``severity``, ``predictive``, ``count``, ``accuracy``, ``nll``,
            ``ece``, ``brier``, ``aurc``, ``accuracy_at_coverage``.
        ood: one dict per (scope, client, ood, predictive, score): ``auroc``, ``aupr_out``,
            ``aupr_in``, ``fpr_at_95``, ``n_in``, ``n_ood``.
        curves: ``(shift, severity, predictive)`` -> pooled (coverage, risk) arrays (plots; not
            in the JSON).
        notes: what could not be evaluated, and why.
        states: the clients' mergeable states the figures are computed from (not in the
            JSON; `bayesfl.shift_protocol` stores them beside the report of a run).
    """

    settings: dict[str, Any]
    predictives: list[str]
    shift: list[dict[str, Any]]
    ood: list[dict[str, Any]]
    curves: dict[tuple[str, float, str], tuple[np.ndarray, np.ndarray]] = field(repr=False,
                                                                            default_factory=dict)
    notes: list[str] = field(default_factory=list)
    states: list[ClientShiftStates] = field(repr=False, default_factory=list)

    def rows(self, table: str = "shift", **where: Any) -> list[dict[str, Any]]:
        """The rows of ``table`` (``"shift"`` or ``"ood"``) whose fields equal ``where``, e.g.
        ``report.rows(scope="pooled", shift="rotate", predictive="predictive")``."""
        return [r for r in getattr(self, table) if all(r.get(k) == v for k, v in where.items())]

    def to_dict(self) -> dict[str, Any]:
        """Everything but the curves, JSON-ready (``shift_report.json``)."""
        return {"settings": self.settings, "predictives": self.predictives,
                "shift": self.shift, "ood": self.ood, "notes": self.notes}

    def to_json(self, path: str | Path | None = None) -> str:
        """The JSON text of `to_dict`, also written to ``path`` when given."""
        text = json.dumps(_finite(self.to_dict()), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_markdown(self) -> str:
        """Readable tables (``shift_report.md``): pooled figures, headline and plug-in side by
        side, with the spread over clients."""
        from bayesfl.shift_tables import report_markdown

        return report_markdown(self)

    def plot(self, out_dir: str | Path) -> list[Path]:
        """``shift_metrics.png`` (accuracy, NLL, ECE against severity) and
        ``risk_coverage.png`` in ``out_dir``; returns their paths."""
        from bayesfl.shift_plots import plot_shift_report

        return plot_shift_report(self, _directory(out_dir))

    def write(self, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
        """``shift_report.json``, ``shift_report.md`` and (``plots``) the plots into
        ``out_dir`` (created); returns the paths written."""
        out = _directory(out_dir)
        paths = [out / "shift_report.json", out / "shift_report.md"]
        self.to_json(paths[0])
        paths[1].write_text(self.to_markdown())
        if plots:
            paths += self.plot(out)
        return paths


def _directory(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out}: {err.strerror or err}; choose another "
                          "output directory (--out)") from err
    return out


def _finite(value: Any) -> Any:
    """NaN and inf as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _calibration_row(accumulator: Accumulator, selective: AurocAccumulator,
                     coverage: float) -> dict[str, Any]:
    metrics = accumulator.compute()
    confidence, correct = selective_rows(selective)
    return {"count": int(metrics["count"]), "accuracy": metrics["accuracy"],
            "nll": metrics["nll"], "ece": metrics["ece"], "brier": metrics["brier"],
            "aurc": aurc(confidence, correct),
            "accuracy_at_coverage": accuracy_at_coverage(confidence, correct, coverage)}


def _detection_row(state: AurocAccumulator) -> dict[str, Any]:
    figures = state.compute(0.95)
    return {"auroc": figures["auroc"], "aupr_out": figures["aupr_out"],
            "aupr_in": figures["aupr_in"], "fpr_at_95": figures["fpr_at_tpr"],
            "n_in": int(figures["n_in"]), "n_ood": int(figures["n_ood"])}


def build_report(states: Sequence[ClientShiftStates], *, novel: Sequence[int] = (),
                 settings: Mapping[str, Any], coverage: float = 0.8,
                 notes: Sequence[str] = ()) -> ShiftReport:
    """The report of the clients' ``states``: each client's figures, and their merges (the
    clients that trained: ``"pooled"``; the ``novel`` ones: ``"novel"``)."""
    novel_ids = set(int(k) for k in novel)
    shift_rows: list[dict[str, Any]] = []
    ood_rows: list[dict[str, Any]] = []
    curves: dict[tuple[str, float, str], tuple[np.ndarray, np.ndarray]] = {}
    predictives: list[str] = []
    for state in states:
        for key in state.calibration:
            if key[2] not in predictives:
                predictives.append(key[2])
    groups = [("pooled", [s for s in states if s.client_id not in novel_ids]),
              ("novel", [s for s in states if s.client_id in novel_ids])]
    conditions = list(dict.fromkeys(k for s in states for k in s.calibration))
    for state in states:
        for key in conditions:
            if key in state.calibration:
                shift_rows.append({"scope": "client", "client": state.client_id,
                                   "novel": state.client_id in novel_ids, **_condition(key),
                                   **_calibration_row(state.calibration[key],
                                                      state.selective[key], coverage)})
    for scope, members in groups:
        for key in conditions:
            held = [s for s in members if key in s.calibration]
            if not held:
                continue
            selective = AurocAccumulator.merged(s.selective[key] for s in held)
            shift_rows.append({"scope": scope, "client": None, **_condition(key),
                               **_calibration_row(Accumulator.merged(s.calibration[key]
                                                                     for s in held),
                                                  selective, coverage)})
            if scope == "pooled":
                confidence, correct = selective_rows(selective)
                curves[key] = risk_coverage_curve(confidence, correct)
    detections = list(dict.fromkeys(k for s in states for k in s.detection))
    for state in states:
        for key in detections:
            if key in state.detection:
                ood_rows.append({"scope": "client", "client": state.client_id,
                                 "ood": key[0], "predictive": key[1], "score": key[2],
                                 **_detection_row(state.detection[key])})
    for key in detections:
        held = [s.detection[key] for s in states if key in s.detection
                and s.client_id not in novel_ids]
        if held:
            ood_rows.append({"scope": "pooled", "client": None, "ood": key[0],
                             "predictive": key[1], "score": key[2],
                             **_detection_row(AurocAccumulator.merged(held))})
    return ShiftReport(dict(settings), predictives, shift_rows, ood_rows, curves, list(notes),
                       list(states))


def _condition(key: tuple[str, float, str]) -> dict[str, Any]:
    return {"shift": key[0], "severity": key[1], "predictive": key[2]}


# ==== what is evaluated =======================================================================
Predictor = Callable[[Tensor], dict[str, Tensor]]
"""``predict(x) -> {predictive: probs (B, C)}``: one client's predictives of its rows ``x``."""

Draws = Callable[[Tensor], Tensor]
"""``draws(x) -> (S, B, C)``: probabilities of ``x`` under S posterior draws of one client."""


@runtime_checkable
class ShiftSubject(Protocol):
    """What `evaluate_shift` evaluates: the clients of one run's data and a predictor each.

    A run (`bayesfl.load_run`, `bayesfl.simulate`) is wrapped as one (`RunSubject`); a
    `bayesfl.ensemble.DeepEnsemble` is one itself.

    Attributes:
        config: the `~bayesfl.config.SimulationConfig` the clients' data are rebuilt from
            (`bayesfl.engine.setup.run_setup`), and whose ``n_bins`` is the default.
        summary: a mapping whose ``"data"`` entry is the data's identity the run recorded
            (checked against the rebuilt data).
        run_dir: a directory named in the report's settings, or None.
        novel: the ids of the novel clients.
        num_clients: how many clients (the data must give as many).
        label: what the report's settings call the predictor (e.g. the strategy's name).
    """

    config: Any
    summary: Mapping[str, Any]
    run_dir: Any
    novel: tuple[int, ...]

    @property
    def num_clients(self) -> int: ...

    @property
    def label(self) -> str: ...

    def shift_predictor(self, k: int) -> Predictor:
        """Client ``k``'s predictives (`Predictor`)."""
        ...

    def shift_draws(self, k: int, n: int, seed: int, note: list[str]) -> Draws | None:
        """Client ``k``'s posterior draws of probabilities (`Draws`; ``n`` asked, a subject
        with a fixed number of draws gives those), or None with the reason appended to
        ``note``."""
        ...

    def shift_settings(self) -> dict[str, Any]:
        """Entries added to the report's settings (e.g. the ensemble's members)."""
        ...


class RunSubject:
    """A run (`bayesfl.simulate`'s result or `bayesfl.load_run`'s) as a `ShiftSubject`: each
    client predicts with the strategy's ``predict`` of its final state (the headline and, for
    posterior strategies, the plug-in beside it); draws come from its posterior."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.config = run.config
        self.summary = run.summary
        self.run_dir = run.run_dir
        self.novel = tuple(int(k) for k in getattr(run, "novel", ()))
        strategy = run.strategy
        self.device = getattr(getattr(strategy, "context", None), "device", None) \
            or torch.device("cpu")

    @property
    def num_clients(self) -> int:
        return len(self.run.clients)

    @property
    def label(self) -> str:
        return self.run.config.strategy

    def shift_predictor(self, k: int) -> Predictor:
        run, device = self.run, self.device
        config, state = run.clients[k].config, run.client_state(k)
        strategy, broadcast = run.strategy, run.evaluation_broadcast

        def predict(x: Tensor) -> dict[str, Tensor]:
            with torch.no_grad():
                return strategy.predict(config, state, broadcast, x.to(device))

        return predict

    def shift_draws(self, k: int, n: int, seed: int, note: list[str]) -> Draws | None:
        run = self.run
        return posterior_draws(run.strategy, run.clients[k].config, run.client_state(k),
                                run.evaluation_broadcast, self.device, n, seed, note)

    def shift_settings(self) -> dict[str, Any]:
        return {}


def as_shift_subject(run: Any) -> ShiftSubject:
    """``run`` as a `ShiftSubject`: a run wrapped (`RunSubject`), a subject as it is.

    Raises:
        ConfigError: neither a run nor a subject.
    """
    if isinstance(run, ShiftSubject):
        return run
    # a run, by what RunSubject uses of it (no import of bayesfl.simulate: the simulator
    # imports this module for a run's own shift step)
    if all(hasattr(run, name) for name in ("config", "summary", "clients", "strategy",
                                           "client_state", "evaluation_broadcast")):
        return RunSubject(run)
    raise ConfigError(f"evaluate_shift takes a run: bayesfl.load_run(DIR) (or what "
                      f"bayesfl.simulate returned), or a bayesfl.ensemble.DeepEnsemble of runs; "
                      f"got {type(run).__name__}")


# ==== on a run ================================================================================
def evaluate_shift(
    run: Any,
    shifts: Any = (),
    ood: Sequence[str] | str = (),
    *,
    seed: int = 0,
    coverage: float = 0.8,
    posterior_samples: int = 32,
    image_shape: Sequence[int] | None = None,
    n_bins: int | None = None,
    data: Any = None,
    progress: bool = True,
) -> ShiftReport:
    """Shift suites on a finished run (module notes).

    Args:
        run: what `bayesfl.load_run` returns (or `bayesfl.simulate` returned), or a
            `bayesfl.ensemble.DeepEnsemble` of runs (any `ShiftSubject`).
        shifts: input shifts: ``[("rotate", [15, 30, 60, 90]), ("noise", [0.1, 0.2])]``,
            ``"contrast:0.5,0.8"`` strings or a mapping kind -> severities
            (`bayesfl.shifts`: ``rotate`` in degrees, ``noise`` sigma in units of the data's
            range, ``contrast`` the fraction removed in [0, 1]).
        ood: out-of-distribution row sets: ``"unseen-labels"``, ``"novel-clients"``.
        seed: seeds the noise and the posterior draws.
        coverage: the coverage of ``accuracy_at_coverage``, in (0, 1].
        posterior_samples: posterior draws for the mutual information (posterior strategies);
            0: no mutual information. An ensemble's draws are its members, whatever the
            number (> 0) asked.
        image_shape: (C, H, W) of flat image rows whose data set is not known to hold images
            (rotate and contrast need images; the flat ``digits`` rows are 8x8 already).
        n_bins: calibration bins (default: the run's).
        data: the run's own data (``(x, y)`` or a ``Dataset``) for a run on custom data.
        progress: show a progress bar over the clients.

    Returns:
        A `ShiftReport`.

    Raises:
        ConfigError: an unknown shift or OOD set, a bad severity, rotate/contrast on data that
            are not images, OOD rows the run does not have (no client misses a label, no novel
            clients), bad settings; the message says what to do.
        DataError: data that are not the run's.
    """
    from tqdm.auto import tqdm

    run = as_shift_subject(run)
    shift_list = as_shifts(shifts)
    ood_list = ood_kinds(ood)
    if not shift_list and not ood_list:
        raise ConfigError("nothing to evaluate: give shifts (e.g. [('rotate', [15, 30])], "
                          "--shift rotate:15,30) or ood sets ('unseen-labels', --ood "
                          "unseen-labels)")
    seed = _integer(seed, "seed", 0)
    posterior_samples = _integer(posterior_samples, "posterior_samples", 0)
    if isinstance(coverage, bool) or not isinstance(coverage, numbers.Real) \
            or not 0.0 < float(coverage) <= 1.0:
        raise ConfigError(f"coverage must be a number in (0, 1] (e.g. 0.8); got {coverage!r}")
    coverage = float(coverage)
    n_bins = run.config.n_bins if n_bins is None else _integer(n_bins, "n_bins", 1)
    dataset, client_data = _run_data(run, data)
    shape = image_shape_of(dataset.input_shape, dataset.name if data is None else None,
                           image_shape)
    check_image_shifts(shift_list, shape, dataset)
    value_range = data_range(dataset.x)
    novel = tuple(int(k) for k in run.novel)
    ood_sets, notes = ood_row_sets(client_data, novel, ood_list)
    draws_note: list[str] = []
    states = []
    bar = tqdm(total=len(client_data), desc="shift evaluation", unit="client",
               disable=not progress)
    try:
        for k, own in enumerate(client_data):
            rows = {name: sets[k] for name, sets in ood_sets.items() if k in sets}
            states.append(shift_client_step(
                k, own.test_x, own.test_y, rows, predict=run.shift_predictor(k),
                draws=run.shift_draws, shifts=shift_list, image_shape=shape,
                value_range=value_range, n_bins=n_bins, seed=seed,
                posterior_samples=posterior_samples, note=draws_note))
            bar.update(1)
    except CalibrationError as err:
        raise DataError(f"the run's predictions could not be scored: {err}") from err
    finally:
        bar.close()
    notes += draws_note
    settings = {
        "run_dir": None if run.run_dir is None else str(run.run_dir),
        "strategy": run.label, "dataset": dataset.name,
        "clients": len(client_data), "novel_clients": list(novel),
        "partition": run.config.partition, "rounds": run.config.rounds,
        "shifts": {s.kind: list(s.severities) for s in shift_list},
        "severity_units": {s.kind: SEVERITY_UNITS[s.kind] for s in shift_list},
        "ood": list(ood_list), "seed": seed, "n_bins": n_bins, "coverage": coverage,
        "posterior_samples": posterior_samples,
        "image_shape": None if shape is None else list(shape),
        "data_range": list(value_range),
        "predictive_names": dict(PREDICTIVE_NAMES),
        **run.shift_settings(),
    }
    return build_report(states, novel=novel, settings=settings, coverage=coverage, notes=notes)


def check_image_shifts(shifts: Sequence[Shift], shape: tuple[int, int, int] | None,
                       dataset: Any) -> None:
    """Refuse rotate/contrast on data not known to be images (``shape`` None).

    Raises:
        ConfigError: naming the shift and the data, saying what to do.
    """
    for shift in shifts:
        if shift.kind in ("rotate", "contrast") and shape is None:
            raise ConfigError(
                f"shift {shift.kind!r} needs images, and the run's data ({dataset.name!r}, "
                f"inputs of shape {tuple(dataset.input_shape)}) are not known to be images; "
                "for flat image rows give their shape (image_shape=(1, 28, 28), --image-shape "
                "1,28,28), else use the noise shift, which works on any data")


def ood_row_sets(client_data: Sequence[Any], novel: Sequence[int], ood: Sequence[str]
                 ) -> tuple[dict[str, dict[int, tuple[Tensor, Tensor]]], list[str]]:
    """The out-of-distribution row sets of every client that trained: ``name -> {client ->
    (in-distribution rows, OOD rows)}`` (module notes), and the notes on the clients left
    out (a client that trained on every label has no unseen-label rows).

    Raises:
        ConfigError: no client has unseen-label rows, or ``novel-clients`` without novel
            clients; the message says what to do.
    """
    novel = tuple(int(k) for k in novel)
    trained = [k for k in range(len(client_data)) if k not in novel]
    notes: list[str] = []
    ood_sets: dict[str, dict[int, tuple[Tensor, Tensor]]] = {name: {} for name in ood}
    if "unseen-labels" in ood_sets:
        for k in trained:
            inside, outside = unseen_label_rows(client_data, k)
            if outside.shape[0] == 0:
                notes.append(f"unseen-labels: client {k} trained on every label: no OOD rows")
                continue
            ood_sets["unseen-labels"][k] = (inside, outside)
        if not ood_sets["unseen-labels"]:
            raise ConfigError("unseen-labels: every client trained on every label, so there "
                              "are no rows of an unseen label; use a run whose partition leaves "
                              "labels out (e.g. --partition shards:2 or labels:3)")
    if "novel-clients" in ood_sets:
        if not novel:
            raise ConfigError("novel-clients: this run has no novel clients; run it with "
                              "novel_fraction (--novel-fraction 0.2) to hold some out")
        outside = torch.cat([client_data[k].test_x for k in novel])
        for k in trained:
            ood_sets["novel-clients"][k] = (client_data[k].test_x, outside)
    return ood_sets, notes


def shift_client_step(
    k: int,
    x: Tensor,
    y: Tensor,
    rows: Mapping[str, tuple[Tensor, Tensor]],
    *,
    predict: Predictor,
    draws: Callable[[int, int, int, list[str]], Draws | None],
    shifts: Sequence[Shift],
    image_shape: tuple[int, int, int] | None,
    value_range: tuple[float, float],
    n_bins: int,
    seed: int,
    posterior_samples: int,
    note: list[str],
) -> ClientShiftStates:
    """Client ``k``'s part of a shift evaluation, as `evaluate_shift` runs it in this
    process and a Flower site runs it on its own state (`bayesfl.shift_protocol`): the noise
    and the posterior draws seeded from ``(seed, k)``, so both give the same states.

    Args:
        k: the client.
        x, y: its test rows (N, ...) and labels (N,).
        rows: its OOD row sets (`ood_row_sets`).
        predict: its predictives.
        draws: ``draws(k, n, seed, note)`` -> its posterior draws, or None with the reason
            appended to ``note`` (not asked once ``note`` holds a reason, nor without rows).
        shifts, image_shape, value_range, n_bins: as `client_shift_states` takes them.
        seed: the evaluation's seed; posterior_samples: draws for the mutual information.
        note: the reasons the mutual information is missing (appended to).
    """
    samples = None
    if rows and posterior_samples and not note:
        samples = draws(k, posterior_samples, derived_seed(seed, _DRAWS_KEY, k), note)
    generator = torch.Generator().manual_seed(derived_seed(seed, _NOISE_KEY, k))
    return client_shift_states(predict, x, y, shifts=shifts, image_shape=image_shape,
                               value_range=value_range, n_bins=n_bins,
                               noise_generator=generator, ood_rows=rows, draws=samples,
                               client_id=k)


def unseen_label_rows(client_data: Sequence[Any], k: int) -> tuple[Tensor, Tensor]:
    """``(inside, outside)`` of client ``k`` for ``"unseen-labels"``: its own test rows whose
    label it trained on, and the test rows of every client (in client order) whose label is
    absent from its training labels."""
    seen = torch.unique(client_data[k].train_y)
    own = client_data[k]
    pooled_x = torch.cat([d.test_x for d in client_data])
    pooled_y = torch.cat([d.test_y for d in client_data])
    return own.test_x[torch.isin(own.test_y, seen)], pooled_x[~torch.isin(pooled_y, seen)]


def _integer(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


def ood_kinds(ood: Any) -> list[str]:
    if ood is None:
        return []
    items = [ood] if isinstance(ood, str) else list(ood)
    out = []
    for item in items:
        name = item.strip().lower().replace("_", "-") if isinstance(item, str) else item
        if name not in OOD_KINDS:
            raise ConfigError(f"unknown ood set {item!r}; valid: {', '.join(OOD_KINDS)}")
        if name not in out:
            out.append(name)
    return out


def _run_data(run: Any, data: Any) -> tuple[Any, list[Any]]:
    """The run's pooled data set and its clients' data, rebuilt from its configuration and
    checked against the digest it recorded."""
    from bayesfl.data.datasets import as_dataset, dataset_identity, load_dataset
    from bayesfl.engine.setup import run_setup

    recorded = run.summary.get("data") if isinstance(run.summary, Mapping) else None
    custom = isinstance(recorded, Mapping) and recorded.get("name") == "custom"
    if data is None:
        if custom:
            raise ConfigError("this run was trained on your own data (simulate(data=...)): a "
                              "run directory does not keep them; pass them again: "
                              "evaluate_shift(run, ..., data=(x, y))")
        config = run.config
        dataset = load_dataset(config.dataset, seed=config.data_rng_seed, **config.dataset_options)
    else:
        dataset = as_dataset(data)
    if isinstance(recorded, Mapping) and "sha256" in recorded:
        found = dataset_identity(dataset, custom=custom)
        if found.get("sha256") != recorded["sha256"]:
            raise DataError(f"the data are not the run's (their digest {found['sha256'][:12]} "
                            f"differs from the run's {str(recorded['sha256'])[:12]}); pass the "
                            "data the run was trained on")
    setup = run_setup(run.config, dataset, torch.device("cpu"))
    if len(setup.client_data) != run.num_clients:
        raise DataError(f"the data give {len(setup.client_data)} clients, the run has "
                        f"{run.num_clients}")
    return dataset, setup.client_data


def posterior_draws(strategy: Any, config: Any, state: Any, broadcast: Any,
                     device: torch.device, n: int, seed: int, note: list[str]) -> Any:
    """``draws(x) -> (n, B, C)``: probabilities under ``n`` posterior draws of client
    ``config``'s posterior, or None (with the reason appended to ``note``) when the strategy
    has no posterior or its posterior cannot give single draws."""
    from inference.errors import InferenceError

    try:
        posterior = strategy.posterior(config, state, broadcast)
    except (BayesFLError, InferenceError) as err:
        note.append(f"mutual information: not available for {strategy.name} ({err})")
        return None
    head = getattr(posterior, "head", None)
    features = getattr(posterior, "features", None)

    def draws(x: Tensor) -> Tensor:
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            if head is not None and features is not None:
                target, inputs = head, features(x.to(device))
            else:
                target, inputs = posterior, x.to(device)
            return torch.stack([target.predict_proba(inputs, method="mc", n_samples=1,
                                                     generator=generator).to(torch.float64)
                                for _ in range(n)])

    try:
        probe = draws(torch.zeros((1, *strategy.context.input_shape)))
        if probe.ndim != 3 or probe.shape[0] != n:
            raise ValueError(f"draws of shape {tuple(probe.shape)}")
    except (TypeError, ValueError, BayesFLError, InferenceError, CalibrationError) as err:
        note.append(f"mutual information: {strategy.name}'s posterior gives no single draws "
                    f"of the probabilities ({' '.join(str(err).split())[:200]})")
        return None
    return draws


__all__ = [
    "CLEAN",
    "OOD_KINDS",
    "SCORES",
    "ClientShiftStates",
    "Draws",
    "Predictor",
    "RunSubject",
    "ShiftReport",
    "ShiftSubject",
    "as_shift_subject",
    "build_report",
    "check_image_shifts",
    "client_shift_states",
    "evaluate_shift",
    "format_severity",
    "ood_kinds",
    "ood_row_sets",
    "posterior_draws",
    "selective_rows",
    "selective_state",
    "shift_client_step",
    "unseen_label_rows",
]
