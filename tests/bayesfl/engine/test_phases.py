"""The final phases written once (bayesfl.engine.phases): one server-side function and one
client-side function per request, the transport only carrying the bytes; a bad or missing
reply is a rejection with its reason and the result comes from the others.

The simulator/Flower parity of each phase is tested end to end in test_calibrate.py,
test_flower.py (calibrate), test_flower_conformal.py and test_flower_shift.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bayesfl import calibrate, conformal, holdout, shift_protocol
from bayesfl.calibration_spec import parse_calibrate
from bayesfl.conformal_spec import parse_conformal
from bayesfl.engine.phases import InProcessPhases, Site
from bayesfl.errors import MessageRejected
from bayesfl.messages import decode, encode
from bayesfl.simulate import simulate
from bayesfl.strategies.base import PREDICTIVE

ROOT = Path(__file__).resolve().parents[3]
SMALL = dict(dataset="gaussian_mixture", clients=4, partition="iid", rounds=1, seed=2,
             body="mlp:8", feature_dim=4, local_epochs=1, progress=False, threads=1,
             dataset_options={"n": 200, "num_classes": 3, "dim": 5})


@pytest.fixture(scope="module")
def run():
    return simulate("fedavg", calibrate="temperature", conformal="aps:0.2", **SMALL)


class Counting:
    """A strategy's client half that counts the rows it predicts (it predicts as the half)."""

    def __init__(self, strategy):
        self.strategy, self.rows = strategy, []

    def predict(self, *args):
        self.rows.append(int(args[-1].shape[0]))
        return self.strategy.predict(*args)

    def __getattr__(self, name):
        return getattr(self.strategy, name)


def sites(run, strategy=None, spec=None):
    held = run.calibration.held_out
    return {c.client_id: Site(c.client_id, strategy or run.strategy, c.config,
                              run.client_state(c.client_id), run.evaluation_broadcast, c.data,
                              held.get(c.client_id), seed=run.config.seed,
                              conformal=spec or parse_conformal(run.config.conformal))
            for c in run.clients}


class Tampering(InProcessPhases):
    """The in-process channel, except that the result step's answers of some clients are
    garbage or never come."""

    def __init__(self, sites, phase, garbage=(), silent=()):
        super().__init__(sites)
        self.phase, self.garbage, self.silent = phase, set(garbage), set(silent)

    def ask(self, phase, step, down, client_ids):
        answers = super().ask(phase, step, down, client_ids)
        if phase is self.phase:
            for cid in self.garbage:
                answers[cid] = b"\x00not a message" * 4
            for cid in self.silent:
                answers.pop(cid, None)
        return answers


def calibrate_over(channel, run):
    return calibrate.calibrate_phase(
        channel, [c.client_id for c in run.clients], run.calibration.held_out,
        spec=parse_calibrate("temperature"), server=run.strategy, n_bins=run.config.n_bins,
        num_test={c.client_id: c.data.num_test for c in run.clients})


def test_the_calibrate_phase_in_process_is_the_runs_step(run):
    outcome = calibrate_over(InProcessPhases(sites(run)), run)
    step = run.summary["calibration"]
    # the same messages, in the same order, as the run's own step: the same figures exactly
    assert outcome.search.fit.temperature == step["temperature"]
    assert (outcome.search.bytes_up, outcome.search.bytes_down) == (step["bytes_up"],
                                                                   step["bytes_down"])
    figures = outcome.evaluation.headline()
    assert {k: figures[k] for k in ("accuracy", "ece", "nll")} == \
        {k: step["calibrated"][k] for k in ("accuracy", "ece", "nll")}


def test_a_bad_or_missing_calibrated_evaluation_is_a_rejection_and_the_rest_are_merged(run):
    honest = calibrate_over(InProcessPhases(sites(run)), run)
    outcome = calibrate_over(Tampering(sites(run), calibrate.RESULT, garbage={1}, silent={3}),
                             run)
    # the search itself was not touched: the same temperature, the same bytes
    assert outcome.search.fit.temperature == honest.search.fit.temperature
    reasons = {r["client_id"]: r["reason"] for r in outcome.search.rejections}
    assert set(reasons) == {1, 3} and reasons[3] == "no reply"
    assert [c["client_id"] for c in outcome.evaluation.per_client] == [0, 2]
    # each kept client's calibrated figures are the honest run's, to the last bit
    kept = {c["client_id"]: c for c in honest.evaluation.per_client}
    for client in outcome.evaluation.per_client:
        assert client == kept[client["client_id"]]


