"""The strategy base: seeding a client's initial network without moving the caller's stream."""

import pytest
import torch

from bayesfl.bodies import build_body
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import derived_seed, seeded_rng
from tests.bayesfl.strategies.strategy_helpers import FEATURE_DIM, INPUT_DIM, context
from tests.devices import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rng_draws_what_manual_seed_draws_and_leaves_the_callers_stream(device):
    torch.manual_seed(5)
    expected_inside = (torch.rand(4), torch.rand(4, device=device))
    torch.manual_seed(11)
    torch.rand(3, device=device)  # the caller's streams, somewhere along
    after_caller = (torch.rand(4), torch.rand(4, device=device))

    torch.manual_seed(5)
    expected_inside_again = (torch.rand(4), torch.rand(4, device=device))
    torch.manual_seed(11)
    torch.rand(3, device=device)
    with seeded_rng(5, device):
        inside = (torch.rand(4), torch.rand(4, device=device))
    after = (torch.rand(4), torch.rand(4, device=device))

    for got, want in zip(inside, expected_inside, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(expected_inside_again, expected_inside, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(after, after_caller, strict=True):  # as if the block never ran
        assert torch.equal(got, want)


def test_an_initial_network_is_its_seeds_and_does_not_call_manual_seed(monkeypatch):
    # the oracle: the network torch.manual_seed(init_seed) builds (what initial_model did);
    # torch.manual_seed itself is refused: outside a started CUDA it records a traceback per
    # backend, 0.5 ms a client (8 s of setting up 16,000 clients)
    strategy = make_strategy("fedavg", context())
    config = strategy.context.client_config(0)
    torch.manual_seed(config.init_seed)
    oracle = strategy.build_model(build_body(config.body, (INPUT_DIM,), FEATURE_DIM))

    def refused(seed):
        raise AssertionError("initial_model called torch.manual_seed")

    monkeypatch.setattr(torch, "manual_seed", refused)
    torch.random.default_generator.manual_seed(123)
    before = torch.random.get_rng_state()
    model = strategy.initial_model(config)
    assert torch.equal(torch.random.get_rng_state(), before)
    got, want = model.state_dict(), oracle.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_clients_of_one_spec_and_seed_start_equal_each_with_its_own_tensors():
    # the state is built once per (body spec, seed) and copied: every client's state equals
    # the network its seed builds, and writing one client's never shows in another's
    strategy = make_strategy("fedlog", context(sizes=(5, 5, 5), bodies=("mlp:8", "mlp:6")))
    configs = [strategy.context.client_config(k) for k in range(3)]
    states = [strategy.init_client(c) for c in configs]
    for config, state in zip(configs, states, strict=True):
        built = strategy.initial_model(config).state_dict()
        assert state.keys() == {"model." + k for k in built}
        for name, value in built.items():
            assert torch.equal(state["model." + name], value), name
    assert configs[0].body == configs[2].body != configs[1].body
    first, third = states[0], states[2]
    for name in first:
        assert first[name].data_ptr() != third[name].data_ptr()
        first[name].add_(1.0)
        assert not torch.equal(first[name], third[name])
    again = strategy.init_client(configs[2])  # the copies are not the cache: it is unchanged
    assert all(torch.equal(again[name], third[name]) for name in third)


def test_each_body_spec_has_its_own_init_seed_derived_from_the_run_seed():
    # one seed per spec, the same for every client of it (memoised: asked once per client)
    strategy = make_strategy("fedavg", context(sizes=(5, 5, 5, 5), bodies=("mlp:8", "mlp:6")))
    seeds = [strategy.context.client_config(k).init_seed for k in range(4)]
    assert seeds[0] == seeds[2] == derived_seed(strategy.context.seed, 11, 0)
    assert seeds[1] == seeds[3] == derived_seed(strategy.context.seed, 11, 1)
    assert seeds[0] != seeds[1]


def test_a_strategy_with_its_own_initial_model_builds_every_clients_network():
    # a subclass may initialise from more than (spec, seed): nothing is shared between clients
    from bayesfl.strategies import FedAvg

    class PerClientInit(FedAvg):
        def initial_model(self, config):
            model = super().initial_model(config)
            with torch.no_grad():
                next(model.parameters()).fill_(float(config.client_id))
            return model

    strategy = PerClientInit(context())
    states = [strategy.init_client(strategy.context.client_config(k)) for k in range(3)]
    firsts = [next(iter(state.values())) for state in states]
    assert [float(first.flatten()[0]) for first in firsts] == [0.0, 1.0, 2.0]
