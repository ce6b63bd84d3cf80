"""Federated temperature scaling: the held-out split, the message protocol, its validation, and
equality with centralised temperature scaling on the pooled held-out data."""

import json
import math

import numpy as np
import pytest
import torch

from bayesfl import calibrate as calibrate_module
from bayesfl.calibrate import (
    DEFAULT_HELD_OUT_FRACTION,
    PROPOSAL_SCHEMA,
    PROTOCOL,
    REPLY_SCHEMA,
    CalibrationSpec,
    TemperatureClient,
    calibrated,
    federated_temperature_search,
    hold_out,
    parse_calibrate,
    proposal_message,
    reply_problem,
    result_message,
    temperature_of,
)
from bayesfl.cli import main as cli_main
from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import KeyRing, Message, decode, encode, validate
from bayesfl.simulate import simulate
from bayesfl.strategies.base import PREDICTIVE
from calibration import evaluate
from calibration.temperature import (
    NLLDerivatives,
    apply_temperature,
    fit_temperature,
    nll_derivatives,
)


def client_probabilities(seed: int, sizes, num_classes: int = 4, sharpen: float = 2.5):
    """Per client: an overconfident predictive (probabilities) on its held-out data + labels."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        logits = rng.normal(size=(n, num_classes)) * 1.5
        truth = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        labels = np.array([rng.choice(num_classes, p=p) for p in truth])
        sharp = np.exp(logits * sharpen)
        out.append((torch.from_numpy(sharp / sharp.sum(1, keepdims=True)),
                    torch.from_numpy(labels)))
    return out


def temperature_clients(data):
    return [TemperatureClient.from_probabilities(k, p, y) for k, (p, y) in enumerate(data)]


# ---- configuration and the held-out split -------------------------------------------------------
def test_calibrate_settings_are_parsed_or_refused():
    assert parse_calibrate(None) is None
    assert parse_calibrate("temperature") == CalibrationSpec("temperature",
                                                             DEFAULT_HELD_OUT_FRACTION)
    assert parse_calibrate("temperature:0.3") == CalibrationSpec("temperature", 0.3)
    for bad in ("platt", "temperature:1.5", "temperature:x", "", 1):
        with pytest.raises(ConfigError, match="calibrate"):
            parse_calibrate(bad)


def make_client(client_id, labels):
    labels = torch.as_tensor(labels)
    x = torch.arange(len(labels), dtype=torch.float32)[:, None].repeat(1, 3)
    return ClientData(client_id, x, labels, x[:2], labels[:2],
                      train_indices=np.arange(len(labels)) + 100 * client_id,
                      test_indices=np.array([0, 1]))


def test_held_out_data_are_a_stratified_disjoint_share_of_each_clients_training_data():
    clients = [make_client(0, [0] * 20 + [1] * 10), make_client(1, [2] * 7), make_client(2, [3])]
    kept, held = hold_out(clients, 0.2, seed=0)
    for before, after in zip(clients, kept, strict=True):
        assert after.client_id == before.client_id and after.test_y is before.test_y
    # 30 samples: round(30 * 0.2) = 6 held out, 4 of class 0 and 2 of class 1
    assert held[0].size == 6 and sorted(held[0].y.tolist()) == [0, 0, 0, 0, 1, 1]
    assert kept[0].num_train == 24
    together = np.concatenate([kept[0].train_indices, held[0].indices])
    assert sorted(together.tolist()) == clients[0].train_indices.tolist()  # disjoint, complete
    # the rows travel with their indices
    rows = held[0].x[:, 0].long().numpy()
    assert (clients[0].train_indices[rows] == held[0].indices).all()
    assert held[1].size == 1 and kept[1].num_train == 6  # at least one held out
    assert 2 not in held and kept[2] is clients[2]  # one sample: nothing to hold out
    _, held_again = hold_out(clients, 0.2, seed=0)
    assert (held_again[0].indices == held[0].indices).all()  # seeded


# ---- the protocol ----------------------------------------------------------------------------
def test_a_reply_carries_four_numbers_of_the_clients_held_out_data():
    (probs, labels), = client_probabilities(0, [30])
    client = TemperatureClient.from_probabilities(3, probs, labels)
    proposal = decode(encode(proposal_message(5, 0.25)))
    validate(proposal, PROPOSAL_SCHEMA, strategy=PROTOCOL, direction="down")
    reply = decode(encode(client.reply(proposal)))
    validate(reply, REPLY_SCHEMA, strategy=PROTOCOL, round=5, client_id=3, direction="up")
    assert reply.num_elements == 4  # never predictions: 3 float64 and a count
    expected = nll_derivatives(probs, labels, 0.25, from_logits=False)
    np.testing.assert_allclose(reply.tensors["nll_derivatives"].numpy(),
                               [expected.nll_sum, expected.d1, expected.d2], rtol=1e-13)
    assert int(reply.tensors["num_samples"]) == 30


def test_a_client_refuses_a_proposal_of_the_wrong_shape():
    (probs, labels), = client_probabilities(1, [10])
    client = TemperatureClient.from_probabilities(0, probs, labels)
    bad = Message(proposal_message(0, 0.0).header,
                  {"log_temperature": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(MessageRejected, match="shape"):
        client.reply(bad)


def test_federated_temperature_equals_centralised_temperature_on_the_pooled_data():
    data = client_probabilities(2, [13, 40, 7, 25, 60, 1])
    outcome = federated_temperature_search(temperature_clients(data), num_classes=4)
    pooled = fit_temperature(torch.cat([p for p, _ in data]), torch.cat([y for _, y in data]),
                             from_logits=False)
    # the acceptance tolerance is 1e-6; summing per client changes only the rounding (~1e-13)
    assert outcome.fit.temperature == pytest.approx(pooled.temperature, rel=1e-6, abs=0)
    assert outcome.fit.temperature == pytest.approx(pooled.temperature, rel=1e-11)
    assert outcome.fit.temperature > 1.5  # 2.5x sharpened: a real correction was needed
    assert outcome.fit.count == 146 and outcome.participants == list(range(6))
    assert outcome.steps == outcome.fit.evaluations <= 12
    assert outcome.rejections == [] and outcome.restarts == 0 and outcome.error is None


def test_bytes_and_numbers_of_the_step_are_counted_on_the_encoded_messages():
    data = client_probabilities(3, [20, 30, 40])
    outcome = federated_temperature_search(temperature_clients(data), num_classes=4)
    proposal_bytes = len(encode(proposal_message(0, 0.0)))
    reply_bytes = len(encode(temperature_clients(data)[0].reply(proposal_message(0, 0.0))))
    # every proposal goes to 3 clients, every client answers each one
    assert outcome.floats_down == 3 * outcome.steps and outcome.floats_up == 4 * 3 * outcome.steps
    # encoded sizes vary by a few bytes with the digits of the round number in the header
    assert abs(outcome.bytes_down - 3 * outcome.steps * proposal_bytes) <= 3 * outcome.steps * 4
    assert abs(outcome.bytes_up - 3 * outcome.steps * reply_bytes) <= 3 * outcome.steps * 4
    assert reply_bytes > 4 * 8  # the numbers plus the header and digest


def test_the_result_broadcast_scales_the_clients_predictive():
    (probs, _), = client_probabilities(4, [15])
    message = decode(encode(result_message(7, 2.0)))
    temperature = temperature_of(message)
    assert temperature == 2.0
    expected = probs.sqrt() / probs.sqrt().sum(1, keepdim=True)
    torch.testing.assert_close(calibrated(probs, temperature), expected, rtol=1e-12, atol=0)
    bad = Message(message.header, {"temperature": torch.tensor([-1.0], dtype=torch.float64)})
    with pytest.raises(MessageRejected, match="> 0"):
        temperature_of(bad)


# ---- validation on receipt ---------------------------------------------------------------------
@pytest.mark.parametrize("s", [math.log(0.01), -1.0, 0.0, 1.3, math.log(100.0)])
def test_honest_replies_satisfy_the_bounds_at_every_temperature(s):
    for probs, labels in client_probabilities(5, [1, 50], sharpen=6.0):
        point = nll_derivatives(probs, labels, s, from_logits=False)
        assert reply_problem(point, 4, None) is None
    # extremes: certain and right, certain and wrong, uniform
    eye = torch.eye(4, dtype=torch.float64)
    for labels in (torch.arange(4), torch.tensor([1, 2, 3, 0])):
        assert reply_problem(nll_derivatives(eye, labels, s, from_logits=False), 4, None) is None
    uniform = torch.full((3, 4), 0.25, dtype=torch.float64)
    point = nll_derivatives(uniform, torch.arange(3), s, from_logits=False)
    assert reply_problem(point, 4, None) is None


@pytest.mark.parametrize("tamper, reason", [
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] * torch.tensor([-1.0, 1, 1],
                                                                            dtype=torch.float64)},
     "summed NLL"),
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] + torch.tensor([0.0, 1e9, 0],
                                                                            dtype=torch.float64)},
     "first derivative"),
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] + torch.tensor([0.0, -1e9, 0],
                                                                            dtype=torch.float64)},
     "first derivative"),
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] + torch.tensor([0.0, 0, 1e9],
                                                                            dtype=torch.float64)},
     "second derivative"),
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] + torch.tensor([1e9, 0, 0],
                                                                            dtype=torch.float64)},
     "summed NLL"),
    (lambda t: {**t, "nll_derivatives": t["nll_derivatives"] + torch.tensor([0.0, 0, -1e9],
                                                                            dtype=torch.float64)},
     "second derivative"),
    (lambda t: {**t, "num_samples": t["num_samples"] * 0}, "num_samples must be >= 1"),
    (lambda t: {**t, "nll_derivatives": torch.full((3,), math.nan, dtype=torch.float64)},
     "non-finite"),
    (lambda t: {**t, "predictions": torch.zeros(5)}, "unexpected tensors"),
])
def test_a_tampered_reply_drops_its_client_and_the_rest_still_get_their_pooled_temperature(
        tamper, reason):
    data = client_probabilities(6, [30, 20, 25])

    def hook(step, client_id, data_bytes):
        if client_id != 1 or step != 1:
            return data_bytes
        message = decode(data_bytes)
        return encode(Message(message.header, tamper(dict(message.tensors))))

    outcome = federated_temperature_search(temperature_clients(data), 4, upload_hook=hook)
    assert [r["client_id"] for r in outcome.rejections] == [1]
    assert reason in outcome.rejections[0]["reason"] and outcome.rejections[0]["step"] == 1
    assert outcome.restarts == 1 and outcome.participants == [0, 2]
    rest = [data[0], data[2]]
    pooled = fit_temperature(torch.cat([p for p, _ in rest]), torch.cat([y for _, y in rest]),
                             from_logits=False)
    assert outcome.fit.temperature == pytest.approx(pooled.temperature, rel=1e-11)


# at s = log T = 0 the floored log-probabilities' spread is w = -log(1e-12) = 12 log 10 per
# sample; the bounds for n = 2 samples and C = 4 classes, worked by hand
W = 12 * math.log(10)
BOUNDS = {  # index into (nll_sum, d1, d2): (lower, upper)
    0: (0.0, 2 * (W + math.log(4))),
    1: (-2 * W, 2 * W),
    2: (-2 * W, 2 * (W * W / 4 + W)),
}
HONEST = (1.0, 0.5, 0.25)  # well inside every range


@pytest.mark.parametrize("index, name", [(0, "summed NLL"), (1, "first derivative"),
                                         (2, "second derivative")])
def test_each_bound_of_a_reply_holds_on_both_sides(index, name):
    # a value 1e-6 (relative) inside either bound passes, 1e-6 outside is refused: the slack,
    # 1e-9 n (1 + w^2) = 1.5e-6, is far below 1e-6 of bounds of order 10-800 (the lower NLL
    # bound 0 is tested at -1e-3 and 0)
    low, high = BOUNDS[index]

    def problem(value):
        values = list(HONEST)
        values[index] = value
        return reply_problem(NLLDerivatives(0.0, *values, 2), 4, None)

    assert problem(high * (1 - 1e-6)) is None
    assert name in problem(high * (1 + 1e-6))
    if low == 0.0:
        assert problem(0.0) is None and name in problem(-1e-3)
    else:
        assert problem(low * (1 - 1e-6)) is None
        assert name in problem(low * (1 + 1e-6))


def test_the_bounds_scale_with_the_proposed_temperature():
    # at T = 2 (s = log 2) the spread halves: a first derivative of 1.5 w (n = 2) is honest
    # at T = 1 and refused at T = 2, whose bound is n w / 2 = w
    point = dict(nll_sum=1.0, d1=-1.5 * W, d2=0.0, count=2)
    assert reply_problem(NLLDerivatives(0.0, **point), 4, None) is None
    assert "first derivative" in reply_problem(NLLDerivatives(math.log(2.0), **point), 4, None)


def test_bounds_limit_the_searched_temperature():
    # the pooled optimum lies above 1.5 (2.5x sharpened predictives); searched in [0.5, 1.2]
    # the fit stops at the upper bound and says so
    data = client_probabilities(2, [13, 40, 7])
    free = federated_temperature_search(temperature_clients(data), 4)
    capped = federated_temperature_search(temperature_clients(data), 4, bounds=(0.5, 1.2))
    assert free.fit.temperature > 1.5 and free.fit.at_bound is None
    assert capped.fit.temperature == 1.2 and capped.fit.at_bound == "upper"
    assert capped.fit.bounds == (0.5, 1.2)


def test_a_sample_count_that_changes_between_proposals_is_rejected():
    point = NLLDerivatives(0.0, 10.0, 1.0, 2.0, 12)
    assert "changed" in reply_problem(point, 4, expected_count=11)


def test_garbage_bytes_are_rejected_and_with_no_one_left_no_temperature_is_fitted():
    data = client_probabilities(7, [10, 10])
    outcome = federated_temperature_search(temperature_clients(data), 4,
                                           upload_hook=lambda step, cid, b: b"\x00" * 40)
    assert outcome.fit is None and outcome.participants == []
    assert "no client" in outcome.error
    assert all("not a bayesfl message" in r["reason"] for r in outcome.rejections)


def test_a_search_without_participants_reports_an_error_instead_of_failing():
    outcome = federated_temperature_search([], num_classes=3)
    assert outcome.fit is None and outcome.steps == 0 and outcome.error


def test_authenticated_messages_carry_each_senders_hmac():
    data = client_probabilities(8, [20, 15])
    keys = KeyRing.generate()
    plain = federated_temperature_search(temperature_clients(data), 4)
    signed = federated_temperature_search(temperature_clients(data), 4, keys=keys)
    assert signed.fit.temperature == plain.fit.temperature and signed.rejections == []

    def impostor(step, client_id, data_bytes):  # client 1's reply re-signed with client 0's key
        if client_id != 1:
            return data_bytes
        return encode(decode(data_bytes, key=keys.client_key(1)), key=keys.client_key(0))

    outcome = federated_temperature_search(temperature_clients(data), 4, keys=keys,
                                           upload_hook=impostor)
    assert [r["client_id"] for r in outcome.rejections] == [1]
    assert outcome.participants == [0]


# ---- the final step of a federated run --------------------------------------------------------
SMALL = dict(
    dataset="gaussian_mixture", clients=6, partition="shards:2", rounds=2, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    dataset_options={"num_classes": 4, "dim": 10, "n": 480, "separation": 4.0},
)


def pooled_held_out_predictive(result):
    """What the clients' search never shows the server: their held-out probabilities."""
    probs, labels = [], []
    for client in result.clients:
        held = result.calibration.held_out.get(client.client_id)
        if held is None:
            continue
        predictive = result.strategy.predict(client.config, result.client_state(client.client_id),
                                             result.evaluation_broadcast, held.x)[PREDICTIVE]
        probs.append(predictive.double())
        labels.append(held.y)
    return torch.cat(probs), torch.cat(labels)


