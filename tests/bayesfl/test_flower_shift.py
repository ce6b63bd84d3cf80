"""The shift evaluation of a Flower run (issue 40): each site scores its own final state on its
own rows and replies with mergeable states only; the server validates every reply, builds the
report `bayesfl evaluate` writes from the valid ones and stores it in the run directory.

The ServerApp (`FlowerServer.run`) and the ClientApp's own handlers run for real; the
in-process tests carry their messages over `InProcessFederation` (test_flower.py); the loopback
test, over a real SuperLink and SuperNodes, is in test_flower.py (one run there carries it with
the calibration step and the novel clients).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from test_flower import InProcessFederation

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.flower.protocol import SHIFT, pack, parse_run_config, record_values
from bayesfl.messages import Header, Message, decode, encode
from bayesfl.shift_evaluation import client_shift_states
from bayesfl.shift_protocol import (
    PROTOCOL,
    Expected,
    ShiftRequest,
    read_shift_states,
    states_tensors,
    stored_shift_report,
)
from bayesfl.shifts import Shift
from bayesfl.simulate import simulate

# digits, 4 clients of 3 classes each (so every client misses labels), one of them novel
SHIFTED = {"dataset": "digits", "clients": 4, "partition": "shards:3", "rounds": 1, "seed": 3,
           "body": "mlp:8", "feature-dim": 4, "local-epochs": 1, "novel-fraction": 0.25,
           "threads": 1}
SHIFTS, OOD = ["rotate:30", "noise:0.1"], ["unseen-labels", "novel-clients"]


@pytest.fixture
def task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for key in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set
        monkeypatch.setattr(TaskIdentity, key, 1)


def serve(run_config: dict[str, Any], federation_class: type = InProcessFederation,
          **kwargs: Any):
    from bayesfl.flower.server_app import FlowerServer

    server = FlowerServer(None, run_config)
    server.grid = federation_class(run_config, **kwargs)
    return server


def simulate_shifted(out: Path, strategy: str = "fedlog") -> Any:
    return simulate(strategy, dataset="digits", clients=4, partition="shards:3", rounds=1,
                    seed=3, body="mlp:8", feature_dim=4, local_epochs=1, novel_fraction=0.25,
                    threads=1, progress=False, batched=False, out=out, shift=SHIFTS, ood=OOD)


def assert_reports_equal(flower: Any, sim: Any) -> None:
    # Counts (rows, in/OOD rows, clients, conditions) exactly. The figures: both sides score
    # the same float32 predictions of the same states with the same seeded noise and draws,
    # and merge the same float64 sums; 1e-9 leaves room for a differently laid-out batch of
    # the same rows (measured: 0 here), far below any real difference (a row more or less
    # moves an accuracy by 1/90)
    assert [(r["scope"], r["client"], r["shift"], r["severity"], r["predictive"], r["count"])
            for r in flower.shift] == \
        [(r["scope"], r["client"], r["shift"], r["severity"], r["predictive"], r["count"])
         for r in sim.shift]
    assert [(r["scope"], r["client"], r["ood"], r["predictive"], r["score"], r["n_in"],
             r["n_ood"]) for r in flower.ood] == \
        [(r["scope"], r["client"], r["ood"], r["predictive"], r["score"], r["n_in"], r["n_ood"])
         for r in sim.ood]
    for table in ("shift", "ood"):
        for got, want in zip(getattr(flower, table), getattr(sim, table), strict=True):
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, abs=1e-9, nan_ok=True), \
                        (table, key, want)
    assert {k: v for k, v in flower.settings.items() if k != "run_dir"} == \
        {k: v for k, v in sim.settings.items() if k != "run_dir"}
    assert flower.notes == sim.notes and flower.predictives == sim.predictives


@pytest.mark.slow  # ~30-60 s on a 2-core machine: a Flower and a simulated run on digits
def test_a_flower_run_writes_the_shift_report_the_simulator_writes(task_identity, tmp_path,
                                                                  capsys):
    from bayesfl.cli import main

    out = tmp_path / "flower"
    server = serve({**SHIFTED, "strategy": "fedlog", "out": str(out),
                    "shift": " ".join(SHIFTS), "ood": " ".join(OOD)})
    summary = server.run()
    sim = simulate_shifted(tmp_path / "sim")
    assert summary["events"] == []
    shifted = summary["shift_evaluation"]
    assert shifted["accepted"] == [0, 1, 2, 3] and shifted["rejections"] == []
    # the bytes: the request (JSON) to each of the 4 sites, each site's states message up;
    # the simulator counts what the same step would move
    assert shifted["bytes_down"] == 4 * len(server.shift_request.to_json().encode())
    assert shifted["bytes_up"] == sim.summary["shift_evaluation"]["bytes_up"] > 0
    assert shifted["bytes_down"] == sim.summary["shift_evaluation"]["bytes_down"]
    report = server.shift_outcome.report
    assert report.rows("ood", scope="pooled", score="mutual_information")  # a posterior's MI
    assert_reports_equal(report, sim.shift_report)
    # the run directory holds what `bayesfl evaluate` writes, and the states to rebuild it
    files = {p.name for p in (out / "shift").iterdir()}
    assert files == {"shift_report.json", "shift_report.md", "shift_metrics.png",
                     "risk_coverage.png", "shift_states.safetensors"}
    assert json.loads((out / "summary.json").read_text())["shift_evaluation"] == shifted
    assert_reports_equal(stored_shift_report(out), sim.shift_report)
    # bayesfl evaluate on the Flower directory: the stored report, written again
    capsys.readouterr()
    assert main(["evaluate", str(out), "--out", str(tmp_path / "again"), "--no-plots"]) == 0
    assert (tmp_path / "again" / "shift_report.json").read_text() == \
        (out / "shift" / "shift_report.json").read_text()
    assert main(["evaluate", str(out), "--shift", "rotate:30", "--shift", "noise:0.1",
                 "--ood", "novel-clients", "--ood", "unseen-labels", "--no-plots",
                 "--out", str(tmp_path / "same")]) == 0  # the same request, in another order
    # other shifts than the run's: an error that names them and the run keys to rerun with
    capsys.readouterr()
    assert main(["evaluate", str(out), "--shift", "rotate:60"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Flower run" in err and "rotate:60" in err
    assert 'shift = "rotate:60"' in err and 'ood = "unseen-labels novel-clients"' in err
    # and on the simulator's directory, the stored report is shown without flags
    assert main(["evaluate", str(tmp_path / "sim"), "--no-plots",
                 "--out", str(tmp_path / "sim-again")]) == 0
    assert (tmp_path / "sim-again" / "shift_report.json").read_text() == \
        (tmp_path / "sim" / "shift" / "shift_report.json").read_text()


class TamperingFederation(InProcessFederation):
    """Shift replies of client 0: junk bytes; client 1: a valid message whose counts were
    changed (re-encoded, so its digest holds); client 2: NaN in a sum; client 3 never
    answers the shift request."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for message, mid in zip(messages, ids, strict=True):
            cid = message.metadata.dst_node_id - 100
            if message.metadata.message_type != SHIFT or mid not in self.replies:
                continue
            reply = self.replies[mid]
            values = record_values(reply.content)
            if cid == 3:
                del self.replies[mid]
                continue
            if cid not in (0, 1, 2):
                continue
            if cid == 0:
                data = b"\x00junk" * 20
            else:
                decoded = decode(values["reply"])
                tensors = dict(decoded.tensors)
                name = next(n for n in tensors if n.endswith("/bin_counts"))
                if cid == 1:
                    tensors[name] = tensors[name] + 1  # one more row in every bin
                else:
                    nll = next(n for n in tensors if n.endswith("/nll_sum"))
                    tensors[nll] = torch.tensor(float("nan"), dtype=torch.float64)
                data = encode(Message(decoded.header, tensors))
            reply.content = pack(reply=data, notes=values["notes"])
        return ids


