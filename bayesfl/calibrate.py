"""Federated temperature scaling: the optional final step of a run (``calibrate="temperature"``).

After the last round every client holds the headline predictive (for posterior strategies the
posterior predictive: *probabilities*, not logits). Temperature scaling of probabilities is
``p^(1/T)`` renormalised, i.e. ``softmax(log p / T)`` with ``log max(p, 1e-12)``
(:func:`calibration.apply_temperature`); one T is shared by all clients and fitted to minimise
the NLL summed over every client's held-out data, without any prediction leaving a client:

* **Held-out data.** With ``calibrate="temperature"`` each client sets aside a share of its
  *training* data before training starts (stratified by label as the train/test split is,
  ``"temperature:FRACTION"``, default :data:`DEFAULT_HELD_OUT_FRACTION`) and trains on the rest.
  Fitting T on data the model was trained on would reward overconfidence (the training NLL
  falls as T -> 0); fitting it on the test data would leave no honest test figure. A client
  with fewer than two training samples holds nothing out and sits the step out.
* **The protocol** (:mod:`calibration.temperature`'s search, driven over messages). The server
  proposes ``s = log T`` (:data:`PROPOSAL_SCHEMA`); every participating client answers with
  four numbers computed on its held-out data: the summed NLL at T, its first and second
  derivatives w.r.t. ``s`` and its sample count (:data:`REPLY_SCHEMA`). The server adds the
  answers and takes a safeguarded Newton step; about 5-10 proposals reach float64 precision,
  and the result equals centralised temperature scaling on the pooled held-out data up to
  float rounding. Finally it broadcasts T (:data:`RESULT_SCHEMA`) to every client, which
  applies it to its own predictive.
* **Messages** are :class:`bayesfl.messages.Message` s under the header strategy
  :data:`PROTOCOL`, encoded and decoded like every round's, and counted in bytes (up and down).
  A reply is validated on receipt: its schema, then the bounds any honest reply satisfies
  (:func:`reply_problem`: the NLL and its derivatives of floored log-probabilities are bounded
  by the floor's spread at T) and a sample count that stays the same. A client whose reply
  fails is dropped, the reason logged, and the search starts again over the others (the
  objective changed); the run never crashes on it. A client can still bias T within those
  bounds: the step trusts its participants as much as the aggregation of statistics does.

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

import numpy as np
import torch
from torch import Tensor

from bayesfl.data.clients import ClientData, stratified_split
from bayesfl.errors import BayesFLError, ConfigError, MessageRejected
from bayesfl.evaluation import RoundEvaluation, merge_evaluations
from bayesfl.executor import SimulatedClient
from bayesfl.messages import Header, KeyRing, Message, TensorSpec, decode, encode, validate
from bayesfl.strategies.base import PREDICTIVE, ClientState, Evaluation, Strategy
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

METHODS = ("temperature",)
"""Calibration steps a run can end with."""
PROTOCOL = "temperature-scaling"
"""Header ``strategy`` of the calibration step's messages."""
DEFAULT_HELD_OUT_FRACTION = 0.2
"""Share of each client's training data held out to fit T, unless the spec gives one."""

PROPOSAL_SCHEMA = {"log_temperature": TensorSpec((1,), torch.float64)}
"""Server -> clients: the proposed ``s = log T``."""
REPLY_SCHEMA = {"nll_derivatives": TensorSpec((3,), torch.float64),
                "num_samples": TensorSpec((1,), torch.int64)}
"""Client -> server: (summed NLL, dNLL/ds, d2NLL/ds2) at the proposal, and the sample count."""
RESULT_SCHEMA = {"temperature": TensorSpec((1,), torch.float64)}
"""Server -> every client: the fitted T."""

_REPLY_MAX_BYTES = 64 * 1024  # a reply is four numbers and a header
_SLACK = 1e-9  # relative float rounding allowed on the bounds of an honest reply

UploadHook = Callable[[int, int, bytes], bytes]
"""``hook(step, client_id, encoded_reply) -> bytes delivered`` (tests, attacks)."""


