"""The embedded simulator: outputs, rejection of poisoned uploads, resume, batching."""

import importlib
import json
import re

import pytest
import torch

from bayesfl.engine.state import compact_client_states
from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.messages import Message, decode, encode, read_safetensors_metadata
from bayesfl.simulate import CHECKPOINT_NAME, sample_clients, simulate
from bayesfl.stacked_rows import held_bytes
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


def test_each_checkpoint_overwrites_the_one_before_last_and_none_is_left_at_the_end(
        tmp_path, monkeypatch):
    """The checkpoint a round replaces is kept as a spare, which the next round's checkpoint
    overwrites in place (its pages are still in memory: bayesfl.checkpoint.write_atomically);
    a finished run holds only its own checkpoint."""
    import bayesfl.checkpoint as checkpoint_module

    opened = []
    real_open_spare = checkpoint_module._open_spare

    def open_spare(spare):
        handle = real_open_spare(spare)
        opened.append(handle is not None)
        return handle

    monkeypatch.setattr(checkpoint_module, "_open_spare", open_spare)
    simulate("fedlog", out=tmp_path, **{**SMALL, "rounds": 3})
    if checkpoint_module._renameat2() is not None:  # (elsewhere a plain replace: no spare)
        assert opened == [False, False, True, True]  # rounds 0-3: a spare from round 2 on
    assert sorted(p.name for p in tmp_path.glob(f".{CHECKPOINT_NAME}*")) == []
    header = read_safetensors_metadata((tmp_path / CHECKPOINT_NAME).read_bytes())
    assert json.loads(header["bayesfl.meta"])["round"] == 3


def test_run_directory_holds_metrics_summary_manifest_partition_and_plots(tmp_path):
    # the paper's s = 1 (floats_up below counts its upload: the statistics and the count)
    result = simulate("fedlog", out=tmp_path, strategy_options={"feature_scale": 1}, **SMALL)
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


@pytest.mark.trained
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
    # a rejected upload never enters the cache of latest statistics: client 1 was rejected
    # every round, client 2 only in round 2 (its round-3 upload is cached)
    assert not result.state["latest/present"][1] and result.state["latest/present"][2]
    assert torch.isfinite(result.state["latest/statistics"][2]).all()
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


@pytest.mark.trained
def test_batched_and_plain_training_give_the_same_run(tmp_path):
    batched = simulate("fedlog", batched=True, **SMALL)
    plain = simulate("fedlog", batched=False, **SMALL)
    torch.testing.assert_close(batched.state["head"], plain.state["head"], atol=1e-4, rtol=1e-4)
    assert batched.summary["accuracy"] == pytest.approx(plain.summary["accuracy"], abs=0.02)


@pytest.mark.trained
def test_heterogeneous_bodies_run_and_learn():
    result = simulate("fedlog", **{**SMALL, "body": "mlp:16,mlp:8-8", "rounds": 3})
    # 4 classes (chance 0.25); over seeds 0-4 this run ended at 0.72-0.94 (sd 0.08): 0.5 holds
    # whatever the rounding, 0.7 did not (seed 2: 0.717)
    assert result.summary["accuracy"] > 0.5
    assert [c.body_spec for c in result.clients[:2]] == ["mlp:16", "mlp:8-8"]


def test_fedavg_uploads_the_whole_network_and_fedlog_only_statistics():
    fedlog = simulate("fedlog", strategy_options={"feature_scale": 1}, **SMALL)  # the paper's
    fedavg = simulate("fedavg", **SMALL)
    num_params = sum(t.numel() for k, t in fedavg.clients[0].state.items()
                     if k.startswith("model."))
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