def test_invalid_and_missing_shift_replies_are_left_out_and_the_report_comes_from_the_others(
        task_identity, tmp_path):
    config = {"dataset": "gaussian_mixture", "clients": 5, "partition": "iid", "rounds": 1,
              "seed": 3, "body": "mlp:8", "feature-dim": 4, "local-epochs": 1,
              "dataset-option.n": 150, "dataset-option.num_classes": 3,
              "dataset-option.dim": 5, "strategy": "fedavg", "threads": 1,
              "round-timeout": 5.0, "poll-interval": 0.01, "shift": "noise:0.2"}
    honest = serve(config)
    honest.run()
    server = serve({**config, "out": str(tmp_path / "run")}, TamperingFederation)
    summary = server.run()
    shifted = summary["shift_evaluation"]
    assert shifted["accepted"] == [4] and shifted["error"] is None
    reasons = {r["client_id"]: r["reason"] for r in shifted["rejections"]}
    assert set(reasons) == {0, 1, 2, 3}
    assert "no reply" in reasons[3]
    assert "counts 2" in reasons[1] or "rows" in reasons[1], reasons[1]
    assert "NaN" in reasons[2] or "non-finite" in reasons[2], reasons[2]
    report = server.shift_outcome.report
    assert {r["client"] for r in report.rows(scope="client")} == {4}
    assert sum("no shift states" in n for n in report.notes) == 4
    # the accepted client's figures are the honest run's, and the pooled ones are its own
    want = honest.shift_outcome.report
    for row in report.rows(scope="client"):
        (same,) = want.rows(scope="client", client=4, shift=row["shift"],
                            severity=row["severity"], predictive=row["predictive"])
        assert row == same
        (pooled,) = report.rows(scope="pooled", shift=row["shift"], severity=row["severity"],
                                predictive=row["predictive"])
        assert {k: v for k, v in pooled.items() if k not in ("scope", "client", "novel")} == \
            {k: v for k, v in row.items() if k not in ("scope", "client", "novel")}
    assert (tmp_path / "run" / "shift" / "shift_report.json").is_file()


