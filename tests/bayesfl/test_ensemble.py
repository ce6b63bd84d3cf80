"""The run setting ``data_seed`` and the federated deep ensemble (bayesfl.ensemble, issue 40)."""

from __future__ import annotations

import json

import pytest
import torch

import bayesfl
from bayesfl.checkpoint import config_fingerprint
from bayesfl.config import SimulationConfig
from bayesfl.engine.setup import run_identity
from bayesfl.ensemble import DeepEnsemble, member_seeds, simulate_ensemble
from bayesfl.errors import ConfigError
from bayesfl.shift_evaluation import evaluate_shift, unseen_label_rows
from bayesfl.shifts import apply_shift
from bayesfl.simulate import simulate
from calibration import Accumulator, AurocAccumulator, ood_scores

SMALL = dict(dataset="digits", clients=4, partition="shards:3", rounds=2, body="mlp:16",
             feature_dim=8, local_epochs=1, progress=False, threads=1)


def run(strategy="fedavg-ft", **extra):
    return simulate(strategy, **{**SMALL, **extra})


def assert_same_clients(a, b):
    assert len(a.clients) == len(b.clients)
    for ca, cb in zip(a.clients, b.clients, strict=True):
        for name in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(ca.data, name), getattr(cb.data, name)), name
        assert (ca.data.train_indices == cb.data.train_indices).all()
        assert (ca.data.test_indices == cb.data.test_indices).all()
    assert tuple(a.novel) == tuple(b.novel)


# ---- data_seed -------------------------------------------------------------------------------
def test_an_unset_data_seed_is_the_seed_and_leaves_the_run_as_it_was():
    plain, explicit = run(seed=3), run(seed=3, data_seed=3)
    assert_same_clients(plain, explicit)
    assert "data_seed" not in plain.summary and explicit.summary["data_seed"] == 3
    for key in ("accuracy", "nll", "ece", "brier", "bytes_up", "per_client", "data"):
        assert plain.summary[key] == explicit.summary[key], key
    # the configuration, manifest and fingerprint of a run without it are those from before
    config = SimulationConfig(seed=3)
    assert config.data_seed is None and config.data_rng_seed == 3
    assert "data_seed" not in config.to_dict()
    identity = run_identity(config, {"name": "digits"})
    assert "data_seed" not in identity
    assert config_fingerprint(identity) != config_fingerprint(
        run_identity(SimulationConfig(seed=3, data_seed=3), {"name": "digits"}))


def test_runs_of_one_data_seed_hold_the_same_clients_and_differ_in_their_models():
    extra = dict(data_seed=5, calibrate="temperature", novel_fraction=0.25)
    a, b = run(seed=0, **extra), run(seed=1, **extra)
    assert_same_clients(a, b)  # rows, split, calibrate hold-out (train rows), novel clients
    assert a.summary["data"] == b.summary["data"]
    x = a.clients[0].data.test_x
    assert not torch.equal(a.predict_proba(0, x), b.predict_proba(0, x))
    assert any(not torch.equal(a.client_state(0)[k], b.client_state(0)[k])
               for k in a.client_state(0))
    # and another data seed gives other clients
    other = run(seed=0, data_seed=6, calibrate="temperature", novel_fraction=0.25)
    assert not all(torch.equal(u.data.train_y, v.data.train_y)
                   for u, v in zip(a.clients, other.clients, strict=True))


def test_data_seed_is_a_setting_of_every_reader(tmp_path):
    from bayesfl.flower.protocol import parse_run_config
    from bayesfl.settings import read_config, settings_from_mapping

    assert settings_from_mapping({"data-seed": 4}) == {"data_seed": 4}
    path = tmp_path / "run.toml"
    path.write_text("data_seed = 9\n")
    assert read_config(path) == {"data_seed": 9}
    assert parse_run_config({"data-seed": 7})[0].data_seed == 7
    assert parse_run_config({"data-seed": 0})[0].data_seed == 0  # 0 is a seed
    assert parse_run_config({"data-seed": ""})[0].data_seed is None  # "": not set
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ConfigError, match=r"data_seed|data-seed"):
            SimulationConfig(data_seed=bad)


