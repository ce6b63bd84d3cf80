"""Federated conformal prediction sets: the optional final step of a run (``conformal=``).

``conformal="aps:0.1"`` ends a run by giving every client prediction sets that hold the true
label with probability >= 90% (`calibration.conformal`), from a threshold calibrated over
*all* clients' held-out rows without any client's scores leaving it:

* **Held-out rows.** As for ``calibrate`` (`bayesfl.calibrate`, which this step shares the
  hold-out with), every client sets aside a stratified share of its *training* data before
  training (default 0.2, or the share ``calibrate`` names) and trains on the rest; the
  conformal guarantee needs calibration rows the model never saw.
* **The threshold** (``SCORE:ALPHA[:METHOD]``; score ``lac``, ``aps``, ``aps-randomized``,
  ``raps``, ``raps-randomized``): ``exact`` (the default) runs
  `calibration.federated_conformal.exact_threshold_search` over messages: the server
  proposes thresholds (`PROPOSAL_SCHEMA`), every client answers how many of its held-out
  scores lie at or below each (`REPLY_SCHEMA`), and after about 17 steps the threshold
  is the pooled split-conformal threshold of every held-out row, bit for bit. ``one-shot`` is
  FedCP-QQ (`calibration.federated_conformal.quantile_of_quantiles`): one request
  (``alpha`` and the number of clients), one reply per client of one local quantile and its
  ranks (`ONE_SHOT_REPLY_SCHEMA`), with the coverage bound the formula states *for
  exchangeable clients only* (under label skew it can fail). ``sketch`` is one request too,
  with the exact method's guarantee whatever the clients' heterogeneity
  (`calibration.federated_conformal.sketch_threshold`): every client sends
  `SKETCH_SIZE` order statistics of its held-out scores
  at fixed ranks and its row count (`SKETCH_REPLY_SCHEMA`, under 1 KB), and the server
  takes a threshold at or above the pooled one, over-covering by at most what the sketch's
  rank gaps allow (reported as ``coverage_upper_bound``). All three run
  for the headline predictive and, for posterior strategies, its MAP plug-in (rows of every
  tensor: `PREDICTIVES`; a client without a plug-in answers a count of 0 for it).
* **Evaluation.** The server broadcasts the thresholds (`RESULT_SCHEMA`); every client
  forms its sets on its own *test* rows and returns mergeable counts (rows, covered, the
  histogram of set sizes: `calibration.conformal.CoverageAccumulator`;
  `EVALUATION_SCHEMA`). The summary reports coverage and mean set size pooled *and per
  client*: the guarantee is marginal over every client's rows, and a heterogeneous client can
  sit below 1 - alpha while the pooled figure looks right.
* **Messages** are `bayesfl.messages.Message` s under the header strategy
  `PROTOCOL`, encoded, decoded and counted in bytes like every round's (HMAC-signed with
  the run's keys when it authenticates). A reply is validated on receipt: its schema, then
  what any honest reply satisfies (counts in [0, n] that never fall as the threshold rises, an
  ``n`` that does not change; a local quantile inside the score's range with ranks that fit).
  A client whose reply fails is dropped, the reason logged, and the search restarts over the
  others; the run never crashes on it.

The step is a final phase (`bayesfl.engine.phases`), written once for every transport:
`conformal_phase` on the server, `client_reply` (`REQUEST`) and
`client_evaluation` (`RESULT`) on each client.

The score's randomisation (``*-randomized``) draws one ``u`` per row from a generator seeded by
the run's seed and the client id, so a run reproduces its sets.
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

from bayesfl.conformal_spec import METHODS, SCORE_NAMES, ConformalSpec, parse_conformal
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
from bayesfl.errors import DataError, MessageRejected
from bayesfl.messages import Header, KeyRing, Message, TensorSpec, decode, encode, validate
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE, derived_seed
from calibration.conformal import (
    ConformalScore,
    CoverageAccumulator,
    all_label_scores,
)
from calibration.federated_conformal import (
    DEFAULT_PROBES,
    SKETCH_SIZE,
    LocalQuantile,
    ScoreSketch,
    ThresholdCounts,
    counts_problem,
    exact_threshold_search,
    one_shot_ranks,
    quantile_of_quantiles,
    sketch_ranks,
    sketch_threshold,
)

PROTOCOL = "conformal"
"""Header ``strategy`` of the step's messages."""
PREDICTIVES = (PREDICTIVE, MAP_PLUGIN)
"""The predictives a message's rows stand for, in order."""
P = len(PREDICTIVES)

