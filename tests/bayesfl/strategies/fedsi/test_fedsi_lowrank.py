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


def test_personal_predictive_by_woodbury_equals_the_dense_posteriors(build, monkeypatch):
    # personalize keeps the posterior's truncated Woodbury factors (lowrank.*) and not its
    # S x S GGN; predict's GLM probit uses the factors instead of factorising the dense
    # |S| x |S| precision, and the dense posterior (personal_posterior: posterior(), or a
    # state without the kernel's factor) rebuilds the GGN from them (H = W W^T).
    # Against a state personalized the dense way (subnet_laplace_state's GGN; float32
    # network: its logit variances are float32 sums, the Woodbury route's float64 cast to
    # float32), the probabilities agree to float32 rounding of kappa f (1e-6 absolute); the
    # plug-in is the same softmax of the same logits, bit for bit.
    strategy, clients, state = build("fedsi", subnet_fraction=0.5)  # r < S for some
    for r in (1, 2):
        state, _ = run_round(strategy, clients, state, r)
    down = wire(strategy.configure_evaluation(state, 2))
    personal = [strategy.personalize(c.config, c.state, c.data, down,
                                     torch.Generator().manual_seed(0)) for c in clients]
    monkeypatch.setattr(FedSI, "lowrank_terms", lambda *args: {})
    dense_personal = [strategy.personalize(c.config, c.state, c.data, down,
                                           torch.Generator().manual_seed(0)) for c in clients]
    used = 0
    for c, kept, dense_state in zip(clients, personal, dense_personal, strict=True):
        x = c.data.test_x
        fast = strategy.predict(c.config, kept, down, x)
        dense = strategy.predict(c.config, dense_state, down, x)
        assert torch.equal(fast["map_plugin"], dense["map_plugin"])
        torch.testing.assert_close(fast["predictive"], dense["predictive"], rtol=0, atol=1e-6)
        if "lowrank.chol" not in kept:
            continue
        used += 1
        assert "posterior.ggn" not in kept and "posterior.ggn" in dense_state
        # the dense posterior rebuilt from the factors: a state without the kernel's factor
        # (one personalized before the factor replaced Y) predicts by it
        older = {k: v for k, v in kept.items() if k != "lowrank.chol"}
        rebuilt = strategy.predict(c.config, older, down, x)
        assert torch.equal(rebuilt["map_plugin"], dense["map_plugin"])
        torch.testing.assert_close(rebuilt["predictive"], dense["predictive"], rtol=0,
                                   atol=1e-6)
        # and its GGN is the dense one's (float32 sums against float64: 1e-5 of the largest)
        ggn = strategy.personal_posterior(c.config, kept).ggn
        expected = dense_state["posterior.ggn"]
        torch.testing.assert_close(ggn, expected, rtol=0,
                                   atol=1e-5 * float(expected.abs().max()))
    assert used >= 2
