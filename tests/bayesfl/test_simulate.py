"""The embedded simulator: outputs, rejection of poisoned uploads, resume, batching."""

import json

import pytest
import torch

from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.messages import Message, decode, encode
from bayesfl.simulate import CHECKPOINT_NAME, sample_clients, simulate
from tests.devices import DEVICES

# a small, fast experiment: 6 clients with 2 classes each of a 4-class Gaussian mixture
SMALL = dict(
    dataset="gaussian_mixture", clients=6, partition="shards:2", rounds=2, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    dataset_options={"num_classes": 4, "dim": 10, "n": 480, "separation": 4.0},
)


def numbers(metrics):
    """Metric records without wall-clock times."""
    return [{k: v for k, v in m.items() if not k.startswith("seconds")} for m in metrics]


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_holds_metrics_summary_manifest_partition_and_plots(tmp_path):
    result = simulate("fedlog", out=tmp_path, **SMALL)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"metrics.jsonl", "summary.json", "manifest.json", "partition.txt", "partition.json",
            "predictions.npz", "accuracy.png", "reliability.png", CHECKPOINT_NAME} <= names
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("strategy", "rounds", "accuracy", "accuracy_pooled", "ece", "mce", "brier",
                "nll", "per_client", "bytes_up", "bytes_down", "seconds"):
        assert key in summary
    assert summary["strategy"] == "fedlog" and summary["rounds"] == 2
    assert len(summary["per_client"]) == 6
    mean = sum(c["accuracy"] for c in summary["per_client"]) / 6
    assert summary["accuracy"] == pytest.approx(mean)
    metrics = read_metrics(tmp_path)
    assert [m["round"] for m in metrics] == [0, 1, 2]  # FedLog's init round, then training
    assert summary["bytes_up"] == sum(m["bytes_up"] for m in metrics)
    # bytes are measured on the encoded messages: statistics (4 x 9 float32) + count + header
    assert all(b > 4 * 9 * 4 for m in metrics for b in m["bytes_up_per_client"])
    assert metrics[1]["floats_up"] == 6 * (4 * 9 + 1)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["config"]["seed"] == 3 and "torch" in manifest["packages"]
    assert result.summary == summary


def _poison(round_, client_id, data):
    """Client 1 sends a different malicious upload every round; client 2 garbage once."""
    if client_id == 2 and round_ == 2:
        return b"\x00garbage" * 10
    if client_id != 1:
        return data
    msg = decode(data)
    t = dict(msg.tensors)
    if round_ == 0:
        t["statistics"] = t["statistics"][:2]  # wrong shape
    elif round_ == 1:
        t["statistics"] = torch.full_like(t["statistics"], float("nan"))
    elif round_ == 2:
        t["num_samples"] = t["num_samples"] + 5  # counts that do not add up
    else:
        t["padding"] = torch.zeros(4_000_000)  # 16 MB: oversized
    return encode(Message(msg.header, t))


def test_poisoned_uploads_are_rejected_logged_and_the_run_finishes(tmp_path):
    result = simulate("fedlog", out=tmp_path, upload_hook=_poison, **{**SMALL, "rounds": 3})
    metrics = read_metrics(tmp_path)
    reasons = {m["round"]: [r["reason"] for r in m["rejections"]] for m in metrics}
    assert "shape" in reasons[0][0]
    assert "non-finite" in reasons[1][0]
    assert "sum to" in reasons[2][0] and any("not a bayesfl message" in r for r in reasons[2])
    assert "oversized" in reasons[3][0]
    assert [m["accepted"] for m in metrics] == [5, 5, 4, 5]
    assert result.summary["rejected_uploads"] == 5
    assert {r["client_id"] for r in result.summary["rejections"]} == {1, 2}
    assert torch.isfinite(result.state["head"]).all()
    assert result.summary["accuracy"] > 0.5


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    config = {**SMALL, "rounds": 3, "fraction": 0.5}
    full = simulate("fedlog", out=tmp_path / "full", **config)

    def crash(round_, record):
        if round_ == 1:
            raise KeyboardInterrupt("killed after round 1")

    with pytest.raises(KeyboardInterrupt):
        simulate("fedlog", out=tmp_path / "cut", round_callback=crash, **config)
    assert [m["round"] for m in read_metrics(tmp_path / "cut")] == [0, 1]
    resumed = simulate("fedlog", out=tmp_path / "cut", resume=True, **config)
    assert numbers(read_metrics(tmp_path / "cut")) == numbers(read_metrics(tmp_path / "full"))
    assert numbers(resumed.metrics) == numbers(full.metrics)
    assert torch.equal(resumed.state["head"], full.state["head"])


def test_resume_restores_personal_heads(tmp_path):
    config = {**SMALL, "rounds": 2, "strategy_options": {"head_epochs": 1}}
    simulate("fedrep", out=tmp_path / "full", **config)

    def crash(round_, record):
        if round_ == 1:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        simulate("fedrep", out=tmp_path / "cut", round_callback=crash, **config)
    simulate("fedrep", out=tmp_path / "cut", resume=True, **config)
    assert numbers(read_metrics(tmp_path / "cut")) == numbers(read_metrics(tmp_path / "full"))


