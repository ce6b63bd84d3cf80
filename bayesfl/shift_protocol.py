"""The shift evaluation as a federated step: each site scores its own state on its own rows,
only mergeable states travel (`ShiftRequest` down, a validated states message up).

A run asks for it with the run keys ``shift`` and ``ood`` (``bayesfl run --shift rotate:15,30
--ood unseen-labels``, ``bayesfl flower ...``, TOML ``shift = ["rotate:15,30"]``, Flower's run
config ``shift = "rotate:15,30 noise:0.1"``, ``simulate(shift=..., ood=...)``). After the final
phase (personalisation and ``calibrate`` included) the run writes the report `bayesfl
evaluate` writes into ``RUN_DIR/shift`` (``shift_report.json``, ``shift_report.md``, the
plots) and, beside it, the clients' validated states (`STATES_NAME`), from which
`stored_shift_report` rebuilds the whole report (plots included) without the clients.

The step is a final phase (`bayesfl.engine.phases`), written once for both transports:
`shift_phase` on the server, `client_states` on each client (`REQUEST`).

* **The simulator** asks its clients in process (the same request, reply and checks).
* **Flower**: the ServerApp sends every connected site one ``query.shift`` message (the
  request as JSON, and the final evaluation broadcast); the site runs
  `bayesfl.shift_evaluation.shift_client_step` (the step `evaluate_shift` runs for each
  client, same seeds) on its own test rows with its final state (personalised where the
  strategy personalises) and replies with its `ClientShiftStates` as one bayesfl message
  (`states_message`: safetensors, header strategy `PROTOCOL`). The server checks
  each reply (`read_shift_states`): names against the request's schema, dtypes, shapes,
  finiteness, every accumulator's own invariants, the row counts (each condition counts the
  site's declared test rows; each OOD set the in- and out-of-distribution rows its client
  has) and the score ranges. A missing, failing or invalid reply is logged (``rejections``)
  and the report is built from the others; the step never stops the run. Bytes up and down
  are counted (``summary["shift_evaluation"]``). The out-of-distribution rows a site scores
  come from the run's data set, which every node loads (no row crosses the network); with a
  per-site ``data-loader`` only the input shifts are offered (a site holds no other site's
  rows).

Same configuration and seed, same report: the simulator's and Flower's states are computed by
the same function on the same numbers (tests/bayesfl/test_flower_shift.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bayesfl.engine.phases import Phase
from bayesfl.errors import BayesFLError, CheckpointError, ConfigError, MessageRejected
from bayesfl.messages import (
    DEFAULT_MAX_BYTES,
    Header,
    Message,
    TensorSpec,
    decode,
    encode,
    validate,
)
from bayesfl.shift_evaluation import (
    CLEAN,
    ClientShiftStates,
    ShiftReport,
    build_report,
    ood_row_sets,
    shift_client_step,
)
from bayesfl.shifts import SEVERITY_UNITS, Shift, as_shifts, check_shift, data_range
from bayesfl.strategies.base import PREDICTIVE
from calibration import Accumulator, AurocAccumulator
from calibration.errors import CalibrationError

PROTOCOL = "shift-evaluation"
"""Header ``strategy`` of the shift step's messages."""
REPORT_DIR = "shift"
"""Where a run writes its shift report (``RUN_DIR/shift``, `bayesfl evaluate`'s default)."""
STATES_NAME = "shift_states.safetensors"
"""The clients' validated states a run keeps beside its report (`stored_shift_report`)."""
MAX_REPLY_BYTES = DEFAULT_MAX_BYTES
"""Largest encoded reply accepted (64 MiB): a condition's exact selective table holds at most
one value per test row (24 bytes), an OOD table one per scored row."""
DEFAULTS = {"seed": 0, "coverage": 0.8, "posterior_samples": 32}
"""The settings a run's shift step uses (`bayesfl evaluate`'s defaults)."""