# ---- configuration ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationSpec:
    """A parsed ``calibrate`` setting: the method and the held-out share of training data."""

    method: str
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION


def parse_calibrate(value: Any) -> CalibrationSpec | None:
    """``None`` (no calibration step) or ``"temperature"`` / ``"temperature:FRACTION"``.

    Raises:
        ConfigError: another method, or a fraction outside (0, 1).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"calibrate must be None or one of {METHODS} (optionally "
                          f"'temperature:FRACTION'), got {value!r}")
    method, sep, fraction_text = value.strip().partition(":")
    if method not in METHODS:
        raise ConfigError(f"unknown calibrate method {method!r}; valid: {', '.join(METHODS)} "
                          "(e.g. 'temperature' or 'temperature:0.2')")
    if not sep:
        return CalibrationSpec(method)
    try:
        fraction = float(fraction_text)
    except ValueError:
        fraction = math.nan
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"the held-out fraction in calibrate={value!r} must be a number in "
                          "(0, 1), e.g. 'temperature:0.2'")
    return CalibrationSpec(method, fraction)


# ---- held-out data ------------------------------------------------------------------------------
@dataclass(eq=False)
class HeldOut:
    """A client's held-out share of its training data: x (n, ...), y (n,), pooled indices."""

    x: Tensor
    y: Tensor
    indices: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.y.shape[0])


def hold_out(
    clients: Sequence[ClientData], fraction: float, seed: int
) -> tuple[list[ClientData], dict[int, HeldOut]]:
    """Split every client's training data into what it trains on and what it holds out.

    Stratified by label with :func:`bayesfl.data.clients.stratified_split` (the rule of the
    train/test split: ``clip(round(n * fraction), 1, n - 1)`` samples); a client with fewer
    than 2 training samples keeps them all. Seeded by ``seed`` on a stream of its own.

    Returns:
        (the clients with the reduced training data, client id -> its held-out data).
    """
    rng = np.random.default_rng([seed, 12])  # independent of the partition and test split
    kept: list[ClientData] = []
    held: dict[int, HeldOut] = {}
    for data in clients:
        if data.num_train < 2:
            kept.append(data)
            continue
        train, out = stratified_split(data.train_y.cpu().numpy(), fraction, rng)
        train, out = np.sort(train), np.sort(out)
        indices = data.train_indices
        kept.append(ClientData(
            client_id=data.client_id,
            train_x=data.train_x[train], train_y=data.train_y[train],
            test_x=data.test_x, test_y=data.test_y,
            train_indices=None if indices is None else indices[train],
            test_indices=data.test_indices))
        held[data.client_id] = HeldOut(data.train_x[out], data.train_y[out],
                                       None if indices is None else indices[out])
    return kept, held


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
            MessageRejected: the proposal does not follow :data:`PROPOSAL_SCHEMA`.
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
        MessageRejected: not a :data:`RESULT_SCHEMA` message, or T not in (0, inf).
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


