"""A Flower round's timeline: the stamps a round message collects on its way (the server's
push, the ClientApp process's start, its module's import, its handler, the server's receipt)
and the segments between them, along the round's critical path (issue 28)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("flwr")

from bayesfl.flower.protocol import (
    HANDLER_PARTS,
    MESSAGE_STAMPS,
    message_segments,
    round_timeline,
)

# one message's stamps, seconds since the epoch, 0.25 s apart so every segment is known
STAMPS = {key: 1_800_000_000.0 + 0.25 * i for i, (key, _) in enumerate(MESSAGE_STAMPS)}


def test_each_segment_runs_from_the_previous_stamp_to_its_own():
    segments = message_segments(STAMPS)
    assert list(segments) == ["pull_wait", "spawn", "flower_start", "app_call", "handler",
                              "reply"]
    assert all(v == pytest.approx(0.25, abs=1e-9) for v in segments.values())


def test_a_missing_stamp_joins_the_segments_on_either_side():
    # Flower 1.41 does not hand a ClientApp the time its SuperNode pulled the message
    stamps = {k: v for k, v in STAMPS.items() if k != "at.delivered"}
    segments = message_segments(stamps)
    assert "pull_wait" not in segments and "spawn" not in segments
    assert segments["pull_wait+spawn"] == pytest.approx(0.5, abs=1e-9)
    assert sum(segments.values()) == pytest.approx(
        STAMPS["at.received"] - STAMPS["at.pushed"], abs=1e-9)


def test_the_round_timeline_follows_the_last_reply_and_adds_up_to_the_round():
    early = {**STAMPS, "at.received": STAMPS["at.received"] - 1.0, "import": 9.0}
    late = {**STAMPS, "at.received": STAMPS["at.received"] + 2.0, "import": 1.5, "fit": 0.5,
            "cpu": 4.0}
    started, ended = STAMPS["at.pushed"] - 0.125, STAMPS["at.received"] + 2.5
    timeline = round_timeline(started, ended, {0: early, 2: late, 1: {"fit": 3.0}})
    assert timeline["client"] == 2  # client 1 reported no stamps: it is not followed
    assert timeline["before_push"] == pytest.approx(0.125, abs=1e-9)
    assert timeline["reply"] == pytest.approx(2.25, abs=1e-9)
    assert timeline["after_last_reply"] == pytest.approx(0.5, abs=1e-9)
    assert timeline["handler_parts"] == {"import": 1.5, "fit": 0.5}
    assert timeline["cpu"] == 4.0
    parts = sum(v for k, v in timeline.items() if k not in ("client", "handler_parts", "cpu"))
    assert parts == pytest.approx(ended - started, abs=1e-9)


def test_no_stamped_reply_gives_no_timeline():
    assert round_timeline(0.0, 1.0, {}) == {}
    assert round_timeline(0.0, 1.0, {0: {"fit": 1.0}}) == {}


def test_a_round_message_reply_carries_its_handlers_parts_and_the_nodes_stamps(monkeypatch):
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from bayesfl.flower import client_app
    from bayesfl.flower.protocol import ROUND, pack, timings
    from bayesfl.messages import encode
    from bayesfl.strategies import make_strategy
    from bayesfl.strategies.halves import server_half

    run_config = {"strategy": "fedavg", "dataset": "gaussian_mixture", "clients": 2,
                  "partition": "iid", "rounds": 1, "seed": 3, "body": "mlp:8",
                  "feature-dim": 4, "local-epochs": 1, "dataset-option.n": 60,
                  "dataset-option.num_classes": 3, "dataset-option.dim": 5, "threads": 1}
    for key in ("_run_id", "_node_id", "_task_id"):  # what a ClientApp process has set
        monkeypatch.setattr(TaskIdentity, key, 1)
    context = Context(run_id=1, node_id=100, node_config={"partition-id": 0,
                                                          "num-partitions": 2},
                      state=RecordDict(), run_config=run_config)
    node = client_app.node_of(context)  # it holds the client half only
    server = server_half(make_strategy(node.config.strategy, node.strategy.context,
                                       **node.config.strategy_options))
    fit = encode(server.configure(server.init(), 1).broadcast)
    before = time.time()
    reply = client_app.round_step(Message(pack(round=1, fit=fit, personalize=False,
                                               final=False),
                                          dst_node_id=100, message_type=ROUND), context)
    after = time.time()
    stamps = timings(reply.content)
    assert set(HANDLER_PARTS) - {"evaluate"} <= set(stamps)  # nothing to evaluate in round 1
    assert stamps["handler"] >= sum(stamps[k] for k in HANDLER_PARTS if k in stamps)
    # this process imported the module and started long before the handler ran
    assert stamps["at.process"] <= stamps["at.loaded"] <= before <= stamps["at.start"] \
        <= stamps["at.end"] <= after
    assert stamps["cpu"] > 0
    assert "at.delivered" not in stamps  # a message built here was never pulled by a node