PROPOSAL_SCHEMA = {"thresholds": TensorSpec((P, DEFAULT_PROBES), torch.float64, finite=False)}
"""Server -> clients (exact): thresholds to count at, one row per predictive."""
REPLY_SCHEMA = {"at_most": TensorSpec((P, DEFAULT_PROBES), torch.int64),
                "count": TensorSpec((P,), torch.int64)}
"""Client -> server (exact): scores <= each threshold, and the held-out rows per predictive."""
ONE_SHOT_REQUEST_SCHEMA = {"alpha": TensorSpec((1,), torch.float64),
                           "num_clients": TensorSpec((1,), torch.int64)}
"""Server -> clients (one shot): the level and the number of clients m."""
ONE_SHOT_REPLY_SCHEMA = {"local_quantile": TensorSpec((P, 3), torch.float64, finite=False)}
"""Client -> server (one shot): per predictive its local quantile, l and n (whole numbers,
exact in float64; one tensor keeps the message under 1 KB)."""
SKETCH_REQUEST_SCHEMA = {"sketch_size": TensorSpec((1,), torch.int64)}
"""Server -> clients (sketch): the sketch size ``K`` (`SKETCH_SIZE`)."""
SKETCH_REPLY_SCHEMA = {"sketch": TensorSpec((P, SKETCH_SIZE), torch.float64, finite=False),
                       "count": TensorSpec((P,), torch.int64)}
"""Client -> server (sketch): per predictive its order statistics at
`sketch_ranks` ``(n, K)`` (NaN past ``min(K, n)``)
and ``n``."""
RESULT_SCHEMA = {"thresholds": TensorSpec((P,), torch.float64, finite=False)}
"""Server -> every client: the thresholds (NaN: no threshold for that predictive)."""
EVALUATION_SCHEMA = {"counts": TensorSpec((P, 2), torch.int64),
                     "size_counts": TensorSpec((P, None), torch.int64)}
"""Client -> server: per predictive (rows, covered) and the set-size histogram (C + 1,)."""

DEFAULT_HELD_OUT_FRACTION = 0.2
_REPLY_MAX_BYTES = 64 * 1024
_SLACK = 1e-9  # float rounding allowed on a score's range

Ask = Callable[[int, bytes, Sequence[int]], Mapping[int, "bytes | str"]]
"""``ask(step, encoded_request, client_ids) -> client id -> encoded reply, or why none came``."""


def score_upper_bound(score: ConformalScore, num_classes: int) -> float:
    """Largest score any probabilities give: 1 (LAC, APS), ``1 + lam (C - k_reg)^+`` (RAPS)."""
    if score.kind == "raps":
        return 1.0 + score.lam * max(0, num_classes - score.k_reg)
    return 1.0