@pytest.mark.trained
def test_a_fedlog_run_with_temperature_scaling_reports_both_figures_and_the_steps_bytes(
        tmp_path):
    result = simulate("fedlog", calibrate="temperature", out=tmp_path, **SMALL)
    summary = json.loads((tmp_path / "summary.json").read_text())
    step = summary["calibration"]
    assert step == result.summary["calibration"]
    assert step["method"] == "temperature" and step["error"] is None
    assert step["participants"] == list(range(6)) and step["rejections"] == []
    # uncalibrated: the run's headline figures; calibrated: the same clients' test data
    for key in ("accuracy", "ece", "nll", "brier"):
        assert step["uncalibrated"][key] == summary[key]
    calibrated_figures = step["calibrated"]
    assert calibrated_figures["accuracy"] == pytest.approx(summary["accuracy"])  # T keeps argmax
    assert len(calibrated_figures["per_client"]) == 6
    # one T fitted on the held-out data: it lowers their NLL (T = 1 was a candidate)
    assert step["held_out_nll_after"] < step["held_out_nll_before"]
    assert calibrated_figures["ece"] != summary["ece"]
    # bytes: every proposal to every participant, every reply, the result to every client
    assert step["steps"] >= 2 and step["floats_up"] == 4 * 6 * step["steps"]
    assert step["floats_down"] == 6 * step["steps"] + 6
    proposal = len(encode(proposal_message(0, 0.0)))
    assert step["bytes_down"] >= (6 * step["steps"] + 6) * proposal - 6 * (step["steps"] + 1) * 4
    assert step["bytes_up"] >= 6 * step["steps"] * 4 * 8
    assert step["held_out_samples"] == sum(h.size for h in result.calibration.held_out.values())


