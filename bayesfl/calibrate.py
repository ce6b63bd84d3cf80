"""Federated temperature scaling: the optional final step of a run (``calibrate="temperature"``).

After the last round every client holds the headline predictive (for posterior strategies the
posterior predictive: *probabilities*, not logits). Temperature scaling of probabilities is
``p^(1/T)`` renormalised, i.e. ``softmax(log p / T)`` with ``log max(p, 1e-12)``
(`calibration.apply_temperature`); one T is shared by all clients and fitted to minimise
the NLL summed over every client's held-out data, without any prediction leaving a client:

* **Held-out data.** With ``calibrate="temperature"`` each client sets aside a share of its
  *training* data before training starts (stratified by label as the train/test split is,
  ``"temperature:FRACTION"``, default `DEFAULT_HELD_OUT_FRACTION`) and trains on the rest.
  Fitting T on data the model was trained on would reward overconfidence (the training NLL
  falls as T -> 0); fitting it on the test data would leave no honest test figure. A client
  with fewer than two training samples holds nothing out and sits the step out.
* **The protocol** (`calibration.temperature`'s search, driven over messages). The server
  proposes ``s = log T`` (`PROPOSAL_SCHEMA`); every participating client answers with
  four numbers computed on its held-out data: the summed NLL at T, its first and second
  derivatives w.r.t. ``s`` and its sample count (`REPLY_SCHEMA`). The server adds the
  answers and takes a safeguarded Newton step; about 5-10 proposals reach float64 precision,
  and the result equals centralised temperature scaling on the pooled held-out data up to
  float rounding. Finally it broadcasts T (`RESULT_SCHEMA`) to every client, which
  applies it to its own predictive.
* **Messages** are `bayesfl.messages.Message` s under the header strategy
  `PROTOCOL`, encoded and decoded like every round's, and counted in bytes (up and down).
  A reply is validated on receipt: its schema, then the bounds any honest reply satisfies
  (`reply_problem`: the NLL and its derivatives of floored log-probabilities are bounded
  by the floor's spread at T) and a sample count that stays the same. A client whose reply
  fails is dropped, the reason logged, and the search starts again over the others (the
  objective changed); the run never crashes on it. A client can still bias T within those
  bounds: the step trusts its participants as much as the aggregation of statistics does.

The step is a final phase (`bayesfl.engine.phases`), written once for every transport:
`calibrate_phase` on the server, `client_reply` (to a proposal, `PROPOSAL`)
and `client_evaluation` (to the result, `RESULT`) on each client; the transport
only carries the bytes. The setting's parser is `bayesfl.calibration_spec` and the
hold-out split `bayesfl.holdout` (both re-exported here).

The run reports the uncalibrated headline figures and the calibrated ones side by side
(``summary["calibration"]``), with the temperature, the held-out NLL before and after, the
communication rounds and bytes of the step, and any rejections.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bayesfl.calibration_spec import (
    DEFAULT_HELD_OUT_FRACTION,
    METHODS,
    CalibrationSpec,
    parse_calibrate,
)
from bayesfl.engine.phases import (
    InProcessPhases,
    Phase,
    PhaseChannel,
    Site,
    UploadHook,
    asker,
    read_answers,
    search_step,
    with_restarts,
)
from bayesfl.errors import BayesFLError, DataError, MessageRejected
from bayesfl.evaluation import (
    RoundEvaluation,
    evaluation_tensors,
    merge_evaluations,
    read_evaluation,
)
from bayesfl.holdout import HeldOut, hold_out
from bayesfl.messages import Header, KeyRing, Message, TensorSpec, decode, encode, validate
from bayesfl.strategies.base import PREDICTIVE, Evaluation
from calibration.accumulator import Accumulator
from calibration.errors import CalibrationError
from calibration.row_scores import PROBABILITY_FLOOR
from calibration.temperature import (
    TEMPERATURE_BOUNDS,
    NLLDerivatives,
    TemperatureFit,
    apply_temperature,
    log_scores,
    nll_derivatives_of_log_scores,
    temperature_search,
)

PROTOCOL = "temperature-scaling"
"""Header ``strategy`` of the calibration step's messages."""
PROPOSAL_SCHEMA = {"log_temperature": TensorSpec((1,), torch.float64)}
"""Server -> clients: the proposed ``s = log T``."""
REPLY_SCHEMA = {"nll_derivatives": TensorSpec((3,), torch.float64),
                "num_samples": TensorSpec((1,), torch.int64)}