_ACCUMULATOR_SPECS = {"bin_counts": torch.int64, "bin_confidence_sums": torch.float64,
                      "bin_correct_counts": torch.int64, "brier_sum": torch.float64,
                      "nll_sum": torch.float64}
_TABLE_SPECS = {"values": torch.float64, "in_counts": torch.int64, "ood_counts": torch.int64}
_SCORE_SLACK = 1e-6  # float64 rounding of an entropy or probability, far below a real change
_SCORES = ("entropy", "max_prob")  # every predictive; "mutual_information": the headline


# ==== the request =============================================================================
@dataclass(frozen=True)
class ShiftRequest:
    """What every site evaluates (server -> site, as JSON).

    Attributes:
        shifts: the input shifts (`bayesfl.shifts.Shift`), the clean rows always included.
        ood: the out-of-distribution sets (``"unseen-labels"``, ``"novel-clients"``).
        seed: seeds the noise and the posterior draws (per client, as `evaluate_shift`).
        coverage: the coverage of the selective accuracy.
        posterior_samples: posterior draws for the mutual information (0: none).
        n_bins: calibration bins.
        image_shape: (C, H, W) of the rows for ``rotate``/``contrast``, or None.
        data_range: (low, high) of the run's data set (the shifts' clip range).
    """

    shifts: tuple[Shift, ...]
    ood: tuple[str, ...]
    seed: int = 0
    coverage: float = 0.8
    posterior_samples: int = 32
    n_bins: int = 15
    image_shape: tuple[int, int, int] | None = None
    data_range: tuple[float, float] = (0.0, 1.0)

    def to_json(self) -> str:
        """The request as the JSON text a site receives."""
        return json.dumps({
            "shifts": [[s.kind, list(s.severities)] for s in self.shifts],
            "ood": list(self.ood), "seed": self.seed, "coverage": self.coverage,
            "posterior_samples": self.posterior_samples, "n_bins": self.n_bins,
            "image_shape": None if self.image_shape is None else list(self.image_shape),
            "data_range": list(self.data_range)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Any) -> ShiftRequest:
        """The request a site received, checked.

        Raises:
            MessageRejected: not a request (bad JSON, a field missing or of the wrong type, a
                shift or OOD set that is not known).
        """
        from bayesfl.shift_evaluation import ood_kinds

        try:
            raw = json.loads(text)
            shifts = tuple(check_shift(kind, severities) for kind, severities in raw["shifts"])
            ood = tuple(ood_kinds(raw["ood"]))
            seed, samples, bins = (raw[k] for k in ("seed", "posterior_samples", "n_bins"))
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for v in (seed, samples, bins)) or bins < 1:
                raise ValueError("seed, posterior_samples and n_bins must be whole numbers")
            coverage = float(raw["coverage"])
            low, high = (float(v) for v in raw["data_range"])
            shape = raw["image_shape"]
            shape = None if shape is None else tuple(int(v) for v in shape)
            if not 0.0 < coverage <= 1.0 or not (math.isfinite(low) and math.isfinite(high)) \
                    or (shape is not None and (len(shape) != 3 or min(shape) < 1)):
                raise ValueError("coverage, data_range or image_shape out of range")
        except (ValueError, TypeError, KeyError, BayesFLError) as err:
            raise MessageRejected(f"not a shift request: {err}") from err
        return cls(shifts, ood, seed, coverage, samples, bins, shape, (low, high))


