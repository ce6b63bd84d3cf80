"""bayesfl.load_run: a finished run read back from its directory, predicting as it did; a
directory without one refused with what to do."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import bayesfl
from bayesfl.checkpoint import save_checkpoint
from bayesfl.errors import CheckpointError, ConfigError
from bayesfl.loaded_run import LoadedRun, load_run
from bayesfl.run_directory import CHECKPOINT_NAME, RESULT_NAME
from bayesfl.simulate import SimulationResult

SMALL = {"clients": 3, "partition": "iid", "rounds": 2, "local_epochs": 1, "feature_dim": 8,
         "body": "mlp:16", "progress": False}


def relu_body() -> nn.Module:
    """The user's own body: (64,) digits inputs -> 8 non-negative features."""
    return nn.Sequential(nn.Linear(64, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU())


@pytest.fixture(scope="module")
def fedlog_run(tmp_path_factory):
    """A FedLog run with a callable body and its directory (written once for the module)."""
    out = tmp_path_factory.mktemp("runs") / "fedlog"
    result = bayesfl.simulate("fedlog", out=out, **{**SMALL, "body": relu_body})
    return result, out


def inputs(n=6):
    return torch.rand(n, 64, generator=torch.Generator().manual_seed(1))


def test_a_loaded_run_is_the_result_simulate_returned(fedlog_run):
    result, out = fedlog_run
    run = load_run(out)
    assert isinstance(run, LoadedRun) and isinstance(run, SimulationResult)
    assert run.summary == result.summary == json.loads((out / "summary.json").read_text())
    assert run.metrics == json.loads(json.dumps(result.metrics))  # JSON turns tuples to lists
    assert run.partition == json.loads((out / "partition.json").read_text())
    assert run.partition["train_sizes"] == [c.data.num_train for c in result.clients]
    assert run.manifest["config"]["body"] == result.config.body
    assert run.config == result.config


def test_a_loaded_run_predicts_exactly_as_the_run_did(fedlog_run):
    result, out = fedlog_run
    run = load_run(out)
    for k in range(SMALL["clients"]):
        assert torch.equal(run.predict_proba(k, inputs()), result.predict_proba(k, inputs()))
        loaded, original = run.posterior(k), result.posterior(k)
        assert torch.equal(loaded.mean, original.mean)
        assert run.client_state(k).keys() == result.client_state(k).keys()


def test_a_loaded_posterior_samples_and_predicts_from_inputs(fedlog_run):
    _, out = fedlog_run
    posterior = load_run(out).posterior(0)
    draws = posterior.sample(5, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (5, *posterior.mean.shape) and torch.isfinite(draws).all()
    probs = posterior.predict_proba(inputs(4))
    assert probs.shape == (4, 10)
    # float64 probabilities: each row sums to 1 up to rounding of ten terms
    torch.testing.assert_close(probs.sum(1), torch.ones(4, dtype=torch.float64))


def test_the_manifest_records_a_callable_body_by_name_and_what_resuming_needs(fedlog_run):
    result, out = fedlog_run
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["body_factories"][result.config.body]
    assert record["factory"].endswith(":relu_body")
    assert "cannot be serialised" in record["note"]


def test_a_loaded_run_in_a_new_process_needs_an_unimportable_factory_registered(fedlog_run,
                                                                               tmp_path):
    from bayesfl.bodies import register_body, unregister_body

    result, out = fedlog_run
    spec = result.config.body
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    unregister_body(spec)  # as in a new process: only the module's name is left
    try:
        # importable by its qualified name (a module-level function): found again
        assert torch.equal(load_run(copy).predict_proba(0, inputs()),
                           result.predict_proba(0, inputs()))
        register_body(spec, lambda: nn.Sequential(nn.Linear(64, 8), nn.ReLU()))
        with pytest.raises(CheckpointError, match="does not fit a client of body"):
            load_run(copy)  # another architecture under the run's name is refused
    finally:
        register_body(spec, relu_body)


def test_a_finished_run_with_a_callable_body_resumes_to_the_same_summary(fedlog_run,
                                                                          tmp_path):
    result, out = fedlog_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    again = bayesfl.simulate("fedlog", out=copy, resume=True, **{**SMALL, "body": relu_body})
    for key in ("accuracy", "nll", "ece", "best_round"):
        assert again.summary[key] == result.summary[key]


def test_a_strategy_without_a_posterior_loads_and_predicts_but_has_no_posterior(tmp_path):
    result = bayesfl.simulate("fedavg", out=tmp_path / "run", **SMALL)
    run = load_run(tmp_path / "run")
    assert torch.equal(run.predict_proba(1, inputs()), result.predict_proba(1, inputs()))
    with pytest.raises(ConfigError, match="not a posterior strategy"):
        run.posterior(0)


def test_a_personalised_run_loads_the_states_its_predictions_used(tmp_path):
    result = bayesfl.simulate("fedbabu", out=tmp_path / "run",
                              **{**SMALL, "rounds": 1})
    assert result.personalized  # FedBABU fine-tunes every client after the last round
    run = load_run(tmp_path / "run")
    assert sorted(run.personalized) == sorted(result.personalized)
    assert torch.equal(run.predict_proba(2, inputs()), result.predict_proba(2, inputs()))


# ---- refusals ------------------------------------------------------------------------------
def test_a_missing_directory_or_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_run(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_run(tmp_path / "file")
    with pytest.raises(CheckpointError, match="holds no finished run"):
        load_run(tmp_path)


@pytest.fixture
def copied(fedlog_run, tmp_path):
    _, out = fedlog_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return copy


def test_an_unfinished_run_is_refused_with_its_round_and_how_to_continue(copied):
    (copied / RESULT_NAME).unlink()  # as a run killed before its end leaves it
    with pytest.raises(CheckpointError, match=r"has not finished \(its checkpoint is at "
                                              r"round 2 of 2\).*resume=True"):
        load_run(copied)


def test_a_run_written_before_results_were_saved_is_told_to_run_again(copied):
    (copied / RESULT_NAME).unlink()
    (copied / CHECKPOINT_NAME).unlink()
    with pytest.raises(CheckpointError, match="--force"):
        load_run(copied)


def test_a_corrupt_result_file_is_refused(copied):
    data = bytearray((copied / RESULT_NAME).read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the last tensor
    (copied / RESULT_NAME).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_run(copied)
    (copied / RESULT_NAME).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_run(copied)


def test_another_format_version_is_refused_naming_both(copied):
    from bayesfl.checkpoint import load_checkpoint
    from bayesfl.run_result import header_metadata

    path = copied / RESULT_NAME
    fingerprint = header_metadata(path)["bayesfl.fingerprint"]
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    save_checkpoint(path, tensors, {**meta, "version": 99}, fingerprint=fingerprint)
    with pytest.raises(CheckpointError,
                       match="format version 99; this bayesfl reads versions 1, 2"):
        load_run(copied)


def as_version_1(path):
    """Rewrite the result file ``path`` in version 1's layout, as bayesfl before 2026-11-28
    wrote it: one ``client/<k>/<name>`` tensor per client and name, no ``client_groups``."""
    from bayesfl.checkpoint import load_checkpoint
    from bayesfl.engine.state import client_states
    from bayesfl.run_result import header_metadata

    fingerprint = header_metadata(path)["bayesfl.fingerprint"]
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    states = client_states(tensors, meta, [c["client_id"] for c in meta["clients"]])
    old = {k: v for k, v in tensors.items() if not k.startswith("clients/")}
    old.update({f"client/{cid}/{k}": v.clone() for cid, state in states.items()
                for k, v in state.items()})
    meta = {k: v for k, v in meta.items() if k != "client_groups"}
    save_checkpoint(path, old, {**meta, "version": 1}, fingerprint=fingerprint)


def test_a_version_1_result_loads_the_same_states_and_predictions(fedlog_run, copied):
    result, _ = fedlog_run
    as_version_1(copied / RESULT_NAME)
    run = load_run(copied)
    for k in range(SMALL["clients"]):
        saved, original = run.client_state(k), result.client_state(k)
        assert saved.keys() == original.keys()
        assert all(torch.equal(saved[name], original[name]) for name in saved)
        assert torch.equal(run.predict_proba(k, inputs()), result.predict_proba(k, inputs()))


RECORDED_V1 = Path(__file__).parent / "recorded" / "run_result_v1"
"""A run directory written by bayesfl at fc2e273 (result version 1): FedLog on digits, 3 iid
clients, 1 round, ``mlp:8`` bodies with 4 features, seed 0."""


def test_a_run_directory_written_by_version_1_code_loads_its_own_tensors(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED_V1, run_dir)
    run = load_run(run_dir)
    assert json.loads((run_dir / "summary.json").read_text()) == run.summary
    raw = load_file(run_dir / RESULT_NAME)  # read independently of bayesfl
    assert sorted({k.split("/")[1] for k in raw if k.startswith("client/")}) == ["0", "1", "2"]
    for k in range(3):
        state = run.client_state(k)
        stored = {n[len(f"client/{k}/"):]: v for n, v in raw.items()
                  if n.startswith(f"client/{k}/")}
        assert state.keys() == stored.keys()
        assert all(torch.equal(state[n], stored[n]) for n in state)
        probs = run.predict_proba(k, inputs())
        assert probs.shape == (6, 10) and torch.isfinite(probs).all()
        # float64 probabilities: each row sums to 1 up to rounding of ten terms
        torch.testing.assert_close(probs.sum(1), torch.ones(6, dtype=probs.dtype))


def test_a_version_1_result_with_a_stray_client_tensor_is_refused(copied):
    from bayesfl.checkpoint import load_checkpoint
    from bayesfl.run_result import header_metadata

    path = copied / RESULT_NAME
    as_version_1(path)
    fingerprint = header_metadata(path)["bayesfl.fingerprint"]
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    for stray in ("client/7/model.w", "client/x/model.w", "client/0/"):
        save_checkpoint(path, {**tensors, stray: torch.zeros(1)}, meta,
                        fingerprint=fingerprint)
        with pytest.raises(CheckpointError, match=r"corrupt.*is not the state of a client"):
            load_run(copied)


def test_a_result_whose_stacked_states_miss_a_client_is_refused(copied):
    from bayesfl.checkpoint import load_checkpoint
    from bayesfl.run_result import header_metadata

    path = copied / RESULT_NAME
    fingerprint = header_metadata(path)["bayesfl.fingerprint"]
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    meta["clients"].append({"client_id": 3, "body": meta["clients"][0]["body"],
                            "init_seed": 0})
    save_checkpoint(path, tensors, meta, fingerprint=fingerprint)
    with pytest.raises(CheckpointError, match=r"corrupt.*missing \[3\]"):
        load_run(copied)


def test_a_run_continued_with_other_settings_and_stopped_is_refused(copied):
    save_checkpoint(copied / CHECKPOINT_NAME, {"x": torch.zeros(1)},
                    {"round": 3, "config": {"rounds": 5}}, fingerprint="f" * 64)
    with pytest.raises(CheckpointError, match=r"continued with other settings and has not "
                                              r"finished \(its checkpoint is at round 3 of 5\)"):
        load_run(copied)


def test_damaged_metrics_or_a_missing_summary_are_refused(copied):
    lines = (copied / "metrics.jsonl").read_text().splitlines()
    (copied / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(CheckpointError, match="consistent finished run"):
        load_run(copied)
    (copied / "summary.json").unlink()
    with pytest.raises(CheckpointError, match=r"summary\.json is missing"):
        load_run(copied)


def test_result_file_holds_no_pickle_only_tensors_and_json(fedlog_run):
    _, out = fedlog_run
    raw = (out / RESULT_NAME).read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    meta = json.loads(header["__metadata__"]["bayesfl.meta"])
    assert meta["format"] == "bayesfl-run-result" and meta["version"] == 2
    names = [k for k in header if k != "__metadata__"]
    assert "run/evaluation" in names and "clients/0/ids" in names
    assert np.isin(["server", "clients", "run"], [k.split("/")[0] for k in names]).all()
    # the clients' states stacked, one tensor per name and layout group, a row per client
    assert meta["client_groups"] == [sorted(result_state_names(fedlog_run))]
    ids = header["clients/0/ids"]
    assert ids["dtype"] == "I64" and ids["shape"] == [SMALL["clients"]]
    for name in meta["client_groups"][0]:
        assert header[f"clients/0/state/{name}"]["shape"][0] == SMALL["clients"]


def result_state_names(run):
    result, _ = run
    return result.client_state(0).keys()


def test_a_flower_run_is_refused_saying_its_client_states_stay_at_the_sites(copied):
    (copied / RESULT_NAME).unlink()
    (copied / CHECKPOINT_NAME).unlink()
    summary = json.loads((copied / "summary.json").read_text())
    (copied / "summary.json").write_text(json.dumps({**summary, "transport": "flower"}))
    with pytest.raises(CheckpointError, match="holds a Flower run: its clients' states stay"):
        load_run(copied)