# ---- the client half ----------------------------------------------------------------------------
@dataclass(eq=False)
class ConformalClient:
    """One client's half of the step: the scores of its held-out rows, never sent anywhere.

    Attributes:
        client_id: the client.
        scores: per predictive (`PREDICTIVES`) its (n,) float64 held-out scores, or None
            for a predictive the client does not have.
        spec: the step's settings.
        seed: seeds the randomised score's ``u`` (calibration and test rows draw apart).
    """

    client_id: int
    scores: list[Tensor | None]
    spec: ConformalSpec
    seed: int

    @classmethod
    def from_probabilities(cls, client_id: int, probs: Mapping[str, Tensor], labels: Tensor,
                           spec: ConformalSpec, run_seed: int) -> ConformalClient:
        """Scores of the held-out ``probs`` (key -> (n, C)) at their ``labels`` (n,)."""
        seed = derived_seed(run_seed, 45, client_id)
        generator = torch.Generator().manual_seed(seed)
        scores: list[Tensor | None] = []
        for key in PREDICTIVES:
            if key not in probs:
                scores.append(None)
                continue
            matrix = all_label_scores(probs[key].cpu(), spec.score, generator=generator)
            scores.append(matrix.gather(1, labels.cpu().long()[:, None])[:, 0])
        return cls(client_id, scores, spec, seed)

    def reply(self, request: Message) -> Message:
        """The answer to a proposal (exact) or to the one-shot request.

        Raises:
            MessageRejected: the request follows neither schema.
        """
        header = Header(PROTOCOL, request.header.round, self.client_id, "up")
        if "thresholds" in request.tensors:
            validate(request, PROPOSAL_SCHEMA, strategy=PROTOCOL, direction="down")
            at_most = torch.zeros(P, DEFAULT_PROBES, dtype=torch.int64)
            count = torch.zeros(P, dtype=torch.int64)
            for i, s in enumerate(self.scores):
                if s is not None:
                    answer = ThresholdCounts.of(s, request.tensors["thresholds"][i])
                    at_most[i], count[i] = answer.at_most, answer.count
            return Message(header, {"at_most": at_most, "count": count})
        if "sketch_size" in request.tensors:
            validate(request, SKETCH_REQUEST_SCHEMA, strategy=PROTOCOL, direction="down")
            if int(request.tensors["sketch_size"][0]) != SKETCH_SIZE:
                raise MessageRejected(f"sketch request must ask for {SKETCH_SIZE} values, got "
                                      f"{int(request.tensors['sketch_size'][0])}")
            sketch = torch.full((P, SKETCH_SIZE), math.nan, dtype=torch.float64)
            count = torch.zeros(P, dtype=torch.int64)
            for i, s in enumerate(self.scores):
                if s is not None:
                    local = ScoreSketch.of(s, SKETCH_SIZE)
                    sketch[i, :local.values.shape[0]] = local.values
                    count[i] = local.count
            return Message(header, {"sketch": sketch, "count": count})
        validate(request, ONE_SHOT_REQUEST_SCHEMA, strategy=PROTOCOL, direction="down")
        alpha = float(request.tensors["alpha"][0])
        m = int(request.tensors["num_clients"][0])
        if not 0 < alpha < 1 or m < 1:
            raise MessageRejected(f"one-shot request needs alpha in (0, 1) and m >= 1, got "
                                  f"{alpha}, {m}")
        upload = torch.zeros(P, 3, dtype=torch.float64)
        upload[:, 0] = math.nan
        for i, s in enumerate(self.scores):
            if s is not None:
                local = LocalQuantile.of(s, alpha, m)
                upload[i] = torch.tensor([local.value, local.ell, local.count],
                                         dtype=torch.float64)
        return Message(header, {"local_quantile": upload})

    def evaluate(self, result: Message, test_probs: Mapping[str, Tensor], test_labels: Tensor,
                 num_classes: int) -> Message:
        """Sets on the test rows at the broadcast thresholds; the coverage counts as a reply
        (`EVALUATION_SCHEMA`)."""
        thresholds = thresholds_of(result)
        generator = torch.Generator().manual_seed(derived_seed(self.seed, 1))
        counts = torch.zeros(P, 2, dtype=torch.int64)
        sizes = torch.zeros(P, num_classes + 1, dtype=torch.int64)
        for i, key in enumerate(PREDICTIVES):
            if key not in test_probs or math.isnan(thresholds[i]):
                continue
            scores = all_label_scores(test_probs[key].cpu(), self.spec.score,
                                      generator=generator)
            acc = CoverageAccumulator(num_classes).update(scores <= thresholds[i],
                                                          test_labels.cpu())
            counts[i] = torch.tensor([acc.count, acc.covered])
            sizes[i] = acc.size_counts
        return Message(Header(PROTOCOL, result.header.round, self.client_id, "up"),
                       {"counts": counts, "size_counts": sizes})


def thresholds_of(result: Message) -> list[float]:
    """The thresholds of a result broadcast (client side); NaN for a predictive without one.

    Raises:
        MessageRejected: not a `RESULT_SCHEMA` message, or a negative threshold.
    """
    validate(result, RESULT_SCHEMA, strategy=PROTOCOL, direction="down")
    values = [float(v) for v in result.tensors["thresholds"]]
    if any(v < 0 for v in values):  # every score is >= 0
        raise MessageRejected(f"conformal thresholds must be >= 0, got {values}")
    return values


