"""FedSI's upload takes the subnet posterior's marginal variances by Woodbury
(`inference.subnet.lowrank.subnet_marginal_variance`) where that route applies, and they
are the dense posterior's: the same float64 algebra, rounded to float32 for the message
(tolerance 1e-6 relative: a float32 ulp is 6e-8, and the two routes' float64 sums differ by
~1e-12)."""

import torch
from strategy_helpers import run_round

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