@pytest.mark.parametrize("strategy", ["fedlog", "fedbabu"])  # fedbabu: personalised states
def test_the_runs_temperature_equals_centralised_temperature_on_the_pooled_held_out_data(
        strategy):
    result = simulate(strategy, calibrate="temperature:0.3", **SMALL)
    probs, labels = pooled_held_out_predictive(result)
    pooled = fit_temperature(probs, labels, from_logits=False)
    step = result.summary["calibration"]
    assert step["held_out_fraction"] == 0.3 and step["held_out_samples"] == len(labels)
    assert step["temperature"] == pytest.approx(pooled.temperature, rel=1e-6, abs=0)
    # the calibrated figures are the metrics of p^(1/T) on every client's test data
    test_probs, test_labels = [], []
    for client in result.clients:
        p = result.predict_proba(client.client_id, client.data.test_x)
        test_probs.append(apply_temperature(p, step["temperature"], from_logits=False))
        test_labels.append(client.data.test_y)
    expected = evaluate(torch.cat(test_probs), torch.cat(test_labels))
    assert step["calibrated"]["ece"] == pytest.approx(expected["ece"], rel=1e-9)
    assert step["calibrated"]["nll"] == pytest.approx(expected["nll"], rel=1e-9)


def test_an_authenticated_run_signs_the_calibration_messages_too(monkeypatch):
    seen = {}
    search = calibrate_module.temperature_search_over  # the run's search, over its channel

    def forged(step, client_id, data):  # client 2 signs its reply with a key of its making
        if client_id != 2:
            return data
        return encode(decode(data, key=seen["keys"].client_key(2)), key=b"k" * 32)

    def with_forger(*args, **kwargs):
        seen["keys"] = kwargs["keys"]
        return search(*args, **{**kwargs, "upload_hook": forged})

    monkeypatch.setattr(calibrate_module, "temperature_search_over", with_forger)
    result = simulate("fedlog", calibrate="temperature", authenticate=True, **SMALL)
    assert isinstance(seen["keys"], KeyRing)  # the run's keys reached the step
    step = result.summary["calibration"]
    assert [r["client_id"] for r in step["rejections"]] == [2]
    assert "HMAC" in step["rejections"][0]["reason"]
    assert step["participants"] == [0, 1, 3, 4, 5] and step["calibrated"] is not None