# ---- the server half ----------------------------------------------------------------------------
@dataclass
class ConformalSearch:
    """The outcome of the threshold step (both methods).

    Attributes:
        thresholds: per predictive the threshold (inf: every label; None: nobody has it).
        details: per predictive what the method reports (rank, rows, steps or coverage bound).
        participants: client ids whose replies the final thresholds used.
        steps: requests sent (a restart adds its own).
        restarts: searches started again after a client was dropped.
        bytes_up, bytes_down: encoded bytes of every reply / of every request times its
            recipients: the calibration of the threshold.
        floats_up, floats_down: the same as numbers.
        rejections: ``{"step", "client_id", "reason"}`` per dropped client.
        error: why no threshold was found, or None.
        evaluation_bytes_up, evaluation_bytes_down: the evaluation after it (the thresholds
            down, the coverage counts up), counted apart.
    """

    thresholds: list[float | None]
    details: list[dict[str, Any]]
    participants: list[int]
    steps: int = 0
    restarts: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    floats_up: int = 0
    floats_down: int = 0
    rejections: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    evaluation_bytes_up: int = 0
    evaluation_bytes_down: int = 0


def _message(step: int, tensors: dict[str, Tensor]) -> Message:
    return Message(Header(PROTOCOL, step, -1, "down"), tensors)


def _received(data: Any, schema: dict, step: int, client_id: int, key: bytes | None) -> Message:
    message = decode(data, max_bytes=_REPLY_MAX_BYTES, key=key)
    validate(message, schema, strategy=PROTOCOL, round=step, direction="up",
             client_id=client_id)
    return message


def conformal_search_over(
    ask: Ask, client_ids: Sequence[int], spec: ConformalSpec, num_classes: int, *,
    upload_hook: UploadHook | None = None, keys: KeyRing | None = None,
) -> ConformalSearch:
    """The server's threshold step with the clients reached through ``ask`` (in this process
    or over a transport's channel): validation, restarts and byte counts as the module says."""
    outcome = ConformalSearch([None] * P, [{} for _ in range(P)], list(client_ids))
    once = {"exact": _exact_once, "one-shot": _one_shot_once,
            "sketch": _sketch_once}[spec.method]
    with_restarts(client_ids, outcome, lambda active: once(
        ask, active, spec, num_classes, upload_hook, keys, outcome))
    return outcome


def _collect(ask: Ask, active: Sequence[int], down: bytes, schema: dict, floats_up: int,
             upload_hook: UploadHook | None, keys: KeyRing | None, outcome: ConformalSearch,
             check: Callable[[int, Message], str | None]) -> dict[int, Message]:
    """One request's validated replies (`bayesfl.engine.phases.search_step`): the
    schema, then ``check``."""
    step = outcome.steps

    def read(cid: int, up: Any) -> Message:
        message = _received(up, schema, step, cid,
                            None if keys is None else keys.client_key(cid))
        problem = check(cid, message)
        if problem is not None:
            raise MessageRejected(problem, client_id=cid)
        return message

    return search_step(ask, down, active, outcome, read, floats_up=floats_up,
                       upload_hook=upload_hook)


def _exact_once(ask: Ask, active: Sequence[int], spec: ConformalSpec, num_classes: int,
                upload_hook: UploadHook | None, keys: KeyRing | None,
                outcome: ConformalSearch) -> None:
    server_key = None if keys is None else keys.server_key
    upper = score_upper_bound(spec.score, num_classes)
    searches: list[Any] = [None] * P
    proposals: list[Tensor | None] = [None] * P
    counts: dict[tuple[int, int], int] = {}
    first = True
    while True:
        rows = torch.full((P, DEFAULT_PROBES), math.inf, dtype=torch.float64)
        for i in range(P):
            if proposals[i] is not None:
                rows[i, :proposals[i].shape[0]] = proposals[i]
        step = outcome.steps
        down = encode(_message(step, {"thresholds": rows}), key=server_key)
        outcome.floats_down += P * DEFAULT_PROBES * len(active)

        def check(cid: int, message: Message, rows: Tensor = rows) -> str | None:
            for i in range(P):
                n = int(message.tensors["count"][i])
                if n == 0:
                    if bool((message.tensors["at_most"][i] != 0).any()):
                        return f"counts without rows for {PREDICTIVES[i]}"
                    continue
                answer = ThresholdCounts(rows[i], message.tensors["at_most"][i], n)
                problem = counts_problem(answer, counts.get((cid, i)))
                if problem is not None:
                    return f"{PREDICTIVES[i]}: {problem}"
                # every honest score lies in [0, upper]: counts at thresholds outside agree
                below = answer.at_most[rows[i] < 0]
                above = answer.at_most[rows[i] >= upper * (1 + _SLACK)]
                if bool((below != 0).any()) or bool((above != n).any()):
                    return f"{PREDICTIVES[i]}: counts outside the score's range [0, {upper:g}]"
            return None

        replies = _collect(ask, active, down, REPLY_SCHEMA, P * (DEFAULT_PROBES + 1),
                           upload_hook, keys, outcome, check)
        for cid, message in replies.items():
            for i in range(P):
                counts.setdefault((cid, i), int(message.tensors["count"][i]))
        totals: list[ThresholdCounts | None] = [None] * P
        for i in range(P):
            n = sum(int(replies[c].tensors["count"][i]) for c in active)
            if first:  # the rows of +inf told every client's n: a search per predictive held
                if n > 0:
                    searches[i] = exact_threshold_search(spec.alpha)
                    infinity = next(searches[i])
                    totals[i] = ThresholdCounts(infinity, torch.tensor([n]), n)
            elif proposals[i] is not None:
                width = proposals[i].shape[0]
                at_most = torch.zeros(width, dtype=torch.int64)
                for c in active:
                    at_most += replies[c].tensors["at_most"][i, :width]
                totals[i] = ThresholdCounts(proposals[i], at_most, n)
        first = False
        for i in range(P):
            if totals[i] is None:
                continue
            try:
                proposals[i] = searches[i].send(totals[i])
            except StopIteration as finished:
                result = finished.value
                proposals[i] = None
                outcome.thresholds[i] = result.threshold
                outcome.details[i] = {"rank": result.rank, "held_out_rows": result.count,
                                      "search_steps": outcome.steps}
        if all(p is None for p in proposals):
            return