"""Client -> server: (summed NLL, dNLL/ds, d2NLL/ds2) at the proposal, and the sample count."""
RESULT_SCHEMA = {"temperature": TensorSpec((1,), torch.float64)}
"""Server -> every client: the fitted T."""

_REPLY_MAX_BYTES = 64 * 1024  # a reply is four numbers and a header
_SLACK = 1e-9  # relative float rounding allowed on the bounds of an honest reply

# ---- the client half ----------------------------------------------------------------------------
@dataclass(eq=False)
class TemperatureClient:
    """One client's half of the step: its held-out log-probabilities, never sent anywhere.

    Attributes:
        client_id: the client.
        log_probs: (n, C) float64 ``log max(p, 1e-12)`` of its predictive on its held-out data.
        labels: (n,) int64.
    """

    client_id: int
    log_probs: Tensor
    labels: Tensor

    @classmethod
    def from_probabilities(cls, client_id: int, probs: Tensor, labels: Tensor
                           ) -> TemperatureClient:
        """Validated (rows >= 0 summing to 1) probabilities (n, C) and labels (n,)."""
        log_probs, label_index = log_scores(probs, labels, from_logits=False)
        return cls(client_id, log_probs, label_index)

    def reply(self, proposal: Message) -> Message:
        """The answer to a proposal: four numbers about the held-out data at that T.

        Raises:
            MessageRejected: the proposal does not follow `PROPOSAL_SCHEMA`.
        """
        validate(proposal, PROPOSAL_SCHEMA, strategy=PROTOCOL, direction="down")
        s = float(proposal.tensors["log_temperature"][0])
        point = nll_derivatives_of_log_scores(self.log_probs, self.labels, s)
        return Message(
            Header(PROTOCOL, proposal.header.round, self.client_id, "up"),
            {"nll_derivatives": torch.tensor([point.nll_sum, point.d1, point.d2],
                                             dtype=torch.float64),
             "num_samples": torch.tensor([point.count], dtype=torch.int64)})


def temperature_of(result: Message) -> float:
    """The T of a result broadcast (client side).

    Raises:
        MessageRejected: not a `RESULT_SCHEMA` message, or T not in (0, inf).
    """
    validate(result, RESULT_SCHEMA, strategy=PROTOCOL, direction="down")
    temperature = float(result.tensors["temperature"][0])
    if not temperature > 0.0:
        raise MessageRejected(f"temperature must be > 0, got {temperature}")
    return temperature


def calibrated(probs: Tensor, temperature: float) -> Tensor:
    """``p^(1/T)`` renormalised per row (the client applying T to its predictive)."""
    return apply_temperature(probs, temperature, from_logits=False)


# ---- the server half ----------------------------------------------------------------------------
def proposal_message(step: int, log_temperature: float) -> Message:
    return Message(Header(PROTOCOL, step, -1, "down"),
                   {"log_temperature": torch.tensor([log_temperature], dtype=torch.float64)})


def result_message(step: int, temperature: float) -> Message:
    return Message(Header(PROTOCOL, step, -1, "down"),
                   {"temperature": torch.tensor([temperature], dtype=torch.float64)})


def reply_problem(
    point: NLLDerivatives, num_classes: int, expected_count: int | None
) -> str | None:
    """None if a reply could come from an honest client, else what is wrong with it.

    Log-probabilities floored at 1e-12 lie in [log 1e-12, 0], so at ``s = log T`` the scaled
    scores ``u`` of a row spread over at most ``w = -log(1e-12) e^{-s}``. Per sample then
    ``0 <= NLL <= w + log C``, ``|dNLL/ds| = |u_y - E_p u| <= w`` and
    ``-w <= d2NLL/ds2 = Var_p(u) - (u_y - E_p u) <= w^2 / 4 + w`` (Popoviciu).
    """
    n = point.count
    if n < 1:
        return f"num_samples must be >= 1, got {n}"
    if expected_count is not None and n != expected_count:
        return f"num_samples changed from {expected_count} to {n} during the step"
    spread = -math.log(PROBABILITY_FLOOR) * math.exp(-point.log_temperature)
    slack = _SLACK * n * (1.0 + spread * spread)
    largest_nll = n * (spread + math.log(num_classes))
    if not -slack <= point.nll_sum <= largest_nll + slack:
        return f"summed NLL {point.nll_sum:.6g} outside [0, {largest_nll:.6g}] for {n} samples"
    if abs(point.d1) > n * spread + slack:
        return f"first derivative {point.d1:.6g} beyond +-{n * spread:.6g} for {n} samples"
    if not -n * spread - slack <= point.d2 <= n * (spread * spread / 4 + spread) + slack:
        return f"second derivative {point.d2:.6g} out of range for {n} samples"
    return None