def test_corrupt_or_foreign_checkpoints_give_clear_errors(tmp_path):
    config = {**SMALL, "rounds": 1}
    simulate("fedlog", out=tmp_path, **config)
    with pytest.raises(CheckpointError, match="another run configuration"):
        simulate("fedlog", out=tmp_path, resume=True, **{**config, "lr": 0.5})
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        simulate("fedlog", out=tmp_path, resume=True, **config)


def test_batched_and_plain_training_give_the_same_run(tmp_path):
    batched = simulate("fedlog", batched=True, **SMALL)
    plain = simulate("fedlog", batched=False, **SMALL)
    torch.testing.assert_close(batched.state["head"], plain.state["head"], atol=1e-4, rtol=1e-4)
    assert batched.summary["accuracy"] == pytest.approx(plain.summary["accuracy"], abs=0.02)


def test_heterogeneous_bodies_run_and_learn():
    result = simulate("fedlog", **{**SMALL, "body": "mlp:16,mlp:8-8", "rounds": 3})
    assert [c.body_spec for c in result.clients[:2]] == ["mlp:16", "mlp:8-8"]
    assert result.summary["accuracy"] > 0.7


def test_fedavg_uploads_the_whole_network_and_fedlog_only_statistics():
    fedlog = simulate("fedlog", **SMALL)
    fedavg = simulate("fedavg", **SMALL)
    net = fedavg.clients[0].model
    num_params = sum(p.numel() for p in net.parameters())
    # per client per round: FedLog C (d + 1) statistics + n_c; FedAvg every parameter + n_c
    assert fedlog.metrics[1]["floats_up"] == 6 * (4 * 9 + 1)
    assert fedavg.metrics[0]["floats_up"] == 6 * (num_params + 1)
    assert fedavg.metrics[0]["round"] == 1  # no init round
    assert fedlog.metrics[1]["bytes_up"] < fedavg.metrics[0]["bytes_up"]


def test_client_sampling_is_seeded_and_respects_the_fraction():
    a = sample_clients(10, 0.3, seed=1, round=4)
    assert a == sample_clients(10, 0.3, seed=1, round=4) and len(a) == 3
    assert sample_clients(10, 0.3, seed=1, round=0) == list(range(10))
    assert sample_clients(10, 1.0, seed=1, round=5) == list(range(10))


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="valid names"):
        simulate("fedsgd", **SMALL)
    with pytest.raises(ConfigError, match="unknown option"):
        simulate("fedlog", **SMALL, learning_rate=0.1)
    with pytest.raises(ConfigError, match="fraction"):
        simulate("fedlog", **{**SMALL, "fraction": 0.0})
    with pytest.raises(ConfigError, match="resume"):
        simulate("fedlog", resume=True, **SMALL)
    with pytest.raises(ConfigError, match="different shared parameter shapes"):
        simulate("fedavg", **{**SMALL, "body": "mlp:16,mlp:8"})




@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["fedlog-c", "fedlog-dp-local", "fedper", "fedbabu",
                                      "fedproto"])
def test_strategies_run_on_every_available_device(device, strategy):
    result = simulate(strategy, device=device, **{**SMALL, "rounds": 1})
    assert result.clients[0].data.train_x.device.type == device
    assert 0.0 <= result.summary["accuracy"] <= 1.0
    assert result.summary["rejected_uploads"] == 0


def _per_client_accumulators(probs, labels, sizes, n_bins=15):
    from calibration.accumulator import Accumulator

    accs, start = [], 0
    for n in sizes:
        accs.append(Accumulator(n_bins).update(probs[start:start + n], labels[start:start + n]))
        start += n
    return [a.compute() for a in accs], Accumulator.merged(accs).compute()


@pytest.mark.parametrize("n_bins", [1, 10, 15])
def test_vectorised_client_metrics_equal_one_accumulator_per_client(n_bins):
    from bayesfl.evaluation import METRICS, multi_client_metrics

    g = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 25, (40,), generator=g)]
    n = sum(sizes)
    probs = torch.softmax(3 * torch.randn(n, 7, generator=g, dtype=torch.float64), dim=1)
    probs[:6] = 1 / 7  # ties: the first maximal class is the prediction
    probs[6, :] = 0.0
    probs[6, 2] = 1.0  # confidence exactly 1 lands in the last bin
    labels = torch.randint(0, 7, (n,), generator=g)
    index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    per_client, pooled = multi_client_metrics(probs, labels, index, len(sizes), n_bins=n_bins)
    want_clients, want_pooled = _per_client_accumulators(probs, labels, sizes, n_bins)
    for got, want in zip(per_client, want_clients, strict=True):
        assert got["count"] == want["count"]
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-14)
    for key in METRICS:
        assert pooled[key] == pytest.approx(want_pooled[key], rel=1e-12, abs=1e-14)


def test_vectorised_client_metrics_reject_bad_input():
    from bayesfl.evaluation import multi_client_metrics
    from calibration.errors import InvalidInputError

    probs = torch.full((4, 2), 0.5, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1])
    with pytest.raises(InvalidInputError, match="no samples"):
        multi_client_metrics(probs, labels, torch.tensor([0, 0, 2, 2]), 3)
    probs[1] = torch.tensor([1.5, -0.5], dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="negative"):
        multi_client_metrics(probs, labels, torch.tensor([0, 0, 1, 1]), 2)