def _one_shot_once(ask: Ask, active: Sequence[int], spec: ConformalSpec, num_classes: int,
                   upload_hook: UploadHook | None, keys: KeyRing | None,
                   outcome: ConformalSearch) -> None:
    server_key = None if keys is None else keys.server_key
    upper = score_upper_bound(spec.score, num_classes)
    step = outcome.steps
    request = _message(step, {"alpha": torch.tensor([spec.alpha], dtype=torch.float64),
                              "num_clients": torch.tensor([len(active)], dtype=torch.int64)})
    down = encode(request, key=server_key)
    outcome.floats_down += 2 * len(active)

    def check(cid: int, message: Message) -> str | None:
        for i in range(P):
            value, ell_f, n_f = (float(v) for v in message.tensors["local_quantile"][i])
            if not (ell_f.is_integer() and n_f.is_integer()) or n_f > 2**53:
                return f"{PREDICTIVES[i]}: ranks must be whole numbers, got {ell_f}, {n_f}"
            ell, n = int(ell_f), int(n_f)
            if n == 0 and ell == 0:
                if not math.isnan(value):
                    return f"{PREDICTIVES[i]}: a quantile without rows"
                continue
            if n < 1 or not 1 <= ell <= n + 1:
                return f"{PREDICTIVES[i]}: ranks (l = {ell}, n = {n}) do not fit"
            if (ell > n) != (value == math.inf):
                return f"{PREDICTIVES[i]}: only a rank beyond n gives an infinite quantile"
            expected = one_shot_ranks(len(active), n, spec.alpha)
            if (expected[0] if expected else n + 1) != ell:
                return f"{PREDICTIVES[i]}: rank l = {ell} is not the rule's for n = {n}"
            if ell <= n and not 0.0 <= value <= upper * (1 + _SLACK):
                return f"{PREDICTIVES[i]}: local quantile {value} outside [0, {upper:g}]"
        return None

    replies = _collect(ask, active, down, ONE_SHOT_REPLY_SCHEMA, 3 * P, upload_hook,
                       keys, outcome, check)
    for i in range(P):
        rows = [replies[c].tensors["local_quantile"][i] for c in active]
        uploads = [LocalQuantile(float(r[0]), int(r[1]), int(r[2])) for r in rows
                   if int(r[2]) > 0]
        if not uploads:
            continue
        result = quantile_of_quantiles(uploads, spec.alpha)
        outcome.thresholds[i] = result.threshold
        outcome.details[i] = {"rank": result.rank, "coverage_bound": result.coverage_bound,
                              "clients": result.clients,
                              "held_out_rows": sum(u.count for u in uploads)}