def test_partial_participation_counts_the_bytes_of_the_sampled_clients_only():
    # fraction 0.5 of 6 clients: 3 sampled per round; each is sent the round's broadcast once
    # and each sends one upload, so the round's bytes are 3 broadcasts and those 3 uploads
    down, up = {}, {}

    def on_broadcast(r, data):
        down[r] = len(data)

    def on_upload(r, cid, data):
        up[r, cid] = len(data)
        return data

    result = simulate("fedavg", broadcast_hook=on_broadcast, upload_hook=on_upload,
                      **{**SMALL, "fraction": 0.5})
    params = sum(t.numel() for k, t in result.clients[0].state.items()
                 if k.startswith("model."))
    for m in result.metrics:
        r, sampled = m["round"], m["participants"]
        assert sampled == sample_clients(6, 0.5, seed=3, round=r) and len(sampled) == 3
        assert sorted(cid for rr, cid in up if rr == r) == sampled  # nobody else was asked
        assert m["bytes_down_per_client"] == down[r]
        assert m["bytes_down"] == 3 * down[r]
        assert m["bytes_up_per_client"] == [up[r, cid] for cid in sampled]
        assert m["bytes_up"] == sum(up[r, cid] for cid in sampled)
        # FedAvg sends every parameter down and every parameter plus the count up
        assert m["floats_down"] == 3 * params and m["floats_up"] == 3 * (params + 1)
    assert result.summary["bytes_down"] == 3 * sum(down.values())
    assert result.summary["bytes_up"] == sum(up.values())


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
    with pytest.raises(ConfigError, match="client_id"):
        simulate("fedlog", **{**SMALL, "rounds": 0}).predict_proba(6, torch.zeros(1, 10))
    with pytest.raises(ConfigError, match="not a posterior strategy"):
        simulate("fedavg", **{**SMALL, "rounds": 1}).posterior(0)