def shift_request(config: Any, dataset: Any, client_data: Sequence[Any] | None,
                  novel: Sequence[int], shifts: Any = (), ood: Any = (), *,
                  seed: int = DEFAULTS["seed"], coverage: float = DEFAULTS["coverage"],
                  posterior_samples: int = DEFAULTS["posterior_samples"]) -> ShiftRequest:
    """The request of a run's ``shift``/``ood`` keys, checked before the run trains.

    Args:
        config: the run's `bayesfl.config.SimulationConfig`.
        dataset: its pooled data set (shapes, range, name).
        client_data: its clients' data (every client's test rows), or None where the sites
            load their own (a per-site ``data-loader``: input shifts only).
        novel: the novel clients.
        shifts, ood: the run keys (strings ``"rotate:15,30"`` or `Shift` s; OOD set names).

    Raises:
        ConfigError: an unknown shift or OOD set, rotate/contrast on data that are not images,
            OOD rows the run will not have, OOD sets with per-site data; the message says
            what to do.
    """
    from bayesfl.shift_evaluation import check_image_shifts, ood_kinds
    from bayesfl.shifts import image_shape_of

    shift_list = as_shifts(list(shifts or ()))
    ood_list = ood_kinds(list(ood or ()))
    shape = image_shape_of(dataset.input_shape, dataset.name)
    check_image_shifts(shift_list, shape, dataset)
    if ood_list:
        if client_data is None:
            raise ConfigError(f"ood {', '.join(ood_list)}: with a per-site data-loader no "
                              "site holds another site's rows, so there are no "
                              "out-of-distribution rows to score; drop ood (the input shifts "
                              "work)")
        ood_row_sets(client_data, novel, ood_list)  # raises where the run has no such rows
    return ShiftRequest(tuple(shift_list), tuple(ood_list), int(seed), float(coverage),
                        int(posterior_samples), int(config.n_bins), shape,
                        data_range(dataset.x))


def report_settings(request: ShiftRequest, *, run_dir: Any, strategy: str, dataset: str,
                    clients: int, novel: Sequence[int], partition: str, rounds: int
                    ) -> dict[str, Any]:
    """The report's ``settings`` (what `evaluate_shift` writes for a run)."""
    from bayesfl.shift_evaluation import PREDICTIVE_NAMES

    return {
        "run_dir": None if run_dir is None else str(run_dir),
        "strategy": strategy, "dataset": dataset, "clients": clients,
        "novel_clients": [int(k) for k in novel], "partition": partition, "rounds": rounds,
        "shifts": {s.kind: list(s.severities) for s in request.shifts},
        "severity_units": {s.kind: SEVERITY_UNITS[s.kind] for s in request.shifts},
        "ood": list(request.ood), "seed": request.seed, "n_bins": request.n_bins,
        "coverage": request.coverage, "posterior_samples": request.posterior_samples,
        "image_shape": None if request.image_shape is None else list(request.image_shape),
        "data_range": list(request.data_range),
        "predictive_names": dict(PREDICTIVE_NAMES),
    }


# ==== the site's side =========================================================================
def site_shift_states(request: ShiftRequest, *, strategy: Any, client: Any, state: Any,
                      broadcast: Any, own: Any, all_clients: Sequence[Any] | None,
                      novel: Sequence[int], device: torch.device
                      ) -> tuple[ClientShiftStates, list[str]]:
    """One site's states for ``request``: its own test rows (``own``), its final ``state``,
    the final evaluation ``broadcast``; the OOD rows from ``all_clients`` (the run's data set,
    which the node loads). Returns the states and the notes (why the mutual information is
    missing).

    Raises:
        ConfigError: OOD sets asked of a site without the run's data set.
    """
    from bayesfl.shift_evaluation import posterior_draws

    k = int(client.client_id)
    rows: dict[str, tuple[Tensor, Tensor]] = {}
    if request.ood:
        if all_clients is None:
            raise ConfigError("this site loads its own data (data-loader): it holds no other "
                              "site's rows to score as out-of-distribution")
        sets, _ = ood_row_sets(all_clients, novel, request.ood)
        rows = {name: found[k] for name, found in sets.items() if k in found}

    def predict(x: Tensor) -> dict[str, Tensor]:
        with torch.no_grad():
            return strategy.predict(client, state, broadcast, x.to(device))

    def draws(_: int, n: int, seed: int, note: list[str]) -> Any:
        return posterior_draws(strategy, client, state, broadcast, device, n, seed, note)

    note: list[str] = []
    states = shift_client_step(
        k, own.test_x, own.test_y, rows, predict=predict, draws=draws,
        shifts=request.shifts, image_shape=request.image_shape,
        value_range=request.data_range, n_bins=request.n_bins, seed=request.seed,
        posterior_samples=request.posterior_samples, note=note)
    return states, note