def _sketch_once(ask: Ask, active: Sequence[int], spec: ConformalSpec, num_classes: int,
                 upload_hook: UploadHook | None, keys: KeyRing | None,
                 outcome: ConformalSearch) -> None:
    server_key = None if keys is None else keys.server_key
    upper = score_upper_bound(spec.score, num_classes)
    request = _message(outcome.steps, {"sketch_size": torch.tensor([SKETCH_SIZE])})
    down = encode(request, key=server_key)
    outcome.floats_down += len(active)

    def check(cid: int, message: Message) -> str | None:
        for i in range(P):
            n = int(message.tensors["count"][i])
            row = message.tensors["sketch"][i]
            if n == 0:
                if not bool(torch.isnan(row).all()):
                    return f"{PREDICTIVES[i]}: a sketch without rows"
                continue
            if n < 0:
                return f"{PREDICTIVES[i]}: count must be >= 0, got {n}"
            width = len(sketch_ranks(n, SKETCH_SIZE))
            values, padding = row[:width], row[width:]
            if not bool(torch.isnan(padding).all()) or not bool(torch.isfinite(values).all()):
                return (f"{PREDICTIVES[i]}: a sketch of {n} rows holds {width} finite values "
                        "then NaN")
            if bool((torch.diff(values) < 0).any()):
                return f"{PREDICTIVES[i]}: sketch values must be non-decreasing"
            if not (float(values[0]) >= 0.0 and float(values[-1]) <= upper * (1 + _SLACK)):
                return f"{PREDICTIVES[i]}: sketch values outside [0, {upper:g}]"
        return None

    replies = _collect(ask, active, down, SKETCH_REPLY_SCHEMA, P * (SKETCH_SIZE + 1),
                       upload_hook, keys, outcome, check)
    for i in range(P):
        sketches = []
        for c in active:
            n = int(replies[c].tensors["count"][i])
            if n > 0:
                width = len(sketch_ranks(n, SKETCH_SIZE))
                sketches.append(ScoreSketch(replies[c].tensors["sketch"][i, :width].clone(),
                                            n, SKETCH_SIZE))
        if not sketches:
            continue
        result = sketch_threshold(sketches, spec.alpha)
        outcome.thresholds[i] = result.threshold
        outcome.details[i] = {"rank": result.rank, "held_out_rows": result.count,
                              "clients": result.clients, "sketch_slack": result.slack,
                              "coverage_bound": result.coverage_lower_bound,
                              "coverage_upper_bound": result.coverage_upper_bound}


def result_message(step: int, thresholds: Sequence[float | None]) -> Message:
    return _message(step, {"thresholds": torch.tensor(
        [math.nan if t is None else t for t in thresholds], dtype=torch.float64)})


def evaluation_problem(message: Message, num_classes: int) -> str | None:
    """None if a coverage reply is consistent (covered <= rows, sizes sum to the rows)."""
    sizes = message.tensors["size_counts"]
    if sizes.shape[1] != num_classes + 1:
        return f"size histogram has {sizes.shape[1]} bins, expected {num_classes + 1}"
    for i in range(P):
        rows, covered = (int(v) for v in message.tensors["counts"][i])
        if rows < 0 or not 0 <= covered <= rows or bool((sizes[i] < 0).any()) \
                or int(sizes[i].sum()) != rows:
            return f"{PREDICTIVES[i]}: inconsistent coverage counts"
    return None


def evaluation_over(
    ask: Ask, client_ids: Sequence[int], search: ConformalSearch, num_classes: int, *,
    keys: KeyRing | None = None,
) -> tuple[dict[int, list[CoverageAccumulator | None]], list[dict[str, Any]]]:
    """Broadcast the thresholds and collect every client's coverage counts (validated; a bad
    reply is left out and logged). Returns client id -> per predictive its accumulator (None
    where it has no rows), and the rejections."""
    server_key = None if keys is None else keys.server_key
    step = search.steps
    down = encode(result_message(step, search.thresholds), key=server_key)
    search.evaluation_bytes_down += len(down) * len(client_ids)

    def arrived(_: int, up: Any) -> None:
        search.evaluation_bytes_up += len(up)

    def read(cid: int, up: Any) -> list[CoverageAccumulator | None]:
        message = _received(up, EVALUATION_SCHEMA, step, cid,
                            None if keys is None else keys.client_key(cid))
        problem = evaluation_problem(message, num_classes)
        if problem is not None:
            raise MessageRejected(problem, client_id=cid)
        accs: list[CoverageAccumulator | None] = []
        for i in range(P):
            state = {"counts": message.tensors["counts"][i],
                     "size_counts": message.tensors["size_counts"][i]}
            acc = CoverageAccumulator.from_state_dict(state)
            accs.append(acc if acc.count > 0 else None)
        return accs

    return read_answers(ask(step, down, list(client_ids)), client_ids, step, read,
                        arrived=arrived)