# ---- the reply's checks, message by message ---------------------------------------------------
C = 4
REQUEST = ShiftRequest((Shift("noise", (0.1,)),), ("unseen-labels",), n_bins=5,
                       data_range=(0.0, 1.0), posterior_samples=2)


def valid_states(n: int = 30, n_in: int = 20, n_ood: int = 10) -> Any:
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, C, (n,), generator=generator)
    inside = torch.rand(n_in, 3, generator=generator, dtype=torch.float64)
    outside = torch.rand(n_ood, 3, generator=generator, dtype=torch.float64)
    weights = torch.randn(3, C, generator=generator, dtype=torch.float64)

    def predict(rows):
        logits = rows @ weights
        return {"predictive": torch.softmax(logits, 1), "map_plugin": torch.softmax(2 * logits, 1)}

    def draws(rows):
        return torch.stack([torch.softmax(rows @ (weights + 0.5 * k), 1) for k in range(2)])

    return client_shift_states(predict, x, y, shifts=REQUEST.shifts, image_shape=None,
                               value_range=(0.0, 1.0), n_bins=5,
                               noise_generator=torch.Generator().manual_seed(1),
                               ood_rows={"unseen-labels": (inside, outside)}, draws=draws,
                               client_id=2)


EXPECTED = Expected(30, {"unseen-labels": (20, 10)})


def read(tensors: dict[str, torch.Tensor], client_id: int = 2,
         header: Header | None = None, expected: Expected = EXPECTED) -> Any:
    header = header or Header(PROTOCOL, 0, client_id, "up")
    return read_shift_states(encode(Message(header, tensors)), client_id=client_id,
                             request=REQUEST, predictives={"predictive", "map_plugin"},
                             num_classes=C, expected=expected)


def test_a_valid_reply_reads_back_to_the_states_it_was_made_of():
    states = valid_states()
    got = read(states_tensors(states))
    assert list(got.calibration) == list(states.calibration)
    assert list(got.detection) == list(states.detection)
    for key, acc in states.calibration.items():
        assert got.calibration[key].compute() == acc.compute()
    for key, acc in states.detection.items():
        assert got.detection[key].compute() == acc.compute()
    for key, acc in states.selective.items():
        assert got.selective[key].compute() == acc.compute()


def _renamed(tensors, old, new):
    return {(new if k == old else k): v for k, v in tensors.items()}