def test_held_out_data_are_not_trained_on_and_runs_without_the_step_are_unchanged():
    plain = simulate("fedlog", **SMALL)
    calibrated_run = simulate("fedlog", calibrate="temperature", **SMALL)
    assert "calibration" not in plain.summary and plain.calibration is None
    for before, after in zip(plain.clients, calibrated_run.clients, strict=True):
        held = calibrated_run.calibration.held_out[after.client_id]
        assert after.data.num_train + held.size == before.data.num_train
        assert not set(held.indices) & set(after.data.train_indices)
        assert torch.equal(after.data.test_y, before.data.test_y)  # the same test data


def test_the_cli_flag_runs_the_step(tmp_path, capsys):
    flags = ["run", "--strategy", "fedlog", "--dataset", "gaussian_mixture", "--clients", "4",
             "--rounds", "1", "--body", "mlp:8", "--feature-dim", "4", "--local-epochs", "1",
             "--no-progress", "--calibrate", "temperature", "--out", str(tmp_path / "run"),
             "--dataset-option", "n=200", "--dataset-option", "num_classes=4"]
    assert cli_main(flags) == 0
    assert "temperature scaling: T = " in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["calibration"]["calibrated"] is not None
    assert cli_main([*flags[:-4], "--calibrate", "platt", "--out", str(tmp_path / "x")]) == 2