def test_the_cli_takes_data_seed_and_load_run_keeps_it(tmp_path):
    from bayesfl.cli import main

    out = tmp_path / "run"
    assert main(["run", "--strategy", "fedavg", "--dataset", "digits", "--clients", "4",
                 "--partition", "shards:3", "--rounds", "1", "--body", "mlp:8",
                 "--feature-dim", "4", "--local-epochs", "1", "--seed", "2",
                 "--data-seed", "8", "--threads", "1", "--no-progress",
                 "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["data_seed"] == 8
    assert json.loads((out / "manifest.json").read_text())["config"]["data_seed"] == 8
    loaded = bayesfl.load_run(out)
    assert (loaded.config.seed, loaded.config.data_seed) == (2, 8)
    # evaluate_shift rebuilds the data from the data seed (the run's digest is checked)
    report = evaluate_shift(loaded, shifts=[("noise", [0.1])], progress=False)
    assert report.rows("shift", scope="pooled", shift="none")[0]["accuracy"] == \
        pytest.approx(loaded.summary["accuracy_pooled"])


# ---- the ensemble ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ensemble():
    return simulate_ensemble(3, strategy="fedavg-ft", seed=4, **SMALL)


def test_the_members_share_the_data_seed_and_differ_in_seed(ensemble):
    assert ensemble.seeds == member_seeds(4, 3) and ensemble.seeds[0] == 4
    assert len(set(ensemble.seeds)) == 3
    assert {m.config.data_rng_seed for m in ensemble.members} == {4}
    for member in ensemble.members[1:]:
        assert_same_clients(ensemble.members[0], member)
    # member 0 is the single run of the seed
    single = run(seed=4)
    assert single.summary["nll"] == ensemble.members[0].summary["nll"]
    assert not set(member_seeds(0, 5)) & set(member_seeds(1, 5))


def test_the_ensemble_predicts_the_mean_of_its_members(ensemble):
    x = ensemble.members[0].clients[2].data.test_x
    members = torch.stack([m.predict_proba(2, x) for m in ensemble.members])
    assert ensemble.member_proba(2, x).shape == (3, x.shape[0], 10)
    torch.testing.assert_close(ensemble.predict_proba(2, x), members.mean(0), rtol=0,
                               atol=1e-15)
    assert ensemble.predict_proba(2, x).dtype == torch.float64


def test_runs_that_do_not_hold_the_same_clients_are_refused(ensemble):
    first = ensemble.members[0]
    with pytest.raises(ConfigError, match="partition 'shards:4' vs 'shards:3'"):
        DeepEnsemble([first, run(seed=9, data_seed=4, partition="shards:4")])
    with pytest.raises(ConfigError, match="data seed 9 vs 4"):
        DeepEnsemble([first, run(seed=9)])  # data_seed unset: the seed, another data set
    with pytest.raises(ConfigError, match="test_fraction"):
        DeepEnsemble([first, run(seed=9, data_seed=4, test_fraction=0.3)])
    with pytest.raises(ConfigError, match="same run"):
        DeepEnsemble([first, ensemble.members[1], first])
    with pytest.raises(ConfigError, match="at least 2"):
        DeepEnsemble([first])
    with pytest.raises(ConfigError, match="not a run"):
        DeepEnsemble([first, "runs/x"])
    with pytest.raises(ConfigError, match="members must be an integer >= 2"):
        simulate_ensemble(1, **SMALL)


def pooled_from_probabilities(ensemble, shift=None):
    """Accuracy/NLL/ECE/Brier of the ensemble's averaged probabilities on every client's test
    rows (shifted by ``shift``), computed directly."""
    from bayesfl.shifts import data_range

    dataset = bayesfl.load_dataset("digits", seed=ensemble.config.data_rng_seed)
    probs, labels = [], []
    for k, client in enumerate(ensemble.members[0].clients):
        x = client.data.test_x
        if shift is not None:
            x = apply_shift(shift[0], shift[1], x, image_shape=(1, 8, 8),
                            data_range=data_range(dataset.x))
        probs.append(ensemble.predict_proba(k, x))
        labels.append(client.data.test_y)
    return Accumulator(ensemble.config.n_bins).update(torch.cat(probs),
                                                      torch.cat(labels)).compute()


def test_evaluate_shift_on_an_ensemble_scores_the_averaged_probabilities(ensemble):
    report = evaluate_shift(ensemble, shifts=[("rotate", [30])], ood=["unseen-labels"],
                            progress=False)
    assert report.predictives == ["predictive"]  # no plug-in row
    assert report.settings["ensemble"]["members"] == 3
    assert report.settings["strategy"] == "ensemble of 3 fedavg-ft"
    for shift, where in ((None, "none"), (("rotate", 30.0), "rotate")):
        direct = pooled_from_probabilities(ensemble, shift)
        row, = report.rows("shift", scope="pooled", shift=where)
        for key in ("accuracy", "nll", "ece", "brier"):
            assert row[key] == pytest.approx(direct[key], rel=1e-12, abs=1e-15), (where, key)
    # the unseen-label AUROC of the entropy and of the members' mutual information
    clients = [c.data for c in ensemble.members[0].clients]
    entropy, mutual, = AurocAccumulator(), AurocAccumulator()
    for k in range(len(clients)):
        inside, outside = unseen_label_rows(clients, k)
        if outside.shape[0] == 0:
            continue
        rows = torch.cat([inside, outside])
        is_ood = torch.arange(rows.shape[0]) >= inside.shape[0]
        entropy.update(ood_scores(ensemble.predict_proba(k, rows), kind="entropy"), is_ood)
        mutual.update(ood_scores(ensemble.member_proba(k, rows), kind="mutual_information"),
                      is_ood)
    for score, state in (("entropy", entropy), ("mutual_information", mutual)):
        row, = report.rows("ood", scope="pooled", score=score)
        assert row["auroc"] == pytest.approx(state.compute(0.95)["auroc"], abs=1e-12), score


def test_an_ensemble_of_loaded_runs_predicts_as_the_runs_did(tmp_path):
    made = simulate_ensemble(2, strategy="fedbabu", seed=1, data_seed=3, out=tmp_path,
                             **SMALL)
    loaded = DeepEnsemble.load(sorted(tmp_path.glob("member-*")))
    assert loaded.seeds == made.seeds and loaded.config.data_seed == 3
    x = made.members[0].clients[1].data.test_x
    torch.testing.assert_close(loaded.predict_proba(1, x), made.predict_proba(1, x),
                               rtol=0, atol=0)
    settings = dict(shifts=[("noise", [0.2])], ood=["unseen-labels"], progress=False)
    a, b = evaluate_shift(made, **settings), evaluate_shift(loaded, **settings)
    assert a.shift == b.shift and a.ood == b.ood
    # a loaded member of another data seed is refused too
    with pytest.raises(ConfigError, match="data seed"):
        DeepEnsemble([loaded.members[0], run(strategy="fedbabu", seed=5)])
