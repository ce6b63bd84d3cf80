"""Novel clients (``novel_fraction``, FedSI spec §5.4 / §IV-E): held out of training, they only
personalise at the end and are reported apart under ``summary["novel"]``."""

from typing import ClassVar

import pytest
import torch

from bayesfl.errors import ConfigError
from bayesfl.evaluation import METRICS
from bayesfl.simulate import novel_clients, simulate
from bayesfl.strategies import STRATEGIES
from bayesfl.strategies.fedsi.fedsi import FedSI

SMALL = dict(dataset="digits", clients=5, partition="shards:2", seed=1, body="mlp",
             feature_dim=16, local_epochs=1, batch_size=64, progress=False)


class CountingFedSI(FedSI):
    """FedSI that records which clients fit and which personalise (the real FedSI logic runs;
    the record is class-level because the simulator builds the server and client halves
    apart)."""

    name = "fedsi-counting"
    fitted: ClassVar[list[int]] = []
    personalized: ClassVar[list[int]] = []

    def fit_group(self, configs, states, datas, broadcast, generators):
        # the simulator fits same-body clients as a group (FedSI's fit_group never calls fit)
        CountingFedSI.fitted.extend(c.client_id for c in configs)
        return super().fit_group(configs, states, datas, broadcast, generators)

    def personalize(self, config, state, data, broadcast, generator):
        CountingFedSI.personalized.append(config.client_id)
        return super().personalize(config, state, data, broadcast, generator)


def test_a_novel_client_personalizes_without_ever_fitting(monkeypatch):
    monkeypatch.setitem(STRATEGIES, CountingFedSI.name, CountingFedSI)
    CountingFedSI.fitted, CountingFedSI.personalized = [], []
    result = simulate(CountingFedSI.name, rounds=2, novel_fraction=0.4,
                      strategy_options={"finetune_epochs": 2}, **SMALL)
    novel = list(result.novel)
    assert len(novel) == 2 and novel == novel_clients(5, 0.4, SMALL["seed"])
    training = [k for k in range(5) if k not in novel]
    assert sorted(set(CountingFedSI.fitted)) == training
    assert len(CountingFedSI.fitted) == 2 * len(training)  # every round, training clients only
    assert sorted(CountingFedSI.personalized) == list(range(5))
    assert all(m["participants"] == training for m in result.metrics)
    summary = result.summary
    assert [c["client_id"] for c in summary["per_client"]] == training
    assert summary["novel"]["clients"] == novel
    assert [c["client_id"] for c in summary["novel"]["per_client"]] == novel
    for key in ("accuracy", "accuracy_pooled", *METRICS, "map_plugin"):
        assert key in summary["novel"]
    # a novel client's posterior exists and its state holds the initial body nowhere: its
    # personalised body is the global mean
    post = result.posterior(novel[0])
    assert torch.equal(post.mean, result.state["mean"])


def test_strategies_that_do_not_personalize_evaluate_the_global_model_on_novel_clients():
    result = simulate("fedavg", rounds=2, novel_fraction=0.2, **SMALL)
    (cid,) = result.novel
    client = result.clients[cid]
    probs = result.predict_proba(cid, client.data.test_x)
    accuracy = float((probs.argmax(1) == client.data.test_y).double().mean())
    assert result.summary["novel"]["accuracy"] == pytest.approx(accuracy)
    assert cid not in [c["client_id"] for c in result.summary["per_client"]]


def test_novel_fraction_is_checked():
    with pytest.raises(ConfigError, match="novel_fraction"):
        simulate("fedavg", rounds=1, novel_fraction=1.0, **SMALL)
    with pytest.raises(ConfigError, match="none would be left"):
        novel_clients(3, 0.9, 0)
    assert novel_clients(10, 0.0, 0) == []
    assert len(novel_clients(10, 0.2, 0)) == 2 and len(novel_clients(10, 0.01, 0)) == 1