# ---- behaviour the mutation sample found untested (issue 27) ----------------------------------
def test_server_messages_of_the_step_are_sent_by_the_server_id():
    # every broadcast of a run comes from sender -1, the proposals and the result as well
    assert proposal_message(3, 0.5).header.client_id == -1
    assert result_message(3, 2.0).header.client_id == -1


def test_a_client_with_fewer_than_two_training_samples_keeps_them_and_the_others_split():
    # the second client still holds out its share after the first one (1 sample) kept its
    lone, ten = make_client(0, [1]), make_client(1, [0, 1] * 5)
    kept, held = hold_out([lone, ten], 0.2, seed=0)
    assert [c.client_id for c in kept] == [0, 1]
    assert kept[0].num_train == 1 and list(held) == [1]
    assert kept[1].num_train == 8 and held[1].size == 2


class _BrokenClient(TemperatureClient):
    def reply(self, proposal):
        raise ValueError("no held-out data left")


def test_a_client_that_fails_to_answer_is_dropped_with_its_reason():
    data = client_probabilities(6, [30, 20, 25])
    clients = temperature_clients(data)
    clients[1] = _BrokenClient(1, clients[1].log_probs, clients[1].labels)
    outcome = federated_temperature_search(clients, 4)
    assert outcome.rejections == [{"step": 0, "client_id": 1,
                                   "reason": "client failed to answer: no held-out data left"}]
    assert outcome.participants == [0, 2] and outcome.fit is not None