def states_tensors(states: ClientShiftStates) -> dict[str, Tensor]:
    """A client's states as named tensors: ``calibration/SHIFT/SEVERITY/PREDICTIVE/STATE``,
    ``selective/...`` (the same keys) and ``detection/OOD/PREDICTIVE/SCORE/STATE``."""
    out: dict[str, Tensor] = {}
    for table in ("calibration", "selective"):
        for (kind, severity, key), acc in getattr(states, table).items():
            for name, tensor in acc.state_dict().items():
                out[f"{table}/{kind}/{severity!r}/{key}/{name}"] = tensor.cpu()
    for (ood, key, score), acc in states.detection.items():
        for name, tensor in acc.state_dict().items():
            out[f"detection/{ood}/{key}/{score}/{name}"] = tensor.cpu()
    return out


def states_message(states: ClientShiftStates) -> Message:
    """The reply of client ``states.client_id`` (header strategy `PROTOCOL`, up)."""
    return Message(Header(PROTOCOL, 0, int(states.client_id), "up"), states_tensors(states))


# ==== the server's side: checking a reply =====================================================
@dataclass(frozen=True)
class Expected:
    """What one client's reply must hold.

    Attributes:
        num_test: its test rows (each condition counts them).
        ood: OOD set -> (in-distribution rows, OOD rows) of this client; a set absent here
            must be absent from the reply.
    """

    num_test: int
    ood: Mapping[str, tuple[int, int]] = field(default_factory=dict)


def expected_replies(request: ShiftRequest, client_data: Sequence[Any] | None,
                     novel: Sequence[int], num_test: Mapping[int, int]
                     ) -> tuple[dict[int, Expected], list[str]]:
    """Each client's `Expected` (from the run's partition, which the server rebuilds as
    every node does), and the notes on clients without OOD rows (`ood_row_sets`)."""
    sets: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
    notes: list[str] = []
    if request.ood and client_data is not None:
        sets, notes = ood_row_sets(client_data, novel, request.ood)
    out = {}
    for k, count in num_test.items():
        ood = {name: (int(found[k][0].shape[0]), int(found[k][1].shape[0]))
               for name, found in sets.items() if k in found}
        out[int(k)] = Expected(int(count), ood)
    return out, notes


def read_shift_states(data: bytes, *, client_id: int, request: ShiftRequest,
                      predictives: set[str], num_classes: int, expected: Expected,
                      key: bytes | None = None) -> ClientShiftStates:
    """A site's reply, validated (module notes).

    Raises:
        MessageRejected: with the reason.
    """
    message = decode(data, max_bytes=MAX_REPLY_BYTES, key=key)
    return states_from_tensors(message, client_id=client_id, request=request,
                               predictives=predictives, num_classes=num_classes,
                               expected=expected)