def _received_reply(
    data: Any, step: int, client_id: int, log_temperature: float, num_classes: int,
    expected_count: int | None, key: bytes | None,
) -> NLLDerivatives:
    """Decode and validate one reply (server side); MessageRejected with the reason."""
    message = decode(data, max_bytes=_REPLY_MAX_BYTES, key=key)
    validate(message, REPLY_SCHEMA, strategy=PROTOCOL, round=step, direction="up",
             client_id=client_id)
    nll_sum, d1, d2 = (float(v) for v in message.tensors["nll_derivatives"])
    point = NLLDerivatives(log_temperature, nll_sum, d1, d2,
                           int(message.tensors["num_samples"][0]))
    problem = reply_problem(point, num_classes, expected_count)
    if problem is not None:
        raise MessageRejected(problem, client_id=client_id)
    return point


@dataclass
class FederatedTemperature:
    """The outcome of the federated search.

    Attributes:
        fit: the temperature fit over the participants' held-out data (None on failure).
        participants: client ids whose replies the final fit used.
        steps: proposals sent (communication rounds of the step; a restart adds its own).
        restarts: searches started again after a client was dropped.
        bytes_up, bytes_down: encoded bytes of every reply / of every proposal and result
            times its recipients.
        floats_up, floats_down: the same as numbers (4 per reply, 1 per proposal/result).
        rejections: ``{"step", "client_id", "reason"}`` per dropped client.
        error: why no temperature was fitted (no participants left, no convergence), or None.
    """

    fit: TemperatureFit | None
    participants: list[int]
    steps: int = 0
    restarts: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    floats_up: int = 0
    floats_down: int = 0
    rejections: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


Ask = Callable[[int, bytes, Sequence[int]], Mapping[int, "bytes | str"]]
"""``ask(step, encoded_proposal, client_ids) -> client id -> encoded reply, or why none came``:
how the search reaches the clients (in this process, or over a transport's channel)."""


def federated_temperature_search(
    clients: Sequence[TemperatureClient],
    num_classes: int,
    *,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    upload_hook: UploadHook | None = None,
    keys: KeyRing | None = None,
) -> FederatedTemperature:
    """The server's search over messages, with every client answering from its own data.

    Replies are summed in client order; a rejected or failing client is dropped and the
    search restarts over the rest (module docstring). With ``keys`` every message carries an
    HMAC (the server's key down, each client's own key up), as the run's other messages do.
    """
    server_key = None if keys is None else keys.server_key
    by_id = {c.client_id: c for c in clients}

    def ask(step: int, down: bytes, client_ids: Sequence[int]) -> dict[int, bytes | str]:
        answers: dict[int, bytes | str] = {}
        for cid in client_ids:
            client_key = None if keys is None else keys.client_key(cid)
            try:  # the client's side, from the bytes it received
                answers[cid] = encode(by_id[cid].reply(decode(down, key=server_key)),
                                      key=client_key)
            except (BayesFLError, CalibrationError, ValueError) as err:
                answers[cid] = f"client failed to answer: {err}"
        return answers

    return temperature_search_over(ask, list(by_id), num_classes, bounds=bounds,
                                   upload_hook=upload_hook, keys=keys)


def temperature_search_over(
    ask: Ask,
    client_ids: Sequence[int],
    num_classes: int,
    *,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    upload_hook: UploadHook | None = None,
    keys: KeyRing | None = None,
) -> FederatedTemperature:
    """`federated_temperature_search` with the clients reached through ``ask`` (a
    transport's channel: `calibrate_phase`); the same validation, restarts and byte
    counts."""
    outcome = FederatedTemperature(fit=None, participants=list(client_ids))
    outcome.fit = with_restarts(client_ids, outcome, lambda active: _search_once(
        ask, active, num_classes, bounds, upload_hook, keys, outcome))
    return outcome