def test_a_reply_sent_in_another_clients_name_is_rejected():
    # client 1's reply re-headed as client 0's: the server checks the sender of each reply
    data = client_probabilities(6, [30, 20, 25])

    def hook(step, client_id, data_bytes):
        if client_id != 1:
            return data_bytes
        message = decode(data_bytes)
        header = type(message.header)(message.header.strategy, message.header.round, 0,
                                      message.header.direction)
        return encode(Message(header, dict(message.tensors)))

    outcome = federated_temperature_search(temperature_clients(data), 4, upload_hook=hook)
    assert [r["client_id"] for r in outcome.rejections] == [1]
    assert "client_id" in outcome.rejections[0]["reason"]
    assert outcome.participants == [0, 2]


def test_a_sample_count_changed_during_the_search_drops_the_client():
    data = client_probabilities(6, [30, 20, 25])

    def hook(step, client_id, data_bytes):
        if client_id != 2 or step != 1:
            return data_bytes
        message = decode(data_bytes)
        return encode(Message(message.header, {**message.tensors,
                                               "num_samples": torch.tensor([24])}))

    outcome = federated_temperature_search(temperature_clients(data), 4, upload_hook=hook)
    assert outcome.rejections == [{"step": 1, "client_id": 2,
                                   "reason": "num_samples changed from 25 to 24 during the step"}]