@pytest.mark.parametrize("batched", [True, False])
def test_a_client_whose_training_loss_becomes_non_finite_is_stopped_and_the_run_goes_on(batched):
    import warnings

    from bayesfl.data.datasets import Dataset, load_dataset
    from bayesfl.errors import LocalTrainingWarning

    pooled = load_dataset("gaussian_mixture", num_classes=4, dim=10, n=320, separation=4.0)
    x = pooled.x.clone()
    x[pooled.y == 3] = 3e38  # one class's inputs overflow the logits: its holder's loss is inf
    data = Dataset("custom", x, pooled.y, 4, (10,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = simulate("fedavg", data=data, batched=batched,
                          **{**SMALL, "clients": 4, "partition": "shards:1"})
    said = [w for w in caught if issubclass(w.category, LocalTrainingWarning)]
    assert len(said) == 1  # once per run, though it happens every round
    assert re.match(r"round 1, client \d: local training loss became (nan|inf) at epoch 1 of 1, "
                    r"mini-batch \d+, and training stopped there; lower the learning rate \(lr "
                    r"0.01\) .*Its upload was not sent and it keeps its state from before the "
                    r"round; the run goes on", str(said[0].message))
    for m in result.metrics:  # every round: that client rejected with the reason, others in
        (rejection,) = m["rejections"]
        assert rejection["reason"].startswith("upload not sent: local training loss became")
        assert m["accepted"] == 3 and m["bytes_up_per_client"].count(0) == 1
    assert result.summary["rejected_uploads"] == len(result.metrics)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["fedlog-c", "fedlog-dp-local", "fedper", "fedbabu",
                                      "fedproto"])
def test_strategies_run_on_every_available_device(device, strategy):
    result = simulate(strategy, device=device, **{**SMALL, "rounds": 1})
    assert result.clients[0].data.train_x.device.type == device
    assert 0.0 <= result.summary["accuracy"] <= 1.0
    assert result.summary["rejected_uploads"] == 0


@pytest.mark.parametrize("body", ["mlp:16", "mlp:16,mlp:8-8"])
@pytest.mark.trained
def test_batched_evaluation_equals_the_per_client_evaluation(body):
    from bayesfl.evaluation import merge_evaluations
    from bayesfl.executor import ClientExecutor

    result = simulate("fedlog", **{**SMALL, "body": body, "rounds": 1})

    def evaluation(batched):
        executor = ClientExecutor(result.strategy, batched=batched)
        return merge_evaluations(executor.evaluate(result.clients, result.evaluation_broadcast,
                                                   n_bins=15, keep_probs=True))

    together, one_by_one = evaluation(True), evaluation(False)
    assert [c["client_id"] for c in together.per_client] == list(range(6))
    # The stacked forward and one client's forward are different float32 kernels: with one
    # thread on AVX2 they agree bit for bit, with 2 threads under ATEN_CPU_CAPABILITY=default to
    # float32 rounding (measured: metrics 2.5e-9 relative, at 1163eee too). A client scored on
    # another's rows or state moves its metrics far beyond 1e-6: the check stays, one machine's
    # digits go.
    for got, want in zip(together.per_client, one_by_one.per_client, strict=True):
        assert got.keys() == want.keys() and got["count"] == want["count"]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    got, want = together.headline(), one_by_one.headline()
    assert got.pop("map_plugin") == pytest.approx(want.pop("map_plugin"), rel=1e-6, abs=1e-9)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(together.probs, one_by_one.probs, rtol=1e-6, atol=1e-9)
    assert torch.equal(together.labels, one_by_one.labels)
    assert torch.equal(together.client_ids, one_by_one.client_ids)


def test_pooled_metrics_are_the_merge_of_the_clients_accumulators(tmp_path):
    import numpy as np

    import calibration

    result = simulate("fedlog", out=tmp_path, **SMALL)
    saved = np.load(tmp_path / "predictions.npz")
    # the merge of six client accumulators equals the metrics of the pooled predictions
    pooled = calibration.evaluate(saved["probs"], saved["labels"])
    for key in ("accuracy", "ece", "mce", "brier", "nll"):
        assert result.summary[key if key != "accuracy" else "accuracy_pooled"] == \
            pytest.approx(float(pooled[key]), rel=1e-12, abs=1e-15)


def test_posterior_strategies_report_the_map_plugin_beside_the_posterior_predictive(tmp_path):
    result = simulate("fedlog", out=tmp_path, **SMALL)
    summary = json.loads((tmp_path / "summary.json").read_text())
    keys = {"accuracy", "accuracy_pooled", "ece", "mce", "brier", "nll"}
    assert keys <= set(summary["map_plugin"])
    assert all(keys <= set(m["map_plugin"]) for m in read_metrics(tmp_path))
    assert "map_plugin" not in simulate("fedavg", **SMALL).summary
    # the federated posterior as client 0 holds it: head draws and a predictive on inputs
    posterior = result.posterior(0)
    assert posterior.sample(10).shape == (10, 4, 9)
    x = result.clients[0].data.test_x
    g = torch.Generator().manual_seed(0)
    probs = posterior.predict_proba(x, generator=g)
    assert probs.shape == (x.shape[0], 4)
    torch.testing.assert_close(probs.sum(1), torch.ones(x.shape[0], dtype=torch.float64))
    map_probs = posterior.predict_proba(x, method="map")
    torch.testing.assert_close(map_probs, result.strategy.predict(
        result.clients[0].config, result.clients[0].state, result.evaluation_broadcast,
        x)["map_plugin"], rtol=0, atol=1e-12)


def test_cached_statistics_make_the_head_that_of_every_clients_current_body():
    """With partial participation, FedLog's default sums every client's latest statistics: the
    server's statistic is exactly the sum over all clients of the statistic of their current
    bodies (an absent client's body has not changed since it last uploaded)."""
    from inference import SufficientStatistics

    # the paper's s = 1, whose statistics are those of every training example (the held-out
    # default's are checked in tests/bayesfl/strategies/fedlog/test_fedlog_heldout_scale.py)
    result = simulate("fedlog", **{**SMALL, "rounds": 3, "fraction": 0.5},
                      strategy_options={"feature_scale": 1})
    s = result.strategy
    tables = []
    for c in result.clients:
        features = s.client_model(c.config, c.state).eval()(c.data.train_x).detach()
        tables.append(s.client_statistics(c.data, features).to(torch.float32).double())
    want = SufficientStatistics.sum_tables(torch.stack(tables), 0, privatized=True).table
    assert torch.equal(result.state["statistics"], want)
    omitted = simulate("fedlog", **{**SMALL, "rounds": 3, "fraction": 0.5,
                                    "strategy_options": {"absent_clients": "omit"}})
    n_last = len(omitted.metrics[-1]["participants"])
    assert omitted.state["num_samples"].item() < result.state["num_samples"].item()
    assert n_last == 3


def test_fedbabu_personalizes_once_after_training_and_predicts_with_it(tmp_path):
    result = simulate("fedbabu", out=tmp_path, **{**SMALL, "rounds": 2})
    assert result.summary["personalized"] is True
    assert set(result.personalized) == set(range(6))
    last = result.metrics[-1]["per_client"]
    # personalisation changed the predictions (the head is fine-tuned from its random init)
    assert [c["accuracy"] for c in result.summary["per_client"]] != [c["accuracy"] for c in last]
    c = result.clients[0]
    personal = result.strategy.predict(c.config, result.personalized[0],
                                       result.evaluation_broadcast, c.data.test_x)["predictive"]
    assert torch.equal(result.predict_proba(0, c.data.test_x), personal)


@pytest.mark.parametrize("strategy", ["fedlog", "fedlog-dp-local", "fedavg", "fedproto"])
@pytest.mark.trained
def test_batched_uploads_equal_the_per_client_uploads(strategy):
    result = simulate(strategy, **{**SMALL, "rounds": 0 if strategy.startswith("fedlog") else 1})
    s, clients = result.strategy, result.clients
    server = type(s)(s.context)
    state = server.init()
    down = decode(encode(server.configure(state, 0 if s.init_round else 1).broadcast))
    gens = [torch.Generator().manual_seed(c.client_id) for c in clients]
    together = s.fit_group([c.config for c in clients], [c.state for c in clients],
                           [c.data for c in clients], down, gens)
    for c, (_, up) in zip(clients, together, strict=True):
        _, alone = s.fit(c.config, c.state, c.data, down,
                         torch.Generator().manual_seed(c.client_id))
        assert up.header == alone.header and up.tensors.keys() == alone.tensors.keys()
        for name, tensor in alone.tensors.items():
            # float rounding of vmapped vs per-client Adam, carried through one round
            torch.testing.assert_close(up.tensors[name], tensor, rtol=1e-6, atol=1e-5)


def test_a_run_leaves_the_callers_global_rng_where_it_was():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    simulate("fedavg", **SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_personalisation_shows_its_own_progress_one_step_per_client(capsys):
    # FedSI's personalisation (a Laplace refit per client) can outlast the rounds: the user
    # sees it advance client by client, not a finished round bar and then silence
    simulate("fedavg-ft", **{**SMALL, "rounds": 1, "progress": True})
    err = capsys.readouterr().err
    assert "fedavg-ft: personalising" in err and "6/6" in err
    simulate("fedavg-ft", **{**SMALL, "rounds": 1, "progress": False})
    assert "personalising" not in capsys.readouterr().err


def test_summary_confidence_is_the_mean_top_class_probability_of_the_saved_predictions(tmp_path):
    import numpy as np

    result = simulate("fedlog", out=tmp_path, **SMALL)
    saved = np.load(tmp_path / "predictions.npz")
    expected = saved["probs"].max(axis=1).mean()
    # the accumulator sums the same float64 maxima bin by bin: equal to summation rounding
    assert result.summary["confidence"] == pytest.approx(expected, rel=1e-12)
    plugin = result.summary["map_plugin"]["confidence"]
    assert 0.25 <= plugin <= 1.0  # 4 classes: a top-class probability is at least 1/4


# ---- behaviour the mutation sample found untested (issue 27) ----------------------------------
def test_the_results_clients_keep_their_ids_and_the_partition_file_their_sizes(tmp_path):
    result = simulate("fedavg", out=tmp_path, **{**SMALL, "rounds": 1})
    assert [c.data.client_id for c in result.clients] == list(range(6))
    text = (tmp_path / "partition.json").read_text()
    assert text.endswith("}\n")
    partition = json.loads(text)
    assert partition["train_sizes"] == [c.data.num_train for c in result.clients]
    assert sum(partition["train_sizes"]) + sum(partition["test_sizes"]) == 480


def test_calibrate_holds_out_part_of_every_clients_training_data(tmp_path):
    plain = simulate("fedavg", **{**SMALL, "rounds": 1})
    held = simulate("fedavg", calibrate="temperature:0.25", **{**SMALL, "rounds": 1})
    step = held.summary["calibration"]
    assert step["held_out_fraction"] == 0.25
    trained = sum(c.data.num_train for c in held.clients)
    assert trained + step["held_out_samples"] == sum(c.data.num_train for c in plain.clients)
    assert step["held_out_samples"] > 0


def test_an_authenticated_run_refuses_an_upload_without_its_clients_hmac(monkeypatch):
    from bayesfl.messages import KeyRing

    keys = KeyRing.generate()
    monkeypatch.setattr(KeyRing, "generate", staticmethod(lambda: keys))

    def unsigned(round_, client_id, data):  # client 1's upload re-sent with a plain digest
        if client_id != 1:
            return data
        return encode(decode(data, key=keys.client_key(1)))

    result = simulate("fedavg", authenticate=True, upload_hook=unsigned,
                      **{**SMALL, "rounds": 1})
    (rejection,) = result.summary["rejections"]
    assert rejection["client_id"] == 1 and "HMAC" in rejection["reason"]


def test_the_rounds_progress_bar_is_cleared_when_the_run_ends(capsys):
    # the bar of the rounds is transient (leave=False): the run's own output follows it
    simulate("fedavg", **{**SMALL, "rounds": 1, "progress": True})
    err = capsys.readouterr().err
    assert "fedavg on gaussian_mixture" in err and not err.endswith("\n")


def test_the_personalisation_bar_counts_clients(capsys):
    simulate("fedavg-ft", **{**SMALL, "rounds": 1, "progress": True})
    assert re.search(r"client/s|s/client", capsys.readouterr().err)


def test_a_resumed_state_may_have_grown_along_the_axes_a_fresh_run_starts_empty():
    # CoLearn's relay pool starts (0, C, d) and holds the round's sets after it: a checkpoint
    # may hold it grown along that axis, not along one a fresh run starts with a size
    from bayesfl.simulate import server_state_problem

    fresh = {"pool": torch.zeros(0, 3), "head": torch.zeros(2, 3)}
    assert server_state_problem({"pool": torch.zeros(5, 3), "head": torch.zeros(2, 3)},
                                fresh) is None
    assert server_state_problem({"pool": torch.zeros(5, 3), "head": torch.zeros(4, 3)},
                                fresh) == ("server tensor 'head' has shape (4, 3), this run's "
                                           "has (2, 3)")


def test_a_round_record_names_an_aggregation_error_only_when_there_was_one():
    result = simulate("fedavg", **{**SMALL, "rounds": 1})
    assert all("aggregate_error" not in m for m in result.metrics)


def test_the_summary_names_the_experiment():
    s = simulate("fedavg", **{**SMALL, "rounds": 1}).summary
    assert (s["strategy"], s["dataset"], s["partition"], s["clients"], s["rounds"], s["seed"],
            s["body"]) == ("fedavg", "gaussian_mixture", "shards:2", 6, 1, 3, "mlp:16")


def test_with_a_fraction_sampled_the_stacks_client_states_keep_alive_stay_within_twice_them(
        monkeypatch):
    # a batched fit leaves each client's trained tensors as row views of its round's stack; a
    # client not sampled since keeps that whole stack alive. Half the clients train each
    # round, so without restacking the stacks held grow past twice the states; the
    # simulator's restack after each round keeps them within (engine.state docstring)
    simulate_module = importlib.import_module("bayesfl.simulate")
    ratios = []

    def ratio(states):
        own, held = held_bytes(t for s in states.values() for t in s.values())
        return held / own

    def watching(clients, **options):
        out = compact_client_states(clients, **options)
        ratios.append((ratio(clients), ratio(out)))
        return out

    monkeypatch.setattr(simulate_module, "compact_client_states", watching)
    result = simulate("fedlog", **{**SMALL, "clients": 16, "fraction": 0.5, "rounds": 8,
                                   "dataset_options": {**SMALL["dataset_options"], "n": 960}})
    assert len(ratios) == 9  # round 0 and rounds 1-8
    assert max(before for before, _ in ratios) > 2.0  # the restack was needed
    assert max(after for _, after in ratios) <= 2.0
    final = {c.client_id: c.state for c in result.clients}
    assert ratio(final) <= 2.0