def _search_once(
    ask: Ask, active: Sequence[int], num_classes: int, bounds: tuple[float, float],
    upload_hook: UploadHook | None, keys: KeyRing | None, outcome: FederatedTemperature,
) -> TemperatureFit:
    server_key = None if keys is None else keys.server_key
    search = temperature_search(bounds)
    s = next(search)
    counts: dict[int, int] = {}
    while True:
        step = outcome.steps
        down = encode(proposal_message(step, s), key=server_key)
        outcome.floats_down += len(active)

        def read(cid: int, up: Any, step: int = step, s: float = s) -> NLLDerivatives:
            point = _received_reply(up, step, cid, s, num_classes, counts.get(cid),
                                    None if keys is None else keys.client_key(cid))
            counts[cid] = point.count
            return point

        replies = search_step(ask, down, active, outcome, read, floats_up=4,
                              upload_hook=upload_hook)
        points = [replies[cid] for cid in active]
        total = points[0]
        for point in points[1:]:
            total = total + point
        try:
            s = search.send(total)
        except StopIteration as done:
            return done.value


# ---- the phase, over a transport's channel ----------------------------------------------------
def client_reply(site: Site, down: bytes) -> bytes:
    """A client's answer to a proposal (`PROPOSAL`): four numbers about its held-out
    rows at that T, from its final predictive (scored once per phase: ``site.memo``).

    Raises:
        DataError: the client holds no held-out rows.
        MessageRejected: the proposal fails `PROPOSAL_SCHEMA`.
    """
    client = site.memo.get(PROTOCOL)
    if client is None:
        held = site.held_out
        if held is None or held.size == 0:
            raise DataError(f"client {site.client_id} holds no calibration data")
        client = site.memo[PROTOCOL] = TemperatureClient.from_probabilities(
            site.client_id, site.predict(held.x)[PREDICTIVE], held.y)
    return encode(client.reply(decode(down, key=site.server_key)), key=site.client_key)


def client_evaluation(site: Site, down: bytes) -> bytes:
    """A client's answer to the result (`RESULT`): its temperature-scaled predictive's
    calibration accumulator on its test rows, as a round's evaluation reply.

    Raises:
        MessageRejected: the result fails `RESULT_SCHEMA`.
    """
    result = decode(down, key=site.server_key)
    temperature = temperature_of(result)
    probs = calibrated(site.predict(site.data.test_x)[PREDICTIVE], temperature)
    labels = site.data.test_y.cpu()
    accumulator = Accumulator(site.n_bins).update(probs.cpu(), labels)
    evaluation = Evaluation(site.client_id, {PREDICTIVE: accumulator})
    reply = site.strategy.up_message(result.header.round, site.client_id,
                                     evaluation_tensors(evaluation))
    return encode(reply, key=site.client_key)


PROPOSAL = Phase("calibrate", client_reply, "query.calibrate", "proposal")
"""The search's request: a proposed ``s = log T`` (Flower record key ``proposal``)."""
RESULT = Phase("calibrate", client_evaluation, "query.calibrate", "result", reply="evaluation")
"""The result broadcast: T; the reply is the client's calibrated evaluation (``evaluation``)."""


def calibrate_phase(channel: PhaseChannel, clients: Sequence[int],
                    held_out: Mapping[int, HeldOut], *, spec: CalibrationSpec, server: Any,
                    n_bins: int, num_test: Mapping[int, int]) -> CalibrationOutcome:
    """The temperature-scaling step over a transport's ``channel`` (module docstring): the
    search over the ``clients`` with held-out rows (`PROPOSAL`), then the result to
    every client in ``clients`` (`RESULT`), whose calibrated evaluations are validated
    (`bayesfl.evaluation.read_evaluation` against the strategy's ``server`` half,
    ``n_bins`` and each client's ``num_test`` rows) and merged. A missing or rejected
    evaluation is a rejection; the others make the figures."""
    start = time.perf_counter()
    keys = channel.keys
    participants = [c for c in clients if c in held_out and held_out[c].size > 0]
    search = temperature_search_over(asker(channel, PROPOSAL), participants, server.num_classes,
                                     keys=keys)
    evaluation = None
    if search.fit is not None:
        step = search.steps
        result = encode(result_message(step, search.fit.temperature),
                        key=None if keys is None else keys.server_key)
        search.bytes_down += len(result) * len(clients)
        search.floats_down += len(clients)

        def read(cid: int, up: Any) -> Evaluation:
            return read_evaluation(server, up, round=step, client_id=cid, n_bins=n_bins,
                                   num_test=num_test[cid], predictives={PREDICTIVE},
                                   key=None if keys is None else keys.client_key(cid))

        evaluations, rejections = read_answers(
            channel.ask(RESULT, step, result, list(clients)), clients, step, read)
        search.rejections += rejections
        evaluation = merge_evaluations(list(evaluations.values())) if evaluations else None
    return CalibrationOutcome(search, evaluation, held_out, spec.held_out_fraction,
                              time.perf_counter() - start)


