"""Fixtures of the subnet Laplace tests; the models and loaders live in subnet_cases.py."""

import warnings

import pytest
import torch
from subnet_cases import make_cnn, make_loader, make_mlp


@pytest.fixture(autouse=True)
def _quiet_laplace_warnings():
    with warnings.catch_warnings():
        # laplace-torch warns that AsdlGGN falls back to torch.func Jacobians in the predictive.
        warnings.filterwarnings("ignore", message=".*ASDL backend.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@pytest.fixture
def mlp_case():
    """(model, loader, test inputs): 5 -> 7 -> 6 -> 3 MLP, 30 training points, float64."""
    model = make_mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    return model, make_loader(x, 3), torch.randn(11, 5, generator=g, dtype=torch.float64)


@pytest.fixture
def cnn_case():
    """(model, loader, test inputs): small CNN on 1x8x8 images, 20 training points, float64."""
    model = make_cnn()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 1, 8, 8, generator=g, dtype=torch.float64)
    return model, make_loader(x, 4), torch.randn(7, 1, 8, 8, generator=g, dtype=torch.float64)