def states_from_tensors(message: Message, *, client_id: int, request: ShiftRequest,
                        predictives: set[str], num_classes: int, expected: Expected
                        ) -> ClientShiftStates:
    """The states of a decoded reply ``message``, validated (`read_shift_states`)."""
    required: dict[str, TensorSpec] = {}
    conditions = [(CLEAN, 0.0)] + [(s.kind, v) for s in request.shifts for v in s.severities]
    for kind, severity in conditions:
        for key in sorted(predictives):
            for name, dtype in _ACCUMULATOR_SPECS.items():
                shape = () if name.endswith("_sum") else (request.n_bins,)
                required[f"calibration/{kind}/{severity!r}/{key}/{name}"] = TensorSpec(shape,
                                                                                       dtype)
            for name, dtype in _TABLE_SPECS.items():
                required[f"selective/{kind}/{severity!r}/{key}/{name}"] = TensorSpec((None,),
                                                                                     dtype)
    optional: dict[str, TensorSpec] = {}
    for ood in expected.ood:
        for key in sorted(predictives):
            scores = list(_SCORES) + (["mutual_information"] if key == PREDICTIVE and
                                          request.posterior_samples else [])
            for score in scores:
                for name, dtype in _TABLE_SPECS.items():
                    spec = TensorSpec((None,), dtype)
                    target = optional if score == "mutual_information" else required
                    target[f"detection/{ood}/{key}/{score}/{name}"] = spec
    names = set(message.tensors)
    missing = sorted(set(required) - names)
    extra = sorted(names - set(required) - set(optional))
    if missing or extra:
        shown = (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing
                 else f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        raise MessageRejected(f"shift reply does not follow the request: {shown}",
                              client_id=client_id)
    schema = {**required, **{n: s for n, s in optional.items() if n in names}}
    validate(message, schema, strategy=PROTOCOL, round=0, direction="up", client_id=client_id)
    groups: dict[tuple[str, ...], dict[str, Tensor]] = {}
    for name, tensor in message.tensors.items():
        *head, state_name = name.split("/")
        groups.setdefault(tuple(head), {})[state_name] = tensor
    states = ClientShiftStates(client_id)
    try:
        for head, state in groups.items():
            table = head[0]
            if table == "calibration":
                acc = Accumulator.from_state_dict(state)
                _check(acc.count == expected.num_test and acc.n_bins == request.n_bins,
                       f"{'/'.join(head)} counts {acc.count} rows in {acc.n_bins} bins, "
                       f"expected the client's {expected.num_test} test rows in "
                       f"{request.n_bins}", client_id)
                states.calibration[(head[1], float(head[2]), head[3])] = acc
            elif table == "selective":
                acc = AurocAccumulator.from_state_dict(state)
                values = state["values"]
                _check(acc.n_in + acc.n_ood == expected.num_test,
                       f"{'/'.join(head)} counts {acc.n_in + acc.n_ood} rows, expected the "
                       f"client's {expected.num_test} test rows", client_id)
                _check(values.numel() == 0 or (float(values.min()) >= -1.0 - _SCORE_SLACK and
                                               float(values.max()) <= _SCORE_SLACK),
                       f"{'/'.join(head)}: confidences outside [0, 1]", client_id)
                states.selective[(head[1], float(head[2]), head[3])] = acc
            else:
                acc = AurocAccumulator.from_state_dict(state)
                ood, score = head[1], head[3]
                rows = expected.ood[ood]
                _check((acc.n_in, acc.n_ood) == rows,
                       f"{'/'.join(head)} scores {acc.n_in} in-distribution and {acc.n_ood} "
                       f"OOD rows, expected {rows[0]} and {rows[1]}", client_id)
                low, high = ((-1.0, -1.0 / num_classes) if score == "max_prob"
                             else (0.0, math.log(num_classes)))
                values = state["values"]
                _check(values.numel() == 0 or (float(values.min()) >= low - _SCORE_SLACK and
                                               float(values.max()) <= high + _SCORE_SLACK),
                       f"{'/'.join(head)}: scores outside [{low:.4g}, {high:.4g}]", client_id)
                states.detection[(ood, head[2], score)] = acc
    except CalibrationError as err:
        raise MessageRejected(f"shift reply: {err}", client_id=client_id) from err
    return _in_order(states, request, predictives)


def _in_order(states: ClientShiftStates, request: ShiftRequest, predictives: set[str]
              ) -> ClientShiftStates:
    """``states`` with its entries in the order `client_shift_states` makes them (the
    request's conditions, the headline first; per OOD set both scores of each predictive,
    then the mutual information), so a report's rows come in the simulator's order."""
    keys = sorted(predictives, key=lambda k: (k != PREDICTIVE, k))
    conditions = [(CLEAN, 0.0)] + [(s.kind, float(v)) for s in request.shifts
                                   for v in s.severities]
    order = [(kind, severity, key) for kind, severity in conditions for key in keys]
    detection = [(ood, key, score) for ood in request.ood
                 for key in keys for score in _SCORES] + \
        [(ood, PREDICTIVE, "mutual_information") for ood in request.ood]
    detection = sorted(detection, key=lambda d: request.ood.index(d[0]))  # stable per set
    out = ClientShiftStates(states.client_id)
    out.calibration = {k: states.calibration[k] for k in order if k in states.calibration}
    out.selective = {k: states.selective[k] for k in order if k in states.selective}
    out.detection = {k: states.detection[k] for k in detection if k in states.detection}
    return out


def _check(ok: bool, reason: str, client_id: int) -> None:
    if not ok:
        raise MessageRejected(reason, client_id=client_id)


# ==== the server's side: the step =============================================================
Ask = Callable[[bytes, Sequence[int]], Mapping[int, "tuple[bytes, list[str]] | str"]]
"""``ask(request, client_ids) -> {client: (encoded reply, its notes) or why none came}``."""


@dataclass
class ShiftOutcome:
    """The federated shift step of a run.

    Attributes:
        report: the report of the accepted replies (None when none was accepted).
        states: the accepted clients' states (client order).
        participants: the clients asked.
        bytes_up, bytes_down: encoded bytes of the replies / of the request times its
            recipients.
        rejections: ``{"client_id", "reason"}`` per missing, failing or invalid reply.
        error: why there is no report, or None.
    """

    report: ShiftReport | None
    states: list[ClientShiftStates]
    participants: list[int]
    bytes_up: int = 0
    bytes_down: int = 0
    rejections: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        """``summary["shift_evaluation"]``."""
        return {"report": f"{REPORT_DIR}/shift_report.json" if self.report else None,
                "participants": self.participants,
                "accepted": [s.client_id for s in self.states],
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "rejections": self.rejections, "error": self.error}


def federated_shift_evaluation(ask: Ask, client_ids: Sequence[int], request: ShiftRequest, *,
                               expected: Mapping[int, Expected], predictives: set[str],
                               num_classes: int, novel: Sequence[int],
                               settings: Mapping[str, Any], notes: Sequence[str] = (),
                               keys: Any = None) -> ShiftOutcome:
    """Ask every client in ``client_ids`` for its states, validate each reply against
    ``expected``, and build the report from those accepted (module notes). Never raises on a
    reply: what fails is a rejection, named in ``notes`` too."""
    down = request.to_json().encode()
    ids = [int(c) for c in client_ids]
    outcome = ShiftOutcome(None, [], ids, bytes_down=len(down) * len(ids))
    answers = ask(down, ids)
    site_notes: list[str] = []
    for cid in ids:
        answer = answers.get(cid, "no reply")
        if isinstance(answer, str):
            outcome.rejections.append({"client_id": cid, "reason": answer})
            continue
        data, found = answer
        outcome.bytes_up += len(data)
        try:
            if cid not in expected:
                raise MessageRejected(f"client {cid} was not asked", client_id=cid)
            client_key = None if keys is None else keys.client_key(cid)
            outcome.states.append(read_shift_states(
                data, client_id=cid, request=request, predictives=predictives,
                num_classes=num_classes, expected=expected[cid], key=client_key))
        except MessageRejected as err:
            outcome.rejections.append({"client_id": cid, "reason": err.reason})
            continue
        site_notes += [str(n) for n in found if str(n) not in site_notes]
    all_notes = list(notes) + [
        f"client {r['client_id']}: no shift states ({r['reason']}); the report is built from "
        "the other clients" for r in outcome.rejections] + site_notes
    if not outcome.states:
        outcome.error = "no client returned valid shift states"
        return outcome
    outcome.report = build_report(outcome.states, novel=novel, settings=settings,
                                  coverage=request.coverage, notes=all_notes)
    return outcome


# ==== the phase, over a transport's channel =====================================================
def client_states(site: Any, down: bytes) -> tuple[bytes, list[str]]:
    """A site's answer to the shift request (`REQUEST`): its states for the request
    (`site_shift_states`, on its own test rows with its final state) as one encoded
    message, and its notes (why the mutual information is missing, if it is).

    Raises:
        MessageRejected: not a shift request.
        ConfigError: OOD sets asked of a site without the run's data set.
    """
    request = ShiftRequest.from_json(down.decode())
    states, notes = site_shift_states(
        request, strategy=site.strategy, client=site.client, state=site.state,
        broadcast=site.broadcast, own=site.data, all_clients=site.clients, novel=site.novel,
        device=site.device)
    return encode(states_message(states), key=site.client_key), notes


REQUEST = Phase("shift", client_states, "query.shift", "request", numbered=False, text=True,
                notes=True, max_bytes=MAX_REPLY_BYTES)
"""The shift request (Flower: ``query.shift``, the request's JSON under ``request``; the reply
``reply`` with the site's ``notes``)."""


def shift_phase(channel: Any, client_ids: Sequence[int], request: ShiftRequest, *,
                client_data: Sequence[Any] | None, num_test: Mapping[int, int],
                predictives: set[str], num_classes: int, novel: Sequence[int],
                settings: Mapping[str, Any]) -> ShiftOutcome:
    """The shift evaluation over a transport's ``channel``
    (`bayesfl.engine.phases.PhaseChannel`): the request to every client in
    ``client_ids``, each reply checked against what the run's partition (``client_data``;
    None for per-site data) and the clients' declared ``num_test`` rows say it must hold,
    the report from the accepted ones (`federated_shift_evaluation`)."""
    expected, notes = expected_replies(request, client_data, novel,
                                       {c: num_test[c] for c in client_ids})

    def ask(down: bytes, ids: Sequence[int]) -> Mapping[int, Any]:
        return channel.ask(REQUEST, 0, down, list(ids))

    return federated_shift_evaluation(ask, client_ids, request, expected=expected,
                                      predictives=predictives, num_classes=num_classes,
                                      novel=novel, settings=settings, notes=notes,
                                      keys=channel.keys)


# ==== in the run directory ====================================================================
def write_shift_outcome(run_dir: Path, report: ShiftReport,
                        states: Sequence[ClientShiftStates], *, novel: Sequence[int],
                        num_classes: int, plots: bool = True) -> list[Path]:
    """The report's files and the states (`STATES_NAME`) into ``run_dir/shift``."""
    from safetensors.torch import save_file

    out = Path(run_dir) / REPORT_DIR
    paths = report.write(out, plots=plots)
    tensors = {f"client/{s.client_id}/{name}": t.contiguous()
               for s in states for name, t in states_tensors(s).items()}
    meta = {"bayesfl.shift": json.dumps({"settings": report.settings,
                                         "clients": [s.client_id for s in states],
                                         "novel": [int(k) for k in novel],
                                         "num_classes": int(num_classes),
                                         "notes": report.notes})}
    save_file(tensors, str(out / STATES_NAME), metadata=meta)
    return [*paths, out / STATES_NAME]


def stored_shift_report(run_dir: str | Path) -> ShiftReport:
    """The shift report a run stored (run keys ``shift``/``ood``), rebuilt from its clients'
    states (`STATES_NAME`): the figures, curves and plots of the run's own evaluation,
    for a Flower run whose clients' states stay at their sites too.

    Raises:
        CheckpointError: the run stored no shift report (the message says how to get one), or
            the file is damaged.
    """
    from safetensors import safe_open

    root = Path(run_dir)
    path = root / REPORT_DIR / STATES_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{root} holds no shift report of its run ({REPORT_DIR}/{STATES_NAME} is absent); "
            "a Flower run keeps its clients' states at their sites, so it is evaluated while "
            "it runs: run it again with the run keys shift and ood (bayesfl flower --shift "
            "rotate:15,30 --ood unseen-labels, or shift = \"rotate:15,30\" and ood = "
            "\"unseen-labels\" in its run config)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["bayesfl.shift"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        settings = meta["settings"]
        request = request_of_settings(settings)
        novel = [int(k) for k in meta["novel"]]
        states = []
        for cid in meta["clients"]:
            prefix = f"client/{int(cid)}/"
            own = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
            message = Message(Header(PROTOCOL, 0, int(cid), "up"), own)
            count = int(own[f"calibration/{CLEAN}/0.0/{PREDICTIVE}/bin_counts"].sum())
            ood = {}
            for name in own:
                parts = name.split("/")
                if parts[0] == "detection" and parts[3] == "entropy" and \
                        parts[4] == "in_counts":
                    ood[parts[1]] = (int(own[name].sum()),
                                     int(own[name.replace("in_counts", "ood_counts")].sum()))
            predictives = {n.split("/")[3] for n in own if n.startswith("calibration/")}
            states.append(states_from_tensors(
                message, client_id=int(cid), request=request, predictives=predictives,
                num_classes=int(meta["num_classes"]), expected=Expected(count, ood)))
    except (OSError, ValueError, KeyError, TypeError, BayesFLError) as err:
        raise CheckpointError(f"{path} is damaged ({' '.join(str(err).split())[:300]}); run "
                              "the run again with --force") from err
    return build_report(states, novel=novel, settings=settings, coverage=request.coverage,
                        notes=meta["notes"])


def request_of_settings(settings: Mapping[str, Any]) -> ShiftRequest:
    """The request a report's ``settings`` were evaluated with."""
    shape = settings.get("image_shape")
    return ShiftRequest(
        tuple(check_shift(k, v) for k, v in settings["shifts"].items()),
        tuple(settings["ood"]), int(settings["seed"]), float(settings["coverage"]),
        int(settings["posterior_samples"]), int(settings["n_bins"]),
        None if shape is None else tuple(int(v) for v in shape),
        tuple(float(v) for v in settings["data_range"]))


def same_request(settings: Mapping[str, Any], shifts: Any, ood: Any, **others: Any
                 ) -> str | None:
    """None when ``shifts``/``ood`` (and the ``others`` given: seed, coverage,
    posterior_samples) ask what the stored ``settings`` hold, else what differs."""
    from bayesfl.shift_evaluation import ood_kinds

    asked = {s.kind: sorted(s.severities) for s in as_shifts(list(shifts or ()))}
    stored = {k: sorted(float(v) for v in vs) for k, vs in settings["shifts"].items()}
    differs = []
    if shifts and asked != stored:
        differs.append(f"shifts {_shown(asked)} (stored: {_shown(stored)})")
    wanted = ood_kinds(list(ood or ()))
    if ood and sorted(wanted) != sorted(settings["ood"]):
        differs.append(f"ood {', '.join(wanted)} (stored: {', '.join(settings['ood']) or 'none'})")
    for name, value in others.items():
        if value is not None and value != settings.get(name):
            differs.append(f"{name} {value} (stored: {settings.get(name)})")
    return "; ".join(differs) or None


def _shown(shifts: Mapping[str, Sequence[float]]) -> str:
    from bayesfl.shifts import format_severity

    return " ".join(f"{k}:{','.join(format_severity(v) for v in vs)}"
                    for k, vs in shifts.items()) or "none"


__all__ = [
    "DEFAULTS",
    "MAX_REPLY_BYTES",
    "PROTOCOL",
    "REPORT_DIR",
    "REQUEST",
    "STATES_NAME",
    "Expected",
    "ShiftOutcome",
    "ShiftRequest",
    "client_states",
    "expected_replies",
    "federated_shift_evaluation",
    "read_shift_states",
    "report_settings",
    "request_of_settings",
    "same_request",
    "shift_phase",
    "shift_request",
    "site_shift_states",
    "states_from_tensors",
    "states_message",
    "states_tensors",
    "stored_shift_report",
    "write_shift_outcome",
]