def test_a_search_that_cannot_run_reports_why():
    data = client_probabilities(6, [30])
    outcome = federated_temperature_search(temperature_clients(data), 4, bounds=(2.0, 1.0))
    assert outcome.fit is None
    assert outcome.error == "temperature bounds must satisfy 0 < low < high < inf, got (2.0, 1.0)"


def test_each_upper_bound_of_a_reply_is_itself_accepted_slack_included():
    # at s = 0, n = 2, C = 4: the docstring's bounds, w = -log(1e-12) e^-s, plus the slack
    # 1e-9 n (1 + w^2), computed as reply_problem states them: the bound itself is accepted,
    # the next float above it refused
    w = -math.log(1e-12) * math.exp(-0.0)
    slack = 1e-9 * 2 * (1.0 + w * w)
    for index, bound, name in ((0, 2 * (w + math.log(4)) + slack, "summed NLL"),
                               (2, 2 * (w * w / 4 + w) + slack, "second derivative")):
        values = list(HONEST)
        values[index] = bound
        assert reply_problem(NLLDerivatives(0.0, *values, 2), 4, None) is None, name
        values[index] = math.nextafter(bound, math.inf)
        assert name in reply_problem(NLLDerivatives(0.0, *values, 2), 4, None)


def test_the_summary_of_the_step_reports_the_fit_and_its_costs():
    from bayesfl.calibrate import CalibrationOutcome

    data = client_probabilities(3, [20, 30, 40])
    search = federated_temperature_search(temperature_clients(data), num_classes=4)
    fit = search.fit
    summary = CalibrationOutcome(search, None, {}, 0.1).summary({"ece": 0.2, "other": 1})
    assert summary["temperature"] == fit.temperature
    assert summary["log_temperature"] == math.log(fit.temperature) == fit.log_temperature
    assert summary["flat"] is False and summary["at_bound"] is None
    assert summary["held_out_nll_before"] == fit.nll_at_one > summary["held_out_nll_after"]
    assert summary["steps"] == search.steps and summary["restarts"] == 0
    assert summary["uncalibrated"] == {"ece": 0.2} and summary["calibrated"] is None
    failed = federated_temperature_search([], num_classes=4)
    empty = CalibrationOutcome(failed, None, {}, 0.1).summary({})
    assert [empty[k] for k in ("temperature", "log_temperature", "at_bound", "flat",
                               "held_out_nll_before", "held_out_nll_after")] == [None] * 6
    assert empty["error"] == failed.error and empty["bounds"] == [0.01, 100.0]


def test_an_authenticated_run_signs_the_result_broadcast_with_the_servers_key(monkeypatch):
    signed = []
    original = calibrate_module.encode

    def recording(message, key=None):
        if "temperature" in message.tensors:
            signed.append(key)
        return original(message, key=key)

    monkeypatch.setattr(calibrate_module, "encode", recording)
    keys = KeyRing.generate()
    monkeypatch.setattr(KeyRing, "generate", staticmethod(lambda: keys))
    simulate("fedlog", calibrate="temperature", authenticate=True, **SMALL)
    assert signed == [keys.server_key]