# ---- the outcome and its summary ----------------------------------------------------------------
@dataclass
class ConformalOutcome:
    """The conformal step of a run.

    Attributes:
        spec: the setting.
        search: the threshold step.
        coverage: client id -> per predictive its test-row coverage counts (None: none).
        evaluation_rejections: clients whose coverage reply was refused.
        held_out_fraction: the share of training data held out.
        held_out_samples: the held-out rows over all clients.
        seconds: wall-clock time of the step.
    """

    spec: ConformalSpec
    search: ConformalSearch
    coverage: dict[int, list[CoverageAccumulator | None]]
    evaluation_rejections: list[dict[str, Any]]
    held_out_fraction: float
    held_out_samples: int
    num_classes: int
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """``summary["conformal"]``: the setting, the step's costs, and per predictive the
        threshold with coverage and mean set size pooled and per client."""
        search = self.search
        n_clients = max(1, len(search.participants))
        out: dict[str, Any] = {
            "score": self.spec.name, "alpha": self.spec.alpha,
            "target_coverage": 1.0 - self.spec.alpha, "method": self.spec.method,
            "held_out_fraction": self.held_out_fraction,
            "held_out_samples": self.held_out_samples,
            "participants": search.participants, "steps": search.steps,
            "restarts": search.restarts, "bytes_up": search.bytes_up,
            "bytes_down": search.bytes_down,
            "bytes_up_per_client": search.bytes_up / n_clients,
            "floats_up": search.floats_up, "floats_down": search.floats_down,
            "evaluation_bytes_up": search.evaluation_bytes_up,
            "evaluation_bytes_down": search.evaluation_bytes_down,
            "rejections": search.rejections + self.evaluation_rejections,
            "error": search.error, "seconds": self.seconds, "predictives": {},
        }
        for i, key in enumerate(PREDICTIVES):
            if search.thresholds[i] is None:
                continue
            pooled = CoverageAccumulator(self.num_classes)
            per_client = []
            for cid in sorted(self.coverage):
                acc = self.coverage[cid][i]
                if acc is None:
                    continue
                pooled.merge(acc)
                figures = acc.compute()
                per_client.append({"client_id": cid, "count": figures["count"],
                                   "coverage": figures["coverage"],
                                   "mean_set_size": figures["mean_set_size"]})
            figures = pooled.compute()
            covers = [c["coverage"] for c in per_client]
            threshold = search.thresholds[i]
            out["predictives"][key] = {
                "threshold": threshold if math.isfinite(threshold) else "inf",
                **search.details[i], **figures,
                "coverage_client_mean": float(np.mean(covers)) if covers else math.nan,
                "coverage_client_min": float(np.min(covers)) if covers else math.nan,
                "clients_below_target": sum(c < 1 - self.spec.alpha for c in covers),
                "per_client": per_client}
        return out


# ---- the phase, over a transport's channel ----------------------------------------------------
def _scored(site: Site) -> ConformalClient:
    """The client's half: its held-out rows scored once per phase (``site.memo``)."""
    _check_site(site)
    client = site.memo.get(PROTOCOL)
    if client is None:
        held = site.held_out
        if held is None or held.size == 0:
            raise DataError(f"client {site.client_id} holds no conformal calibration rows")
        client = site.memo[PROTOCOL] = ConformalClient.from_probabilities(
            site.client_id, _predictives(site, held.x), held.y, site.conformal, site.seed)
    return client


def _check_site(site: Site) -> None:
    if site.conformal is None:
        raise MessageRejected("this run has no conformal step")


def _predictives(site: Site, x: Tensor) -> dict[str, Tensor]:
    """The client's predictives of `PREDICTIVES` (key -> (n, C) float64, on the CPU)."""
    return {k: v.cpu() for k, v in site.predict(x).items() if k in PREDICTIVES}


def client_reply(site: Site, down: bytes) -> bytes:
    """A client's answer to a threshold proposal or the one-shot request (`REQUEST`),
    from its held-out scores (`ConformalClient.reply`).

    Raises:
        DataError: the client holds no held-out rows.
        MessageRejected: the request follows neither schema.
    """
    return encode(_scored(site).reply(decode(down, key=site.server_key)),
                  key=site.client_key)


