"""The shared skeleton of the whole-network Bayesian baselines (bayesfl/strategies/bayes/
baseline.py) changed no number: FedPA, pFedBayes and FedPop give exactly the metrics,
predictions and posterior probabilities they gave before it existed; the Gaussian posteriors it
builds are inference's, round-trip through their state and check inputs as bayesfl does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from strategy_helpers import context, make_clients, run_round, wire

import inference
from bayesfl.errors import DataError
from bayesfl.simulate import simulate
from bayesfl.strategies import make_strategy

RECORDED = json.loads((Path(__file__).parent / "data" / "recorded_runs.json").read_text())
"""Two rounds of each strategy on digits (3 iid clients, seed 0, one thread), recorded from
the code before the skeleton (commit 1163eee): every metric but the timings, client 1's
``strategy.predict`` and ``posterior(1).predict_proba`` on its first 5 test digits."""

OPTIONS = {
    "fedpa": {"mc_samples": 2, "client_lr": 0.1},
    "pfedbayes": {"lr": 3e-3, "mc_samples": 2, "personal_steps": 2},
    "fedpop": {"sgld_burn_in": 4, "sgld_samples": 2, "sgld_thinning": 1, "final_samples": 3},
}

# Exact equality is legitimate here: the same data, seeds and single thread on the same torch
# build and CPU kernels give the same bits, so a refactor that moves code without changing the
# arithmetic leaves every figure identical; any difference is a change of the computation.
# Another torch version or CPU capability may round differently in the last bits: there the
# test says so and skips instead of comparing.
SAME_MACHINE = (torch.__version__ == RECORDED["torch"]
                and torch.backends.cpu.get_cpu_capability() == RECORDED["cpu_capability"])


@pytest.fixture
def one_thread():
    """The recording's one torch thread for the whole test: ``simulate(threads=1)`` covers the
    run, but the predictions after it run under the session's threads, and 2 threads (pytest
    without workers on 2 cores) round the matrix products differently in the last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def without_timings(metrics: list[dict]) -> list[dict]:
    plain = json.loads(json.dumps(metrics))  # as recorded: tuples become lists
    return [{k: v for k, v in m.items() if not k.startswith("seconds")} for m in plain]


@pytest.mark.slow
@pytest.mark.skipif(not SAME_MACHINE, reason=(
    f"figures recorded with torch {RECORDED['torch']} on {RECORDED['cpu_capability']} kernels; "
    "other builds may round differently in the last bits"))
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_three_runs_give_exactly_what_they_gave_before_the_skeleton(name, one_thread):
    result = simulate(name, "digits", clients=3, partition="iid", rounds=2, seed=0,
                      progress=False, local_epochs=1, batch_size=64, threads=1,
                      strategy_options=OPTIONS[name])
    recorded = RECORDED["runs"][name]
    assert without_timings(result.metrics) == recorded["metrics"]
    x = result.clients[1].data.test_x[:5]
    predicted = result.strategy.predict(result.clients[1].config, result.client_state(1),
                                        result.evaluation_broadcast, x)
    assert {k: v.tolist() for k, v in predicted.items()} == recorded["predict"]
    posterior = result.posterior(1)
    options = {} if name == "fedpop" else {"generator": torch.Generator().manual_seed(0)}
    assert posterior.predict_proba(x, **options).tolist() == recorded["posterior_probs"]


@pytest.mark.parametrize("name", ["fedpa", "pfedbayes"])
def test_the_network_gaussian_posteriors_round_trip_with_the_network_given_back(name):
    strategy = make_strategy(name, context(epochs=3), mc_samples=3)
    clients = make_clients(strategy)
    state, _ = run_round(strategy, clients, strategy.init(), 1)
    c = clients[0]
    post = strategy.posterior(c.config, c.state, wire(strategy.configure(state, 2).broadcast))
    assert isinstance(post, inference.NetworkGaussian) and isinstance(post, inference.Posterior)
    x = c.data.test_x
    back = inference.NetworkGaussian.from_state_dict(post.state_dict(),
                                                     model=strategy.template(c.config.body))
    for method in ("mc", "map"):  # the same seeded draws: the same numbers
        got, want = (p.predict_proba(x, method, generator=torch.Generator().manual_seed(0))
                     for p in (back, post))
        assert torch.equal(got, want), method
    assert (back.n_samples, back.input_shape) == (3, tuple(x.shape[1:]))
    assert torch.equal(post.to("cpu").predict_proba(x, "map"), post.predict_proba(x, "map"))
    inference.check(post, x, generator=torch.Generator().manual_seed(1))
    # bayesfl's input boundary: a batch of the wrong shape is a DataError naming the client's
    with pytest.raises(DataError, match=r"but this client's inputs have shape"):
        post.predict_proba(x[:, :-1])
