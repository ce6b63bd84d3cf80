"""FedProx: the proximal term in both training paths (vmapped group and one client)."""

import copy

import torch
from strategy_helpers import fit_all, generators, wire


def test_batched_and_single_client_fedprox_agree(build):
    strategy, clients, state = build("fedprox", mu=0.5)
    down = wire(strategy.configure(state, 1).broadcast)
    twins = copy.deepcopy(clients)
    one = fit_all(strategy, clients, down, generators(clients, 1), batched=False)
    many = fit_all(strategy, twins, down, generators(twins, 1), batched=True)
    for (_, u1), (_, u2) in zip(one, many, strict=True):
        for k in u1.tensors:  # the same computation up to float32 rounding of two paths
            torch.testing.assert_close(u1.tensors[k], u2.tensors[k], rtol=1e-4, atol=1e-5)
    # and the term does something: mu = 0 gives other weights
    plain, clients0, state0 = build("fedprox", mu=0.0)
    free = fit_all(plain, clients0, wire(plain.configure(state0, 1).broadcast),
                   generators(clients0, 1))
    assert not torch.allclose(free[0][1].tensors["head.weight"], one[0][1].tensors["head.weight"])
