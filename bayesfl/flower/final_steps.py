"""The ServerApp's final steps over ``query.*`` messages, after the summary: the
temperature-scaling step (``calibrate``: :func:`server_calibrate_step`) and the shift
evaluation (run keys ``shift``/``ood``: :func:`server_shift_step`). The conformal step is
:func:`bayesfl.flower.conformal_step.server_conformal_step`.

Each takes the :class:`bayesfl.flower.server_app.FlowerServer` and the final evaluation
broadcast (bytes) every request carries, and reaches the nodes through its channel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from bayesfl.calibrate import CalibrationOutcome, result_message, temperature_search_over
from bayesfl.errors import BayesFLError, MessageRejected
from bayesfl.evaluation import merge_evaluations
from bayesfl.flower.channel import log
from bayesfl.flower.protocol import (
    CALIBRATE,
    MAX_EVALUATION_BYTES,
    SHIFT,
    pack,
    part,
    read_evaluation,
    record_values,
)
from bayesfl.messages import encode
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE


def server_calibrate_step(server: Any, eval_bytes: bytes) -> CalibrationOutcome:
    """The temperature-scaling step (``calibrate``; the run asks for it) over
    ``query.calibrate`` messages: the search on the nodes' held-out data
    (:func:`bayesfl.calibrate.temperature_search_over`), then every connected node evaluates
    its temperature-scaled predictive."""
    spec = server.setup.calibration
    t0 = time.perf_counter()
    channel, held = server.channel, server.setup.held_out
    connected = [c for c in server.training if c in channel.nodes]
    participants = [c for c in connected if c in held and held[c].size > 0]

    def ask(step: int, down: bytes, client_ids: Sequence[int]) -> dict[int, bytes | str]:
        return channel.ask(CALIBRATE, {c: pack(step=step, broadcast=eval_bytes, proposal=down)
                                       for c in client_ids}, step="calibrate", round=step)

    search = temperature_search_over(ask, participants, server.num_classes)
    evaluation = None
    if search.fit is not None:
        result = encode(result_message(search.steps, search.fit.temperature))
        search.bytes_down += len(result) * len(connected)
        search.floats_down += len(connected)
        exchange = channel.exchange(
            CALIBRATE, {c: (channel.nodes[c], pack(step=search.steps, broadcast=eval_bytes,
                                                   result=result)) for c in connected},
            step="calibrate", round=search.steps)
        evaluations = []
        for cid in sorted(exchange.replies):
            try:
                data = part(record_values(exchange.replies[cid].content), "evaluation",
                            max_bytes=MAX_EVALUATION_BYTES) or b""
                evaluations.append(read_evaluation(
                    server.server, data, round=search.steps, client_id=cid,
                    n_bins=server.config.n_bins, num_test=channel.num_test[cid],
                    predictives={PREDICTIVE}))
            except MessageRejected as err:
                search.rejections.append({"step": search.steps, "client_id": cid,
                                          "reason": err.reason})
        search.rejections += [{"step": search.steps, "client_id": e["client_id"],
                               "reason": e["reason"]} for e in exchange.events]
        evaluation = merge_evaluations(evaluations) if evaluations else None
    return CalibrationOutcome(search, evaluation, held, spec.held_out_fraction,
                              time.perf_counter() - t0)


def server_shift_step(server: Any, eval_bytes: bytes) -> dict[str, Any]:
    """The shift step over ``query.shift`` messages (:mod:`bayesfl.shift_protocol`): every
    connected site scores its final state on its own rows and replies with its mergeable
    states; the report of the valid replies goes to ``out/shift`` (and
    ``server.shift_outcome``). A bad or missing reply is a rejection; nothing here stops the
    run. Returns ``summary["shift_evaluation"]``."""
    from bayesfl.shift_protocol import (
        MAX_REPLY_BYTES,
        expected_replies,
        federated_shift_evaluation,
        report_settings,
        write_shift_outcome,
    )

    request, config, channel = server.shift_request, server.config, server.channel
    connected = sorted(channel.nodes)

    def ask(down: bytes, client_ids: Sequence[int]) -> dict[int, Any]:
        exchange = channel.exchange(
            SHIFT, {c: (channel.nodes[c], pack(request=down.decode(), broadcast=eval_bytes))
                    for c in client_ids}, step="shift")
        answers: dict[int, Any] = {e["client_id"]: e["reason"] for e in exchange.events}
        for cid, reply in exchange.replies.items():
            try:
                values = record_values(reply.content)
                data = part(values, "reply", max_bytes=MAX_REPLY_BYTES)
                if data is None:
                    raise MessageRejected("the shift reply carries no states")
                notes = json.loads(values.get("notes") or "[]")
                answers[cid] = (data, [str(n)[:500] for n in notes]
                                if isinstance(notes, list) else [])
            except (MessageRejected, ValueError, TypeError) as err:
                answers[cid] = getattr(err, "reason", None) or f"unreadable reply: {err}"
        return answers

    try:
        expected, notes = expected_replies(
            request, None if server.data_loader is not None else server.setup.client_data,
            server.novel, {c: channel.num_test[c] for c in connected})
        settings = report_settings(
            request, run_dir=server.run_dir, strategy=config.strategy, dataset=config.dataset,
            clients=config.clients, novel=server.novel, partition=config.partition,
            rounds=config.rounds)
        predictives = {PREDICTIVE, MAP_PLUGIN} if server.server.is_posterior else {PREDICTIVE}
        outcome = federated_shift_evaluation(
            ask, connected, request, expected=expected, predictives=predictives,
            num_classes=server.num_classes, novel=server.novel, settings=settings, notes=notes)
        if outcome.report is not None and server.run_dir is not None:
            write_shift_outcome(server.run_dir, outcome.report, outcome.states,
                                novel=server.novel, num_classes=server.num_classes)
    except (BayesFLError, OSError, ValueError) as err:  # a report problem, not the run's
        log(f"shift evaluation failed: {err}")
        return {"report": None, "error": f"shift evaluation failed: {err}"}
    server.shift_outcome = outcome
    for rejection in outcome.rejections:
        log(f"shift evaluation: client {rejection['client_id']} left out: "
            f"{rejection['reason']}")
    log(f"shift evaluation: {len(outcome.states)} of {len(connected)} sites, bytes up "
        f"{outcome.bytes_up:,}, down {outcome.bytes_down:,}")
    return outcome.summary()


__all__ = ["server_calibrate_step", "server_shift_step"]
