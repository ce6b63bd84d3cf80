"""The shared skeleton of the whole-network Bayesian baselines (bayesfl/strategies/bayes/
baseline.py) changed no number: FedPA, pFedBayes and FedPop give exactly the metrics,
predictions and posterior probabilities they gave before it existed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bayesfl.simulate import simulate

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


def without_timings(metrics: list[dict]) -> list[dict]:
    plain = json.loads(json.dumps(metrics))  # as recorded: tuples become lists
    return [{k: v for k, v in m.items() if not k.startswith("seconds")} for m in plain]


@pytest.mark.slow
@pytest.mark.skipif(not SAME_MACHINE, reason=(
    f"figures recorded with torch {RECORDED['torch']} on {RECORDED['cpu_capability']} kernels; "
    "other builds may round differently in the last bits"))
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_three_runs_give_exactly_what_they_gave_before_the_skeleton(name):
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