@pytest.mark.parametrize("body", ["mlp:16", "mlp:16,mlp:8-8"])
def test_batched_evaluation_equals_the_per_client_evaluation(body):
    from bayesfl.evaluation import evaluate_clients

    result = simulate("fedlog", **{**SMALL, "body": body, "rounds": 1})
    together = evaluate_clients(result.strategy, result.clients, result.state, batched=True)
    one_by_one = evaluate_clients(result.strategy, result.clients, result.state, batched=False)
    assert [c["client_id"] for c in together.per_client] == list(range(6))
    for got, want in zip(together.per_client, one_by_one.per_client, strict=True):
        assert got.keys() == want.keys() and got["count"] == want["count"]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert together.pooled == pytest.approx(one_by_one.pooled, rel=1e-9, abs=1e-12)
    assert together.headline() == pytest.approx(one_by_one.headline(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(together.probs, one_by_one.probs, rtol=1e-6, atol=1e-9)
    assert torch.equal(together.labels, one_by_one.labels)
    assert torch.equal(together.client_ids, one_by_one.client_ids)


def _tampered_uploads(strategy, ups):
    """Valid uploads and one of each kind of bad upload, as received (wire round trip)."""

    def tamper(up, **tensors):
        return decode(encode(Message(up.header, {**up.tensors, **tensors})))

    stats = ups[0].tensors["statistics"]
    bad = [
        tamper(ups[1], statistics=stats[:, :-1]),
        tamper(ups[2], statistics=stats.double()),
        tamper(ups[3], statistics=torch.full_like(stats, float("nan"))),
        tamper(ups[4], statistics=torch.cat([stats[:, :1] + 0.5, stats[:, 1:]], 1)),
        tamper(ups[5], statistics=torch.cat([-stats[:, :1], stats[:, 1:]], 1)),
        tamper(ups[0], statistics=torch.cat([stats[:, :1], stats[:, 1:] + 100.0], 1)),
    ]
    if "num_samples" in ups[0].tensors:
        n = ups[0].tensors["num_samples"]
        bad += [tamper(ups[1], num_samples=n + 1), tamper(ups[2], num_samples=n * 0),
                tamper(ups[3], num_samples=n.to(torch.int32))]
    else:
        bad.append(tamper(ups[1], num_samples=torch.tensor([3])))
    return ups + bad


@pytest.mark.parametrize("strategy", ["fedlog", "fedlog-dp-central", "fedlog-dp-local",
                                      "fedlog-c"])
def test_validating_uploads_together_gives_the_one_by_one_verdicts(strategy):
    from bayesfl.errors import MessageRejected

    result = simulate(strategy, **{**SMALL, "rounds": 0})
    s, clients = result.strategy, result.clients
    down = decode(encode(s.broadcast(result.state, 0)))
    gens = [torch.Generator().manual_seed(c.client_id) for c in clients]
    ups = [decode(encode(u)) for u in s.client_update_batch(clients, down, gens)]
    received = _tampered_uploads(s, ups)
    ids = [m.header.client_id for m in received]
    ids[0] = 5  # a header naming another client
    for r in (0, 1):  # round 1: every header names the wrong round
        want = []
        for m, cid in zip(received, ids, strict=True):
            try:
                s.validate_upload(m, round=r, client_id=cid)
            except MessageRejected as err:
                want.append(err.reason)
            else:
                want.append(None)
        assert s.validate_uploads(received, round=r, client_ids=ids) == want
        assert sum(v is None for v in want) >= (5 if r == 0 else 0)


@pytest.mark.parametrize("strategy", ["fedlog", "fedlog-dp-local"])
def test_batched_uploads_equal_the_per_client_uploads(strategy):
    result = simulate(strategy, **{**SMALL, "rounds": 1})
    s, clients = result.strategy, result.clients
    down = decode(encode(s.broadcast(result.state, 0)))
    together = s.client_update_batch(
        clients, down, [torch.Generator().manual_seed(c.client_id) for c in clients])
    for c, up in zip(clients, together, strict=True):
        alone = s.client_update(c, down, torch.Generator().manual_seed(c.client_id))
        assert up.header == alone.header and up.tensors.keys() == alone.tensors.keys()
        for name, tensor in alone.tensors.items():
            torch.testing.assert_close(up.tensors[name], tensor, rtol=1e-6, atol=1e-5)
    from bayesfl.training import forward_stacked_concat

    features = forward_stacked_concat([c.model for c in clients],
                                      [c.data.train_x for c in clients])
    tables = s.batch_statistics(clients, features)
    for c, table, f in zip(clients, tables, features.split([c.data.num_train for c in clients]),
                           strict=True):
        assert torch.equal(table, s.client_statistics(c, f))


def test_a_run_leaves_the_callers_global_rng_where_it_was():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    simulate("fedavg", **SMALL)
    assert torch.equal(torch.rand(3), expected)
