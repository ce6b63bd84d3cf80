"""The round loop (bayesfl.engine.rounds), read as its specification.

The channel here is a real `Channel`: it runs FedAvg's client
halves in this process, and a script says what goes wrong on the way (a reply that is lost, an
upload that arrives as junk, a client whose evaluation fails). The transport's hooks record
what the loop hands them. The same federation runs under both evaluation modes:

* ``"inline"`` (the simulator's): round r is evaluated within round r; an aggregate whose
  evaluation fails is reverted in its own round;
* ``"carried"`` (Flower's): round r's evaluation rides on round r + 1's message (the last
  round's on the final message) and its record is completed when those replies arrive.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from bayesfl.data.clients import ClientData
from bayesfl.engine.channel import Collected, Reply, Step
from bayesfl.engine.rounds import RoundLoop, RoundTrace, collector_paused, receive_uploads
from bayesfl.errors import BayesFLError, UploadsRejectedWarning
from bayesfl.evaluation import merge_evaluations
from bayesfl.messages import decode, encode
from bayesfl.strategies.averaging.fedavg import FedAvg
from bayesfl.strategies.base import StrategyContext, derived_seed
from bayesfl.training import LocalTraining

CLIENTS, ROUNDS, SEED = 3, 3, 5
JUNK = b"not a message" * 3


class UnevaluableAfter(FedAvg):
    """FedAvg whose aggregate of round ``bad_round`` cannot be evaluated (as a poisoned
    aggregate's cannot): building its evaluation broadcast fails."""

    def __init__(self, context, bad_round=None):
        super().__init__(context)
        self.bad_round, self.bad_state = bad_round, None

    def aggregate(self, state, uploads, round, generator):
        new = super().aggregate(state, uploads, round, generator)
        if round == self.bad_round:
            self.bad_state = new
        return new

    def configure_evaluation(self, state, round):
        if state is self.bad_state:
            raise BayesFLError("the aggregate cannot be evaluated")
        return super().configure_evaluation(state, round)


def client_data(cid):
    g = torch.Generator().manual_seed(cid)
    means = torch.randn(3, 6, generator=torch.Generator().manual_seed(99)) * 2

    def draw(n):
        y = torch.randint(0, 3, (n,), generator=g)
        return means[y] + torch.randn(n, 6, generator=g), y

    return ClientData(cid, *draw(10 + 4 * cid), *draw(6))


class Federation:
    """Clients in this process behind the channel's three verbs. ``lose``, ``junk`` and
    ``eval_fails`` hold (round, client id) pairs: that message's reply is lost, its upload
    arrives as junk bytes, its evaluation fails on the client."""

    def __init__(self, strategy, *, lose=(), junk=(), eval_fails=()):
        self.strategy = strategy
        self.configs = [strategy.context.client_config(c) for c in range(CLIENTS)]
        self.data = [client_data(c) for c in range(CLIENTS)]
        self.states = [strategy.init_client(c) for c in self.configs]
        self.lose, self.junk, self.eval_fails = set(lose), set(junk), set(eval_fails)
        self.sent: list[tuple[int, dict[int, Step]]] = []
        self._out = None

    def evaluate(self, cid, eval_bytes):
        return self.strategy.evaluate(self.configs[cid], self.states[cid], self.data[cid],
                                      decode(eval_bytes))

    # ---- the channel ---------------------------------------------------------------------
    def send(self, round, client_ids, messages):
        out = Collected()
        self.sent.append((round, {c: messages[c] for c in client_ids}))
        for cid in client_ids:
            step, reply = messages[cid], Reply()
            name = "fit" if step.fit is not None else "evaluate"
            if (round, cid) in self.lose:
                out.events.append({"client_id": cid, "node_id": None, "step": name,
                                   "reason": "lost"})
                continue
            if step.evaluate is not None:  # before fitting: the state it was trained to
                if (round, cid) in self.eval_fails:
                    out.events.append({"client_id": cid, "node_id": None,
                                       "step": "evaluate", "reason": "evaluation failed"})
                else:
                    reply.evaluation = self.evaluate(cid, step.evaluate)
            if step.fit is not None:
                gen = torch.Generator().manual_seed(derived_seed(SEED, round, cid))
                self.states[cid], upload = self.strategy.fit(
                    self.configs[cid], self.states[cid], self.data[cid], decode(step.fit), gen)
                reply.upload = JUNK if (round, cid) in self.junk else encode(upload)
                reply.elements = upload.num_elements
            out.replies[cid] = reply
        self._out = out

    def collect(self, deadline):
        out, self._out = self._out, None
        return out

    def close(self):
        pass


class Transport:
    """The hooks: every training client is reachable; inline evaluation asks every client;
    records keep their events; a complete record is kept with the state it was
    completed with (what a checkpoint would write beside it)."""

    def __init__(self, federation):
        self.federation = federation
        self.records, self.states_at_completion = [], []
        self.loop: RoundLoop | None = None

    def round_started(self, round):
        return []

    def reachable(self, client_ids):
        return list(client_ids)

    def broadcast_encoded(self, round, data):
        pass

    def evaluate_inline(self, round, state):
        eval_bytes = encode(self.federation.strategy.configure_evaluation(state, round))
        evaluations = [self.federation.evaluate(c, eval_bytes) for c in range(CLIENTS)]
        return len(eval_bytes) * CLIENTS, merge_evaluations(evaluations)

    def record_extras(self, record, trace: RoundTrace):
        record["events"] = list(trace.events)

    def round_complete(self, record):
        self.records.append(record)
        self.states_at_completion.append(self.loop.state)


def run(mode, *, bad_round=None, min_replies=None, evaluate_every=1, hooks=Transport,
        **script):
    """A whole run under ``mode``; a carried run ends with the final message (every client
    evaluates the last state), as a transport's final step does."""
    context = StrategyContext(3, 4, LocalTraining(epochs=1, lr=1e-2, batch_size=5),
                              rounds=ROUNDS, input_shape=(6,), bodies=("mlp:8",),
                              clients=CLIENTS)
    strategy = UnevaluableAfter(context, bad_round)
    federation = Federation(strategy, **script)
    transport = hooks(federation)
    loop = transport.loop = RoundLoop(
        strategy, federation, transport, state=strategy.init(), seed=SEED, rounds=ROUNDS,
        first_round=1, fraction=1.0, training=range(CLIENTS), evaluation=mode,
        evaluate_inline=transport.evaluate_inline if mode == "inline" else None,
        min_replies=min_replies, evaluate_every=evaluate_every)
    loop.run(1)
    if loop.pending is not None:
        pending = loop.pending
        steps = {c: Step(evaluate=pending.eval_bytes, evaluate_round=pending.round, final=True)
                 for c in range(CLIENTS)}
        federation.send(ROUNDS + 1, list(steps), steps)
        loop.complete_carried(federation.collect(float("inf")), 0.0)
    return transport, federation


def comparable(record):
    return {k: v for k, v in record.items() if not k.startswith("seconds")}


def test_inline_and_carried_write_the_same_records_and_checkpoint_the_same_states():
    inline, _ = run("inline")
    carried, federation = run("carried")
    # the same computations in the same order on both sides: equal to the last bit
    assert [comparable(r) for r in carried.records] == [comparable(r) for r in inline.records]
    assert [r["round"] for r in carried.records] == [1, 2, 3]
    for a, b in zip(inline.states_at_completion, carried.states_at_completion, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # carried: one message per client per round, round r's evaluation riding on r + 1's
    assert [(r, sorted(steps)) for r, steps in federation.sent] == \
        [(1, [0, 1, 2]), (2, [0, 1, 2]), (3, [0, 1, 2]), (4, [0, 1, 2])]
    assert [{s.evaluate_round for s in steps.values() if s.evaluate is not None}
            for _, steps in federation.sent] == [set(), {1}, {2}, {3}]
    assert all(r["bytes_down_evaluation"] > 0 for r in carried.records)


def test_a_carried_round_waits_for_the_next_message_and_an_unevaluated_one_does_not():
    transport, federation = run("carried", evaluate_every=2)
    # evaluate-every 2 over rounds 1-3: round 1 is complete at once without figures; round 2
    # is evaluated on round 3's message, round 3 (the last) on the final one
    assert [(r["round"], r["accuracy"] is None) for r in transport.records] == \
        [(1, True), (2, False), (3, False)]
    assert [{s.evaluate_round for s in steps.values() if s.evaluate is not None}
            for _, steps in federation.sent] == [set(), set(), {2}, {3}]
    assert transport.records[0]["bytes_down_evaluation"] == 0


def test_a_lost_reply_is_missing_from_its_round_and_not_a_rejection():
    for mode in ("inline", "carried"):
        transport, _ = run(mode, lose={(2, 1)})
        second = transport.records[1]
        assert second["participants"] == [0, 1, 2] and second["accepted"] == 2, mode
        assert second["rejections"] == [] and second["bytes_up_per_client"][1] == 0, mode
        assert second["events"] == [{"client_id": 1, "node_id": None, "step": "fit",
                                     "reason": "lost"}], mode
    # carried: the lost message also carried client 1's evaluation of round 1
    assert [c["client_id"] for c in transport.records[0]["per_client"]] == [0, 2]


def test_an_upload_that_arrives_as_junk_is_rejected_with_its_reason_and_its_bytes_count():
    for mode in ("inline", "carried"):
        transport, _ = run(mode, junk={(1, 2)})
        first = transport.records[0]
        assert first["accepted"] == 2, mode
        assert [r["client_id"] for r in first["rejections"]] == [2], mode
        assert first["rejections"][0]["reason"]  # the decoder's reason, whatever its words
        assert first["bytes_up_per_client"][2] == len(JUNK), mode  # they crossed the wire


def test_min_replies_none_aggregates_what_was_accepted_zero_needs_everyone_k_needs_k():
    junk = {(1, 2)}
    as_is, _ = run("inline", junk=junk)  # the simulator's setting
    everyone, _ = run("inline", junk=junk, min_replies=0)
    two, _ = run("inline", junk=junk, min_replies=2)
    three, _ = run("inline", junk=junk, min_replies=3)
    assert "skipped" not in as_is.records[0] and "skipped" not in two.records[0]
    for skipped in (everyone, three):
        assert skipped.records[0]["skipped"] == ("2 accepted upload(s) < min-replies 3: round "
                                                 "skipped, previous state kept")
    assert comparable(as_is.records[0]) == comparable(two.records[0])


def test_every_upload_rejected_warns_once_per_run():
    junk = {(r, c) for r in (1, 2) for c in range(CLIENTS)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transport, _ = run("inline", junk=junk, min_replies=1)
    rejected = [w for w in caught if issubclass(w.category, UploadsRejectedWarning)]
    assert len(rejected) == 1 and "round 1: all 3 uploads were rejected" in \
        str(rejected[0].message)
    assert [r.get("skipped") is not None for r in transport.records] == [True, True, False]


def test_an_aggregate_that_cannot_be_evaluated_is_reverted_in_its_own_round_in_both_modes():
    clean, _ = run("inline")
    for mode in ("inline", "carried"):
        transport, _ = run(mode, bad_round=2)
        second = transport.records[1]
        assert second["aggregate_error"] == ("evaluation of the aggregate failed (the aggregate "
                                             "cannot be evaluated); previous state kept"), mode
        # round 2 keeps round 1's state, and that is what its checkpoint would hold
        torch.testing.assert_close(transport.states_at_completion[1],
                                   clean.states_at_completion[0], rtol=0, atol=0)
        assert second["accuracy"] is not None, mode


def test_a_carried_evaluation_that_fails_on_a_client_leaves_it_out_of_that_rounds_record():
    # carried: the round after was already trained on the state, so nothing is reverted; the
    # client's failure is an event of the round evaluated, its figures are missing there
    clean, _ = run("carried")
    transport, _ = run("carried", eval_fails={(2, 0)})
    first = transport.records[0]
    assert [c["client_id"] for c in first["per_client"]] == [1, 2]
    assert {"client_id": 0, "node_id": None, "step": "evaluate",
            "reason": "evaluation failed"} in first["events"]
    assert "aggregate_error" not in first
    for a, b in zip(transport.states_at_completion, clean.states_at_completion, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_receive_counts_what_arrived_in_participant_order():
    context = StrategyContext(3, 4, LocalTraining(epochs=1, lr=1e-2, batch_size=5),
                              rounds=1, input_shape=(6,), bodies=("mlp:8",), clients=CLIENTS)
    strategy = FedAvg(context)
    federation = Federation(strategy)
    plan = strategy.configure(strategy.init(), 1)
    down = encode(plan.broadcast)
    federation.send(1, [0, 1, 2], {c: Step(fit=down) for c in range(CLIENTS)})
    collected = federation.collect(0.0)
    collected.replies[0].upload = b"x" * (plan.max_upload_bytes + 1)  # oversized
    del collected.replies[1]
    collected.unreadable[1] = "the reply could not be read"
    receipt = receive_uploads(strategy, plan, [0, 1, 2], collected)
    assert len(receipt.accepted) == 1
    assert [r["client_id"] for r in receipt.rejections] == [0, 1]
    assert receipt.rejections[0]["reason"].startswith("oversized message")
    assert receipt.rejections[1]["reason"] == "the reply could not be read"
    assert receipt.bytes_up[:2] == [plan.max_upload_bytes + 1, 0]
    # numbers as the clients counted them, rejected uploads included
    assert receipt.floats_up == 2 * collected.replies[2].elements


def test_a_client_that_sent_nothing_is_rejected_with_its_reason_and_its_reply_kept():
    # a diverged client on Flower: its reply carries no upload (its reason is in unreadable)
    # but may carry its evaluation of the previous round, so the reply stays in replies; the
    # receipt rejects it with that reason (not 'carries no upload') and counts 0 bytes up
    context = StrategyContext(3, 4, LocalTraining(epochs=1, lr=1e-2, batch_size=5),
                              rounds=1, input_shape=(6,), bodies=("mlp:8",), clients=CLIENTS)
    strategy = FedAvg(context)
    federation = Federation(strategy)
    plan = strategy.configure(strategy.init(), 1)
    federation.send(1, [0, 1, 2], {c: Step(fit=encode(plan.broadcast)) for c in range(CLIENTS)})
    collected = federation.collect(0.0)
    collected.replies[1].upload = None
    collected.unreadable[1] = "upload not sent: local training loss became nan"
    receipt = receive_uploads(strategy, plan, [0, 1, 2], collected)
    assert len(receipt.accepted) == 2 and receipt.bytes_up[1] == 0
    assert [(r["client_id"], r["reason"]) for r in receipt.rejections] == [
        (1, "upload not sent: local training loss became nan")]


def test_an_unknown_evaluation_mode_is_refused():
    context = StrategyContext(3, 4, rounds=1, input_shape=(6,), bodies=("mlp:8",),
                              clients=CLIENTS)
    strategy = FedAvg(context)
    with pytest.raises(ValueError, match="evaluation mode 'later'"):
        RoundLoop(strategy, Federation(strategy), None, state={}, seed=0, rounds=1,
                  first_round=1, fraction=1.0, training=[0], evaluation="later")


class Cyclic:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_a_round_runs_with_the_cyclic_collector_paused_and_frees_its_cycles_when_it_ends():
    seen, cycles = [], []

    class Watching(Transport):
        def round_started(self, round):
            seen.append(("started", gc.isenabled()))
            cycle = Cyclic()
            cycles.append(weakref.ref(cycle))
            return []

        def round_complete(self, record):
            seen.append(("complete", gc.isenabled()))
            super().round_complete(record)

    assert gc.isenabled()
    transport, _ = run("inline", hooks=Watching)
    # paused from the round's start to its completion (checkpoint included), on again after
    assert seen == [(step, False) for _ in range(ROUNDS) for step in ("started", "complete")]
    assert gc.isenabled()
    assert len(transport.records) == ROUNDS
    # each round's cycle was freed by the collection at its end, not kept for the run
    assert [ref() for ref in cycles] == [None] * ROUNDS


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("inside")
    assert gc.isenabled()  # back on after an error in the block