def client_evaluation(site: Site, down: bytes) -> bytes:
    """A client's answer to the thresholds (`RESULT`): the coverage counts of its sets
    on its test rows (`ConformalClient.evaluate`; a client without held-out rows
    evaluates too)."""
    _check_site(site)
    client = site.memo.get(PROTOCOL) or ConformalClient(
        site.client_id, [None] * P, site.conformal,
        derived_seed(site.seed, 45, site.client_id))  # the seed from_probabilities takes
    reply = client.evaluate(decode(down, key=site.server_key),
                            _predictives(site, site.data.test_x), site.data.test_y,
                            site.strategy.num_classes)
    return encode(reply, key=site.client_key)


REQUEST = Phase("conformal", client_reply, "query.calibrate", "conformal")
"""The threshold step's request (Flower: ``query.calibrate`` record key ``conformal``)."""
RESULT = Phase("conformal", client_evaluation, "query.calibrate", "conformal_result")
"""The thresholds; the reply is the client's coverage counts (``conformal_result``)."""


def conformal_phase(channel: PhaseChannel, clients: Sequence[int], held_out: Mapping[int, Any],
                    *, spec: ConformalSpec, held_out_fraction: float, num_classes: int,
                    upload_hook: UploadHook | None = None) -> ConformalOutcome:
    """The conformal step over a transport's ``channel`` (module docstring): the threshold
    step over the ``clients`` with held-out rows (`REQUEST`), then every client in
    ``clients`` forms its sets on its test rows and returns its coverage counts
    (`RESULT`), validated and merged."""
    start = time.perf_counter()
    participants = [c for c in clients if c in held_out and held_out[c].size > 0]
    search = conformal_search_over(asker(channel, REQUEST), participants, spec, num_classes,
                                   upload_hook=upload_hook, keys=channel.keys)
    coverage: dict[int, list[CoverageAccumulator | None]] = {}
    rejections: list[dict[str, Any]] = []
    if search.error is None:
        coverage, rejections = evaluation_over(asker(channel, RESULT), list(clients), search,
                                               num_classes, keys=channel.keys)
    return ConformalOutcome(spec, search, coverage, rejections, held_out_fraction,
                            sum(h.size for h in held_out.values()), num_classes,
                            time.perf_counter() - start)


def conformal_run(
    strategy: Any, clients: Sequence[Any], held_out: Mapping[int, Any], broadcast: Message, *,
    spec: ConformalSpec, held_out_fraction: float, run_seed: int,
    states: Mapping[int, Any] | None = None, upload_hook: UploadHook | None = None,
    keys: KeyRing | None = None,
) -> ConformalOutcome:
    """The step in this process (`conformal_phase` over
    `bayesfl.engine.phases.InProcessPhases`), after a run's last round: ``strategy``
    is the client half; ``clients`` hold ``client_id``, ``config``, ``data`` and ``state``
    (the simulator's `SimulatedClient` s), ``states`` their final
    states where they differ (personalised)."""
    sites = {c.client_id: Site(
        c.client_id, strategy, c.config,
        c.state if states is None else states.get(c.client_id, c.state), broadcast, c.data,
        held_out.get(c.client_id), seed=run_seed, conformal=spec,
        server_key=None if keys is None else keys.server_key,
        client_key=None if keys is None else keys.client_key(c.client_id)) for c in clients}
    return conformal_phase(InProcessPhases(sites, keys), list(sites), held_out, spec=spec,
                           held_out_fraction=held_out_fraction,
                           num_classes=strategy.num_classes, upload_hook=upload_hook)


__all__ = [
    "EVALUATION_SCHEMA",
    "METHODS",
    "ONE_SHOT_REPLY_SCHEMA",
    "ONE_SHOT_REQUEST_SCHEMA",
    "PREDICTIVES",
    "PROPOSAL_SCHEMA",
    "PROTOCOL",
    "REPLY_SCHEMA",
    "REQUEST",
    "RESULT",
    "RESULT_SCHEMA",
    "SCORE_NAMES",
    "SKETCH_REPLY_SCHEMA",
    "SKETCH_REQUEST_SCHEMA",
    "ConformalClient",
    "ConformalOutcome",
    "ConformalSearch",
    "ConformalSpec",
    "client_evaluation",
    "client_reply",
    "conformal_phase",
    "conformal_run",
    "conformal_search_over",
    "evaluation_over",
    "parse_conformal",
    "result_message",
    "thresholds_of",
]
