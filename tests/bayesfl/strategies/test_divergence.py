"""Strategies with their own local loops (FedPA's IASG, FedPop's SGLD and Adam, pFedBayes'
alternating updates, the personal family's CoLearn and FD) go through the divergence guard of
`bayesfl.training`, as the strategies that train with ``train_plain`` do: in the simulator
a client whose local computation goes non-finite sends nothing, its round is undone, the reason
is recorded under ``rejections``, and the run goes on with the others."""

from __future__ import annotations

import warnings

import pytest
import torch
from strategy_helpers import context, make_clients, wire

from bayesfl.data.datasets import Dataset, load_dataset
from bayesfl.errors import LocalTrainingWarning
from bayesfl.simulate import simulate
from bayesfl.strategies import make_strategy
from bayesfl.training import watch_divergence

SMALL = dict(clients=4, partition="shards:1", rounds=2, seed=3, body="mlp:16", feature_dim=8,
             local_epochs=1, batch_size=16, lr=1e-2, progress=False)
OPTIONS = {
    "fedpa": {"mc_samples": 2},
    "pfedbayes": {"mc_samples": 2, "personal_steps": 2},
    "fedpop": {"sgld_burn_in": 4, "sgld_samples": 2, "sgld_thinning": 1, "final_samples": 3},
    "colearn": {},  # the personal family's loop (PersonalStrategy.train_personal), FD's too
}


def poisoned_data() -> Dataset:
    """Four well-separated classes; class 3's inputs overflow the layers (3e38): with one
    class per client, the client holding it has a non-finite loss from its first mini-batch
    (its test inputs stay finite enough to be evaluated)."""
    pooled = load_dataset("gaussian_mixture", num_classes=4, dim=10, n=320, separation=4.0)
    x = pooled.x.clone()
    x[pooled.y == 3] = 3e38
    return Dataset("custom", x, pooled.y, 4, (10,))


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_client_whose_own_loop_diverges_sends_nothing_and_the_run_goes_on(name):
    data = poisoned_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = simulate(name, data=data, strategy_options=OPTIONS[name], **SMALL)
    said = [str(w.message) for w in caught if issubclass(w.category, LocalTrainingWarning)]
    fits = [m for m in said if "Its upload was not sent and it keeps its state from before "
            "the round" in m]
    assert len(fits) == 1, said  # once per run, though it happens every round
    if name == "fedpop":  # its final head draws fail too: it keeps the prior mean head
        assert len(said) == 2 and "predicts with the population's prior mean head" in said[1]
    else:
        assert len(said) == 1, said
    bad = {c.client_id for c in result.clients if bool((c.data.train_y == 3).any())}
    assert len(bad) == 1
    for m in result.metrics:
        if m["round"] == 0:
            continue
        (rejection,) = m["rejections"]
        assert rejection["client_id"] in bad
        assert rejection["reason"].startswith("upload not sent: "), rejection
        assert m["accepted"] == 3 and m["bytes_up_per_client"].count(0) == 1
    # its round undone: nothing non-finite was kept in its state
    (cid,) = bad
    for key, tensor in result.client_state(cid).items():
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all()), key


@pytest.mark.parametrize("name", ["fd", *sorted(OPTIONS)])
def test_each_own_loop_stops_at_a_non_finite_loss_and_says_so_to_the_watch(name):
    """The client half alone: an infinite training row stops the loop, and inside
    ``watch_divergence`` the stop is recorded under the client's generator with the reason."""
    strategy = make_strategy(name, context(epochs=2), **OPTIONS.get(name, {}))
    clients = make_clients(strategy)
    c = clients[0]
    c.data.train_x[0] = float("inf")
    broadcast = wire(strategy.configure(strategy.init(), 1).broadcast)
    generator = torch.Generator().manual_seed(0)
    with watch_divergence() as diverged:
        strategy.fit(c.config, c.state, c.data, broadcast, generator)
    assert list(diverged) == [id(generator)], name
    reason = diverged[id(generator)]
    assert ("training stopped there; lower the learning rate" in reason
            or "SGLD draws of the personal head failed" in reason), reason