class _Restart(Exception):  # noqa: N818 - control flow: some participant was dropped
    pass


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
    """:func:`federated_temperature_search` with the clients reached through ``ask`` (the
    Flower ServerApp asks its SuperNodes); the same validation, restarts and byte counts."""
    outcome = FederatedTemperature(fit=None, participants=list(client_ids))
    active = list(client_ids)
    while active:
        try:
            outcome.fit = _search_once(ask, active, num_classes, bounds, upload_hook, keys,
                                       outcome)
            outcome.participants = list(active)
            return outcome
        except _Restart:
            dropped = {r["client_id"] for r in outcome.rejections}
            active = [c for c in active if c not in dropped]
            outcome.restarts += 1
        except CalibrationError as err:
            outcome.error = str(err)
            return outcome
    outcome.participants = []
    outcome.error = "no client with held-out data took part (or every reply was rejected)"
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
        outcome.steps += 1
        outcome.bytes_down += len(down) * len(active)
        outcome.floats_down += len(active)
        answers = ask(step, down, list(active))
        points: list[NLLDerivatives] = []
        rejected = False
        for cid in active:
            client_key = None if keys is None else keys.client_key(cid)
            up = answers.get(cid, "no reply")
            if isinstance(up, str):
                outcome.rejections.append({"step": step, "client_id": cid, "reason": up})
                rejected = True
                continue
            if upload_hook is not None:
                up = upload_hook(step, cid, up)
            outcome.bytes_up += len(up) if isinstance(up, bytes | bytearray) else 0
            outcome.floats_up += 4
            try:
                point = _received_reply(up, step, cid, s, num_classes, counts.get(cid),
                                        client_key)
            except MessageRejected as err:
                outcome.rejections.append({"step": step, "client_id": cid,
                                           "reason": err.reason})
                rejected = True
                continue
            counts[cid] = point.count
            points.append(point)
        if rejected:
            raise _Restart
        total = points[0]
        for point in points[1:]:
            total = total + point
        try:
            s = search.send(total)
        except StopIteration as done:
            return done.value


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
    strategy: Strategy,
    clients: Sequence[SimulatedClient],
    held_out: Mapping[int, HeldOut],
    broadcast: Message,
    *,
    spec: CalibrationSpec,
    n_bins: int,
    states: Mapping[int, ClientState] | None = None,
    upload_hook: UploadHook | None = None,
    keys: KeyRing | None = None,
) -> CalibrationOutcome:
    """Run the step after a simulation's last round (``strategy``: the client half).

    Every client with held-out data predicts it with its final predictive (``states`` where
    given, e.g. personalised) and takes part in the search; then the server broadcasts T and
    every client evaluates its temperature-scaled predictive on its test data.
    """
    start = time.perf_counter()
    participants: list[TemperatureClient] = []
    for client in clients:
        data = held_out.get(client.client_id)
        if data is None or data.size == 0:
            continue
        probs = _predict(strategy, client, states, broadcast, data.x)
        try:
            participants.append(TemperatureClient.from_probabilities(client.client_id, probs,
                                                                     data.y))
        except CalibrationError:  # an invalid predictive: the client sits the step out
            continue
    search = federated_temperature_search(participants, strategy.num_classes,
                                          upload_hook=upload_hook, keys=keys)
    if search.fit is None:
        return CalibrationOutcome(search, None, held_out, spec.held_out_fraction,
                                  time.perf_counter() - start)
    server_key = None if keys is None else keys.server_key
    result = encode(result_message(search.steps, search.fit.temperature), key=server_key)
    search.bytes_down += len(result) * len(clients)
    search.floats_down += len(clients)
    evaluations = []
    for client in clients:
        temperature = temperature_of(decode(result, key=server_key))  # what it receives
        probs = calibrated(_predict(strategy, client, states, broadcast, client.data.test_x),
                           temperature)
        labels = client.data.test_y.cpu()
        accumulator = Accumulator(n_bins).update(probs.cpu(), labels)
        evaluations.append(Evaluation(client.client_id, {PREDICTIVE: accumulator},
                                      {PREDICTIVE: probs.cpu()}, labels))
    return CalibrationOutcome(search, merge_evaluations(evaluations), held_out,
                              spec.held_out_fraction, time.perf_counter() - start)


@torch.no_grad()
def _predict(strategy: Strategy, client: SimulatedClient,
             states: Mapping[int, ClientState] | None, broadcast: Message, x: Tensor) -> Tensor:
    """The client's headline predictive (n, C) float64 of inputs x (n, ...)."""
    state = client.state if states is None else states.get(client.client_id, client.state)
    return strategy.predict(client.config, state, broadcast, x)[PREDICTIVE].to(torch.float64)


__all__ = [
    "DEFAULT_HELD_OUT_FRACTION",
    "METHODS",
    "PROPOSAL_SCHEMA",
    "PROTOCOL",
    "REPLY_SCHEMA",
    "RESULT_SCHEMA",
    "CalibrationOutcome",
    "CalibrationSpec",
    "FederatedTemperature",
    "HeldOut",
    "TemperatureClient",
    "calibrate_run",
    "calibrated",
    "federated_temperature_search",
    "hold_out",
    "parse_calibrate",
    "reply_problem",
    "temperature_of",
    "temperature_search_over",
]
