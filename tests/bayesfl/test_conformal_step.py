"""The conformal step of a run (bayesfl.conformal): over messages, the exact threshold equals
the pooled one bit for bit, the one-shot threshold is FedCP-QQ's, bad replies are rejected
and the search goes on; in a simulated run the summary, report and plot are written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bayesfl.conformal import (
    ConformalClient,
    P,
    conformal_search_over,
    evaluation_over,
    parse_conformal,
)
from bayesfl.errors import ConfigError
from bayesfl.messages import KeyRing, decode, encode
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE
from calibration.conformal import conformal_threshold, conformity_scores
from calibration.federated_conformal import one_shot_threshold


def make_clients(spec, sizes=(30, 45, 12, 60), classes=5, plugin=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    clients, raw = [], {}
    for cid, n in enumerate(sizes):
        probs = {PREDICTIVE: torch.softmax(torch.randn(n, classes, generator=g,
                                                       dtype=torch.float64) * 2, 1)}
        if plugin:
            probs[MAP_PLUGIN] = torch.softmax(torch.randn(n, classes, generator=g,
                                                          dtype=torch.float64) * 3, 1)
        labels = torch.randint(0, classes, (n,), generator=g)
        clients.append(ConformalClient.from_probabilities(cid, probs, labels, spec, 7))
        raw[cid] = (probs, labels)
    return clients, raw


def asker(clients, keys=None):
    by_id = {c.client_id: c for c in clients}

    def ask(step, down, ids):
        out = {}
        for cid in ids:
            key = None if keys is None else keys.client_key(cid)
            out[cid] = encode(by_id[cid].reply(decode(
                down, key=None if keys is None else keys.server_key)), key=key)
        return out
    return ask


@pytest.mark.parametrize("name", ["lac:0.1", "aps:0.05", "raps:0.2", "aps-randomized:0.1"])
def test_exact_threshold_over_messages_equals_the_pooled_one(name: str) -> None:
    spec = parse_conformal(name)
    clients, raw = make_clients(spec)
    search = conformal_search_over(asker(clients), [c.client_id for c in clients], spec, 5)
    assert search.error is None and search.rejections == []
    for i in range(P):
        pooled = torch.cat([c.scores[i] for c in clients])  # what a central server would do
        assert search.thresholds[i] == conformal_threshold(pooled, spec.alpha)
    if not spec.score.randomized:  # the client's scores are the calibration module's
        probs, labels = raw[1]
        assert torch.equal(clients[1].scores[0],
                           conformity_scores(probs[PREDICTIVE], labels, spec.score))
    # every step costs each client one small message
    assert search.bytes_up / len(clients) / search.steps < 1024


def test_one_shot_over_messages_is_fedcp_qq_and_under_a_kilobyte() -> None:
    spec = parse_conformal("aps:0.1:one-shot")
    clients, _ = make_clients(spec, sizes=(40, 40, 40, 40, 40))
    search = conformal_search_over(asker(clients), list(range(5)), spec, 5)
    assert search.steps == 1
    for i in range(P):
        expected = one_shot_threshold([c.scores[i] for c in clients], 0.1)
        assert search.thresholds[i] == expected.threshold
        assert search.details[i]["coverage_bound"] >= 0.9
    assert search.bytes_up / 5 <= 1024


def test_sketch_over_messages_is_at_or_above_the_pooled_threshold_under_a_kilobyte() -> None:
    """The sketch step (one request, one reply a client): its threshold is the calibration
    module's sketch threshold of the same scores, never below the pooled one (here clients of
    60 rows, over the 32 values a sketch holds, and one of 12 that sends all), within the
    stated slack; the reply, signed, is under 1 KB on the wire."""
    from calibration.federated_conformal import one_shot_sketch_threshold

    spec = parse_conformal("lac:0.1:sketch")
    keys = KeyRing.generate()
    clients, _ = make_clients(spec, sizes=(60, 45, 12, 60, 2000))
    ids = [c.client_id for c in clients]
    search = conformal_search_over(asker(clients, keys), ids, spec, 5, keys=keys)
    assert search.steps == 1 and search.error is None and search.rejections == []
    for i in range(P):
        parts = [c.scores[i] for c in clients]
        pooled = torch.sort(torch.cat(parts)).values
        expected = one_shot_sketch_threshold(parts, 0.1)
        assert search.thresholds[i] == expected.threshold
        assert search.thresholds[i] >= conformal_threshold(pooled, 0.1)
        detail = search.details[i]
        k, slack = detail["rank"], detail["sketch_slack"]
        assert search.thresholds[i] <= pooled[k + slack - 1]
        assert detail["coverage_bound"] >= 0.9
        assert detail["coverage_upper_bound"] == min(1.0, (k + slack) / (pooled.shape[0] + 1))
    assert search.bytes_up / len(clients) <= 1024  # the encoded, signed replies


def test_a_tampered_sketch_is_rejected() -> None:
    spec = parse_conformal("aps:0.1:sketch")
    clients, _ = make_clients(spec)

    def tamper(step, cid, data):
        message = decode(data)
        if cid == 1:
            message.tensors["sketch"][0, :3] = torch.tensor([0.5, 0.4, 0.3])  # falls
        if cid == 2:
            message.tensors["count"][1] = 1000  # more rows than values sent
        return encode(message)

    search = conformal_search_over(asker(clients), [0, 1, 2, 3], spec, 5, upload_hook=tamper)
    assert sorted(r["client_id"] for r in search.rejections) == [1, 2]
    assert "non-decreasing" in search.rejections[0]["reason"] + search.rejections[1]["reason"]
    assert search.participants == [0, 3]


def test_a_client_without_a_plugin_and_too_few_rows() -> None:
    spec = parse_conformal("lac:0.05")
    clients, _ = make_clients(spec, sizes=(5, 6), plugin=False)
    search = conformal_search_over(asker(clients), [0, 1], spec, 5)
    assert search.thresholds[0] == math.inf  # 11 rows < 1/0.05 - 1: every label
    assert search.thresholds[1] is None  # nobody has a plug-in


def test_a_tampered_reply_is_rejected_and_the_search_restarts() -> None:
    spec = parse_conformal("aps:0.1")
    clients, _ = make_clients(spec)
    keys = KeyRing.generate()  # signed messages, as an authenticated run sends

    def tamper(step, cid, data):
        if cid != 2 or step != 3:
            return data
        message = decode(data, key=None if keys is None else keys.client_key(cid))
        message.tensors["at_most"][0] = torch.arange(15, 0, -1)  # counts that fall
        return encode(message, key=None if keys is None else keys.client_key(cid))

    search = conformal_search_over(asker(clients, keys), [0, 1, 2, 3], spec, 5,
                                   upload_hook=tamper, keys=keys)
    assert [r["client_id"] for r in search.rejections] == [2]
    assert search.participants == [0, 1, 3] and search.restarts == 1
    pooled = torch.cat([clients[c].scores[0] for c in (0, 1, 3)])
    assert search.thresholds[0] == conformal_threshold(pooled, 0.1)


def test_evaluation_counts_are_validated() -> None:
    spec = parse_conformal("lac:0.1")
    clients, raw = make_clients(spec)
    search = conformal_search_over(asker(clients), [0, 1, 2, 3], spec, 5)

    def ask(step, down, ids):
        out = {}
        for cid in ids:
            probs, labels = raw[cid]
            out[cid] = encode(clients[cid].evaluate(decode(down), probs, labels, 5))
        out[3] = encode(decode(out[3]).__class__(decode(out[3]).header, {
            "counts": torch.tensor([[5, 9], [5, 1]]),  # more covered than rows
            "size_counts": torch.zeros(2, 6, dtype=torch.int64)}))
        return out

    coverage, rejections = evaluation_over(ask, [0, 1, 2, 3], search, 5)
    assert sorted(coverage) == [0, 1, 2] and rejections[0]["client_id"] == 3
    # the held-out rows themselves are covered at >= 1 - alpha when pooled (k >= 0.9 (n+1))
    covered = sum(coverage[c][0].covered for c in coverage)
    assert covered / sum(coverage[c][0].count for c in coverage) >= 0.9 - 0.1


def test_parse_errors_say_what_to_write() -> None:
    with pytest.raises(ConfigError, match="SCORE:ALPHA"):
        parse_conformal("aps")
    with pytest.raises(ConfigError, match="unknown conformal score"):
        parse_conformal("foo:0.1")
    with pytest.raises(ConfigError, match=r"\(0, 1\)"):
        parse_conformal("aps:1.5")
    with pytest.raises(ConfigError, match=r"method.*sketch"):
        parse_conformal("aps:0.1:twice")
    assert parse_conformal("lac:0.1:sketch").method == "sketch"


def test_simulated_run_reports_conformal_sets(tmp_path) -> None:
    from bayesfl import simulate

    result = simulate("fedlog", dataset="digits", clients=4, partition="iid", rounds=1,
                      seed=0, progress=False, conformal="aps:0.1", out=tmp_path / "run")
    figures = result.summary["conformal"]
    assert figures["method"] == "exact" and figures["rejections"] == []
    for key in (PREDICTIVE, MAP_PLUGIN):
        f = figures["predictives"][key]
        assert len(f["per_client"]) == 4
        assert sum(c["count"] for c in f["per_client"]) == f["count"] == sum(f["size_counts"])
        assert 0.0 <= f["coverage"] <= 1.0 and 0.0 <= f["mean_set_size"] <= 10.0
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["conformal"]["predictives"][PREDICTIVE]["coverage"] == \
        figures["predictives"][PREDICTIVE]["coverage"]
    assert (tmp_path / "run" / "conformal.png").stat().st_size > 0
    assert "per client" in (tmp_path / "run" / "conformal.md").read_text().lower()
    # the same run and seed give the same sets
    again = simulate("fedlog", dataset="digits", clients=4, partition="iid", rounds=1,
                     seed=0, progress=False, conformal="aps:0.1")
    assert again.summary["conformal"]["predictives"] == figures["predictives"]