# ---- the step of a simulated run --------------------------------------------------------------
@dataclass
class CalibrationOutcome:
    """The calibration step of a run: the search and the calibrated evaluation.

    Attributes:
        search: the federated search's outcome.
        evaluation: the clients' evaluation of their temperature-scaled predictive on their
            test data (None when no temperature was fitted).
        held_out: client id -> its held-out data (what the clients fitted T on).
        held_out_fraction: the share of training data held out.
        seconds: wall-clock time of the step.
    """

    search: FederatedTemperature
    evaluation: RoundEvaluation | None
    held_out: Mapping[int, HeldOut]
    held_out_fraction: float
    seconds: float = 0.0

    @property
    def held_out_samples(self) -> int:
        return sum(d.size for d in self.held_out.values())

    def summary(self, uncalibrated: Mapping[str, Any]) -> dict[str, Any]:
        """``summary["calibration"]``: T, the step's costs and both sets of figures."""
        search, fit = self.search, self.search.fit
        out: dict[str, Any] = {
            "method": "temperature",
            "predictive": PREDICTIVE,
            "held_out_fraction": self.held_out_fraction,
            "held_out_samples": self.held_out_samples,
            "participants": search.participants,
            "temperature": None if fit is None else fit.temperature,
            "log_temperature": None if fit is None else fit.log_temperature,
            "at_bound": None if fit is None else fit.at_bound,
            "flat": None if fit is None else fit.flat,
            "bounds": list(TEMPERATURE_BOUNDS if fit is None else fit.bounds),
            "held_out_nll_before": None if fit is None else fit.nll_at_one,
            "held_out_nll_after": None if fit is None else fit.nll,
            "steps": search.steps,
            "restarts": search.restarts,
            "bytes_up": search.bytes_up,
            "bytes_down": search.bytes_down,
            "floats_up": search.floats_up,
            "floats_down": search.floats_down,
            "rejections": search.rejections,
            "error": search.error,
            "seconds": self.seconds,
            "uncalibrated": {k: uncalibrated[k] for k in _FIGURES if k in uncalibrated},
            "calibrated": None,
        }
        if self.evaluation is not None:
            figures = self.evaluation.headline()
            out["calibrated"] = {**{k: figures[k] for k in _FIGURES},
                                 "per_client": self.evaluation.per_client}
        return out


_FIGURES = ("accuracy", "accuracy_pooled", "ece", "mce", "brier", "nll", "ece_client_mean",
            "nll_client_mean")


def calibrate_run(
    strategy: Any,
    clients: Sequence[Any],
    held_out: Mapping[int, HeldOut],
    broadcast: Message,
    *,
    spec: CalibrationSpec,
    n_bins: int,
    states: Mapping[int, Any] | None = None,
    keys: KeyRing | None = None,
) -> CalibrationOutcome:
    """The step in this process (`calibrate_phase` over
    `bayesfl.engine.phases.InProcessPhases`), after a run's last round: ``strategy``
    is the client half (it validates the evaluations too: both halves share the name and the
    predictives); ``clients`` hold ``client_id``, ``config``, ``data`` and ``state`` (the
    simulator's `SimulatedClient` s), ``states`` their final states
    where they differ (personalised)."""
    sites = {c.client_id: Site(
        c.client_id, strategy, c.config,
        c.state if states is None else states.get(c.client_id, c.state), broadcast, c.data,
        held_out.get(c.client_id), n_bins=n_bins,
        server_key=None if keys is None else keys.server_key,
        client_key=None if keys is None else keys.client_key(c.client_id)) for c in clients}
    return calibrate_phase(InProcessPhases(sites, keys), list(sites), held_out, spec=spec,
                           server=strategy, n_bins=n_bins,
                           num_test={c.client_id: c.data.num_test for c in clients})


__all__ = [
    "DEFAULT_HELD_OUT_FRACTION",
    "METHODS",
    "PROPOSAL",
    "PROPOSAL_SCHEMA",
    "PROTOCOL",
    "REPLY_SCHEMA",
    "RESULT",
    "RESULT_SCHEMA",
    "CalibrationOutcome",
    "CalibrationSpec",
    "FederatedTemperature",
    "HeldOut",
    "TemperatureClient",
    "calibrate_phase",
    "calibrate_run",
    "calibrated",
    "client_evaluation",
    "client_reply",
    "federated_temperature_search",
    "hold_out",
    "parse_calibrate",
    "reply_problem",
    "temperature_of",
    "temperature_search_over",
]
