"""Local Only and FedAvg-FT, the FedSI paper's non-Bayesian personalisation baselines."""

import pytest
import torch
from strategy_helpers import evaluation_broadcast, generators, predict, run_round, wire

from bayesfl.errors import ConfigError
from bayesfl.messages import encode
from bayesfl.simulate import simulate
from bayesfl.strategies import PREDICTIVE
from bayesfl.strategies.averaging.parameter_averaging import (
    PERSONALIZED,
    ParameterAveraging,
    shared_state,
)
from bayesfl.training import train_plain


def test_local_only_shares_nothing_and_uploads_only_its_sample_count(build):
    strategy, clients, state = build("local-only", bodies=("mlp:8", "mlp:5-5"))
    assert state == {}
    plan = strategy.configure(state, 1)
    assert plan.broadcast.tensors == {}
    assert set(plan.upload_schema) == {"num_samples"}
    new_state, uploads = run_round(strategy, clients, state, 1)
    assert shared_state(new_state) == {}  # only the ledger of declared sample counts
    assert all(set(u.tensors) == {"num_samples"} for u in uploads)
    # what travels: the header and one int64, whatever the network's size
    assert all(len(encode(u)) < 400 for u in uploads)


def test_local_only_trains_exactly_as_a_client_alone_would(build):
    """Round by round, a Local Only client equals the same network trained alone with the
    same generator: no server value ever enters it."""
    strategy, clients, state = build("local-only")
    c = clients[1]
    alone = strategy.client_model(c.config, c.state)
    for r in (1, 2):
        gen = generators(clients, r)[1]
        g_alone = torch.Generator().manual_seed(gen.initial_seed())
        state, _ = run_round(strategy, clients, state, r)
        train_plain(alone, c.data.train_x, c.data.train_y, strategy.objective,
                    strategy.context.training, generator=g_alone)
    for name, value in alone.state_dict().items():
        torch.testing.assert_close(clients[1].state["model." + name], value, atol=0, rtol=0)
    x = c.data.test_x
    torch.testing.assert_close(predict(strategy, c, state, x, r=2),
                               torch.softmax(alone(x).double(), dim=1))


@pytest.mark.trained
def test_fedavg_ft_trains_as_fedavg_then_fine_tunes_the_whole_network(build):
    ft, ft_clients, ft_state = build("fedavg-ft", finetune_epochs=3, finetune_stop="fixed")
    avg, avg_clients, avg_state = build("fedavg")
    ft_state, _ = run_round(ft, ft_clients, ft_state, 1)
    avg_state, _ = run_round(avg, avg_clients, avg_state, 1)
    for name, value in avg_state.items():  # federated training is FedAvg's, bit for bit
        assert torch.equal(ft_state[name], value)
    c = ft_clients[0]
    broadcast = evaluation_broadcast(ft, ft_state, 1)
    personal = ft.personalize(c.config, c.state, c.data, broadcast,
                              torch.Generator().manual_seed(0))
    assert PERSONALIZED in personal
    moved = [k for k in ("body.1.weight", "head.weight")
             if not torch.equal(personal["model." + k], ft_state[k])]
    assert moved == ["body.1.weight", "head.weight"]  # "all": body and head both moved
    # fine-tuning lowers the client's own training loss from the global network's
    model = ft.global_model(c.config, c.state, broadcast)
    tuned = ft.client_model(c.config, personal)
    loss = ft.objective
    with torch.no_grad():
        assert float(loss(tuned(c.data.train_x), c.data.train_y).mean()) < \
            float(loss(model(c.data.train_x), c.data.train_y).mean())
    # and it then predicts with its own parameters, whatever is broadcast later
    probs = ft.predict(c.config, personal, wire(broadcast), c.data.test_x)[PREDICTIVE]
    torch.testing.assert_close(probs, torch.softmax(tuned(c.data.test_x).double(), dim=1))


def test_fedavg_ft_defaults_to_the_local_epochs_and_validates_its_options(build):
    strategy, _, _ = build("fedavg-ft")
    assert strategy.finetune_epochs == strategy.context.training.epochs
    assert strategy.finetune == "all"
    with pytest.raises(ConfigError, match="finetune must be one of"):
        build("fedavg-ft", finetune="body")
    with pytest.raises(ConfigError, match="finetune_epochs"):
        build("fedavg-ft", finetune_epochs=-1)
    assert isinstance(strategy, ParameterAveraging)


@pytest.mark.parametrize("name", ["local-only", "fedavg-ft"])
@pytest.mark.trained
def test_runs_3_rounds_on_digits_with_5_clients(tmp_path, name):
    result = simulate(name, dataset="digits", clients=5, partition="shards:2", rounds=3, seed=0,
                      body="mlp:32", feature_dim=16, local_epochs=1, batch_size=16, lr=1e-2,
                      progress=False, out=tmp_path)
    assert result.summary["rounds"] == 3
    assert result.summary["accuracy"] > 0.8  # 2 classes per client: even alone this is easy
    uplink = sum(r["bytes_up"] for r in result.metrics)
    if name == "local-only":
        assert 0 < uplink < 5 * 3 * 400  # headers and sample counts only
    else:
        assert uplink > 5 * 3 * 4 * 64 * 32  # FedAvg sends at least the first layer