@pytest.mark.parametrize("change, reason", [
    (lambda t: {**t, "calibration/none/0.0/predictive/extra": torch.zeros(1)}, "unexpected"),
    (lambda t: {k: v for k, v in t.items() if not k.startswith("selective/noise")}, "missing"),
    (lambda t: {**t, "calibration/none/0.0/predictive/nll_sum": torch.tensor(float("inf"),
                                                                          dtype=torch.float64)},
     "non-finite|Inf|finite"),
    (lambda t: {**t, "calibration/none/0.0/predictive/bin_counts":
                t["calibration/none/0.0/predictive/bin_counts"].float()}, "dtype"),
    (lambda t: {**t, "calibration/none/0.0/predictive/bin_counts":
                t["calibration/none/0.0/predictive/bin_counts"][:4]}, "shape"),
    (lambda t: {**t, "selective/none/0.0/predictive/in_counts":
                t["selective/none/0.0/predictive/in_counts"] + 1}, "test rows"),
    (lambda t: {**t, "detection/unseen-labels/predictive/entropy/ood_counts":
                t["detection/unseen-labels/predictive/entropy/ood_counts"] * 2}, "OOD rows"),
    (lambda t: {**t, "detection/unseen-labels/predictive/entropy/values":
                t["detection/unseen-labels/predictive/entropy/values"] + 5.0},
     r"scores outside \[0, 1.386\]"),
    (lambda t: {**t, "calibration/none/0.0/map_plugin/bin_correct_counts":
                t["calibration/none/0.0/map_plugin/bin_counts"] + 1}, "exceed"),
])
def test_an_invalid_reply_is_rejected_with_its_reason(change, reason):
    with pytest.raises(MessageRejected, match=reason):
        read(change(states_tensors(valid_states())))


def test_a_reply_from_another_client_or_protocol_or_with_unexpected_ood_rows_is_rejected():
    tensors = states_tensors(valid_states())
    with pytest.raises(MessageRejected, match="client_id"):
        read(tensors, header=Header(PROTOCOL, 0, 1, "up"))
    with pytest.raises(MessageRejected, match="strategy"):
        read(tensors, header=Header("fedavg", 0, 2, "up"))
    with pytest.raises(MessageRejected, match="unexpected"):  # this client has no such rows
        read(tensors, expected=Expected(30, {}))
    # the mutual information is optional (a posterior that gives no single draws)
    without = {k: v for k, v in tensors.items() if "mutual_information" not in k}
    assert not any(k[2] == "mutual_information" for k in read(without).detection)


def test_a_request_travels_as_json_and_a_bad_one_is_refused():
    assert ShiftRequest.from_json(REQUEST.to_json()) == REQUEST
    for text in ("{", json.dumps({"shifts": [["spin", [1]]]}), None,
                 REQUEST.to_json().replace('"coverage":0.8', '"coverage":2')):
        with pytest.raises(MessageRejected, match="not a shift request"):
            ShiftRequest.from_json(text)


# ---- refused before the run trains ----------------------------------------------------------
def test_a_shift_request_the_run_cannot_answer_is_refused_before_it_trains(task_identity):
    base = {"dataset": "gaussian_mixture", "clients": 3, "partition": "iid", "rounds": 1,
            "body": "mlp:8", "feature-dim": 4, "dataset-option.n": 90,
            "dataset-option.num_classes": 3, "dataset-option.dim": 5, "strategy": "fedavg"}
    from bayesfl.flower.server_app import FlowerServer

    with pytest.raises(ConfigError, match="needs images"):
        FlowerServer(None, {**base, "shift": "rotate:30"})
    with pytest.raises(ConfigError, match="no novel clients"):
        FlowerServer(None, {**base, "ood": "novel-clients"})
    with pytest.raises(ConfigError, match="every client trained on every label"):
        FlowerServer(None, {**base, "ood": "unseen-labels"})
    with pytest.raises(ConfigError, match="unknown ood set"):
        parse_run_config({**base, "ood": "faraway"})
    with pytest.raises(ConfigError, match="data-loader"):
        parse_run_config({**base, "ood": "unseen-labels", "data-loader": "site_app.x:load"})
    with pytest.raises(ConfigError, match="needs images"):
        simulate("fedavg", dataset="gaussian_mixture", clients=3, partition="iid", rounds=1,
                 dataset_options={"n": 90, "num_classes": 3, "dim": 5}, progress=False,
                 shift=["rotate:30"])
    _, options = parse_run_config({**base, "shift": "noise:0.1 noise:0.2", "ood": ""})
    assert options.shift == ("noise:0.1", "noise:0.2") and options.ood == ()


# ---- a real loopback deployment -------------------------------------------------------------
# The supernodes' own shift evaluation against the simulator's runs in test_flower.py
# (test_calibrate_novel_clients_and_shift_evaluation_on_supernodes_equal_the_simulator): one
# deployment run there carries it with the calibration step and the novel clients.