def test_a_bad_coverage_reply_is_a_rejection_and_the_pooled_coverage_is_the_others(run):
    spec = parse_conformal("aps:0.2")
    ids = [c.client_id for c in run.clients]

    def over(channel):
        return conformal.conformal_phase(channel, ids, run.calibration.held_out, spec=spec,
                                         held_out_fraction=0.2, num_classes=3)

    honest = over(InProcessPhases(sites(run, spec=spec))).summary()
    tampered = over(Tampering(sites(run, spec=spec), conformal.RESULT, garbage={2})).summary()
    assert [r["client_id"] for r in tampered["rejections"]] == [2]
    assert tampered["predictives"][PREDICTIVE]["threshold"] == \
        honest["predictives"][PREDICTIVE]["threshold"]
    left = [c for c in honest["predictives"][PREDICTIVE]["per_client"] if c["client_id"] != 2]
    assert tampered["predictives"][PREDICTIVE]["per_client"] == left
    rows = sum(c["count"] for c in left)
    covered = sum(round(c["coverage"] * c["count"]) for c in left)
    assert tampered["predictives"][PREDICTIVE]["count"] == rows
    assert tampered["predictives"][PREDICTIVE]["coverage"] == pytest.approx(covered / rows,
                                                                           abs=1e-12)


def test_a_client_scores_its_held_out_rows_once_per_phase_in_process(run):
    strategy = Counting(run.strategy)
    outcome = calibrate_over(InProcessPhases(sites(run, strategy)), run)
    held = run.calibration.held_out
    assert outcome.search.steps >= 3  # several proposals ...
    # ... but each client predicted its held-out rows once, then its test rows once
    assert strategy.rows == [held[c.client_id].size for c in run.clients] + \
        [c.data.num_test for c in run.clients]


def test_a_client_answers_the_request_it_is_sent_and_refuses_another():
    # the client functions check the schema of what they receive: a conformal result is not
    # a temperature proposal
    site = Site(0, None, None, None, None, None)
    result = encode(conformal.result_message(3, [0.5, None]))
    with pytest.raises(MessageRejected):
        calibrate.client_evaluation(site, result)


def test_every_phase_answers_with_its_modules_client_function():
    phases = {calibrate.PROPOSAL: calibrate.client_reply,
              calibrate.RESULT: calibrate.client_evaluation,
              conformal.REQUEST: conformal.client_reply,
              conformal.RESULT: conformal.client_evaluation,
              shift_protocol.REQUEST: shift_protocol.client_states}
    for phase, answer in phases.items():
        assert phase.answer is answer, phase.step
    # the Flower record layout of each request, as the messages always had it
    assert [(p.query, p.request, p.reply) for p in phases] == [
        ("query.calibrate", "proposal", "reply"), ("query.calibrate", "result", "evaluation"),
        ("query.calibrate", "conformal", "reply"),
        ("query.calibrate", "conformal_result", "reply"), ("query.shift", "request", "reply")]


def _source_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_no_transport_has_its_own_copy_of_a_phase():
    # the search, the clients' halves and the reply checks live in the phase modules; a
    # transport that names one of them is writing the phase again
    phase_internals = {"temperature_search_over", "federated_temperature_search",
                       "TemperatureClient", "conformal_search_over", "evaluation_over",
                       "ConformalClient", "federated_shift_evaluation", "site_shift_states",
                       "read_shift_states", "calibrate_run", "conformal_run", "evaluate_shift"}
    transports = [ROOT / "bayesfl" / "simulate.py",
                  *sorted((ROOT / "bayesfl" / "flower").glob("*.py"))]
    found = {p.relative_to(ROOT).as_posix(): sorted(_source_names(p) & phase_internals)
             for p in transports}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_split_modules_are_what_bayesfl_calibrate_re_exports():
    from bayesfl import calibration_spec

    assert calibrate.hold_out is holdout.hold_out and calibrate.HeldOut is holdout.HeldOut
    assert calibrate.parse_calibrate is calibration_spec.parse_calibrate
    assert calibrate.CalibrationSpec is calibration_spec.CalibrationSpec
    # the phase module runs over any channel: it does not reach the simulator's executor
    imported = {n.module for n in ast.walk(ast.parse(
        (ROOT / "bayesfl" / "calibrate.py").read_text())) if isinstance(n, ast.ImportFrom)}
    assert "bayesfl.executor" not in imported and "bayesfl.simulate" not in imported


def test_the_in_process_channel_reports_why_a_client_could_not_answer(run):
    # a proposal to a client without held-out rows: its reason, not an exception
    lone = sites(run)
    lone[0].held_out = None
    down = encode(calibrate.proposal_message(0, 0.0))
    answers = InProcessPhases(lone).ask(calibrate.PROPOSAL, 0, down, [0, 1])
    assert answers[0] == "client failed to answer: client 0 holds no calibration data"
    reply = decode(answers[1])
    assert reply.header.client_id == 1 and reply.tensors["num_samples"].dtype == torch.int64
