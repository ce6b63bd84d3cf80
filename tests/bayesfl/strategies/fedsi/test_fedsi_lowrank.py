"""FedSI's upload takes the subnet posterior's marginal variances by Woodbury
(`inference.subnet.lowrank.subnet_marginal_variance`) where that route applies, and they
are the dense posterior's: the same float64 algebra, rounded to float32 for the message
(tolerance 1e-6 relative: a float32 ulp is 6e-8, and the two routes' float64 sums differ by
~1e-12)."""

import torch
from strategy_helpers import run_round, wire

import bayesfl.strategies.fedsi.fedsi as fedsi_module
from bayesfl.strategies.fedsi.fedsi import FedSI


def test_woodbury_upload_equals_the_dense_posteriors(build, monkeypatch):
    calls = []
    real = fedsi_module.subnet_marginal_variance

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fedsi_module, "subnet_marginal_variance", spy)
    strategy, clients, state = build("fedsi", subnet_fraction=0.5)  # S = 46 > n (C - 1)
    _, fast = run_round(strategy, clients, state, 1)
    assert len(calls) == len(clients) and sum(calls) >= 2  # client 1: U n^2 > S^2, dense
    monkeypatch.setattr(FedSI, "subnet_std", lambda *args: None)
    strategy, clients, state = build("fedsi", subnet_fraction=0.5)
    _, dense = run_round(strategy, clients, state, 1)
    for a, b in zip(fast, dense, strict=True):
        assert torch.equal(a.tensors["subnet"], b.tensors["subnet"])
        assert torch.equal(a.tensors["mean"], b.tensors["mean"])
        assert bool(((a.tensors["std"] == 0) == (b.tensors["std"] == 0)).all())
        torch.testing.assert_close(a.tensors["std"], b.tensors["std"], rtol=1e-6, atol=0)


def test_personal_predictive_by_woodbury_equals_the_dense_posteriors(build):
    # personalize keeps the posterior's truncated Woodbury factors as well (lowrank.*) and
    # predict's GLM probit uses them instead of factorising the dense |S| x |S| precision.
    # float32 network: the dense route's logit variances are float32 sums (the factored
    # predictive's), the Woodbury route's float64 cast to float32, so the probabilities
    # agree to float32 rounding of kappa f (1e-6 absolute); the plug-in is the same softmax of
    # the same logits, bit for bit.
    strategy, clients, state = build("fedsi", subnet_fraction=0.5)  # r < S for some
    for r in (1, 2):
        state, _ = run_round(strategy, clients, state, r)
    down = wire(strategy.configure_evaluation(state, 2))
    used = 0
    for c in clients:
        personal = strategy.personalize(c.config, c.state, c.data, down,
                                        torch.Generator().manual_seed(0))
        fast = strategy.predict(c.config, personal, down, c.data.test_x)
        used += "lowrank.chol" in personal
        dense_state = {k: v for k, v in personal.items() if not k.startswith("lowrank.")}
        dense = strategy.predict(c.config, dense_state, down, c.data.test_x)
        assert torch.equal(fast["map_plugin"], dense["map_plugin"])
        torch.testing.assert_close(fast["predictive"], dense["predictive"], rtol=0, atol=1e-6)
        # a state without the kernel's factor (one personalized before the factor replaced Y)
        # predicts by the dense posterior: the same numbers as without any lowrank key
        older = {k: v for k, v in personal.items() if k != "lowrank.chol"}
        assert torch.equal(strategy.predict(c.config, older, down, c.data.test_x)["predictive"],
                           dense["predictive"])
    assert used >= 2
