"""``subnet_laplace_state`` gives the tensors of ``fit_subnet_laplace(...).state_dict()``, bit for
bit (the same GGN, not factorised), and the posterior rebuilt from them predicts the same."""

from __future__ import annotations

import pytest
import torch
from subnet_cases import make_loader, make_mlp

from inference.subnet import SubnetLaplacePosterior, fit_subnet_laplace, flat_trainable_parameters
from inference.subnet.fit import subnet_laplace_state


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_state_without_factorising_equals_the_fitted_posteriors(structure):
    model = make_mlp(2).eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    loader = make_loader(x, 3)
    P = flat_trainable_parameters(model).numel()
    prior = 0.5 + torch.rand(P, generator=g, dtype=torch.float64)
    idx = torch.randperm(P, generator=g)[:25].sort().values
    post = fit_subnet_laplace(model, loader, idx, prior, hessian_structure=structure)
    state = subnet_laplace_state(model, loader, idx, prior, hessian_structure=structure)
    expected = post.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    again = SubnetLaplacePosterior.from_state_dict(state, model=model)
    assert torch.equal(again.predict_proba(x[:7]), post.predict_proba(x[:7]))


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_a_state_rebuilt_as_symmetric_predicts_bit_for_bit_the_same(structure):
    # subnet_ggn's GGN is exactly symmetric, so skipping the symmetrising copy
    # (assume_symmetric=True, what FedSI's personal posterior does) changes no bit; in float32
    # and float64 models (the float32 GGN chunks are summed in float64)
    for dtype in (torch.float64, torch.float32):
        model = make_mlp(2).to(dtype).eval()
        g = torch.Generator().manual_seed(6)
        x = torch.randn(30, 5, generator=g, dtype=dtype)
        loader = make_loader(x, 3)
        P = flat_trainable_parameters(model).numel()
        prior = 0.5 + torch.rand(P, generator=g, dtype=torch.float64)
        idx = torch.randperm(P, generator=g)[:25].sort().values
        state = subnet_laplace_state(model, loader, idx, prior, hessian_structure=structure)
        assert torch.equal(state["ggn"], state["ggn"].T)
        plain = SubnetLaplacePosterior.from_state_dict(state, model=model)
        held = SubnetLaplacePosterior.from_state_dict(state, model=model, assume_symmetric=True)
        assert held.ggn.data_ptr() == state["ggn"].data_ptr()  # no copy
        assert torch.equal(held.marginal_variance_subnet(), plain.marginal_variance_subnet())
        for method in ("glm_probit", "map"):
            assert torch.equal(held.predict_proba(x[:7], method),
                               plain.predict_proba(x[:7], method))
