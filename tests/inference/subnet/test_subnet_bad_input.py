"""Bad input gets InvalidInputError (a ValueError) with a message saying what was wrong."""

from __future__ import annotations

import math

import pytest
import torch
from subnet_cases import make_loader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from inference.errors import InvalidInputError
from inference.subnet import (
    SubnetLaplacePosterior,
    fit_subnet_laplace,
    flat_trainable_parameters,
    select_subnet,
)


class ScalarOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)  # (B,), not (B, C)


class PerPixelOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, x):
        return self.lin(x).reshape(-1, 3, 2)  # (B, C, 2)


@pytest.mark.parametrize("model", [ScalarOutput(), PerPixelOutput()], ids=["(B,)", "(B,C,2)"])
def test_models_not_returning_batch_by_class_logits_are_rejected(model, mlp_case):
    _, loader, _ = mlp_case
    model = model.double()
    with pytest.raises(InvalidInputError, match=r"\(B, C\) logits"):
        fit_subnet_laplace(model, loader, [0])
    with pytest.raises(InvalidInputError, match=r"\(B, C\) logits"):
        select_subnet(model, loader, 1)


def test_loader_yielding_dicts_or_triples_is_rejected(mlp_case):
    model, loader, _ = mlp_case
    x, y = loader.dataset.tensors
    dicts = [{"x": x[:4], "y": y[:4]}]
    triples = [(x[:4], y[:4], y[:4])]
    with pytest.raises(InvalidInputError, match=r"\(X, y\) pairs"):
        fit_subnet_laplace(model, dicts, [0])
    with pytest.raises(InvalidInputError, match=r"\(X, y\) pairs"):
        fit_subnet_laplace(model, triples, [0])
    with pytest.raises(InvalidInputError, match="no"):
        fit_subnet_laplace(model, [], [0])


def test_non_integer_or_out_of_range_labels_are_rejected(mlp_case):
    model, loader, _ = mlp_case
    x, y = loader.dataset.tensors
    one_hot = DataLoader(TensorDataset(x, nn.functional.one_hot(y, 3).double()), batch_size=8)
    with pytest.raises(InvalidInputError, match="integer"):
        fit_subnet_laplace(model, one_hot, [0])
    too_big = DataLoader(TensorDataset(x, y + 3), batch_size=8)
    with pytest.raises(InvalidInputError, match=r"labels must lie in \[0, 3\)"):
        fit_subnet_laplace(model, too_big, [0])
    with pytest.raises(InvalidInputError, match="one label per row"):
        fit_subnet_laplace(model, [(x[:4], y[:3])], [0])


@pytest.mark.parametrize("size", [0, -2, 112, 0.0, 1.5, math.nan, True, "10"])
def test_subnet_size_zero_or_above_the_parameter_count_is_rejected(size, mlp_case):
    model, loader, _ = mlp_case
    assert flat_trainable_parameters(model).numel() == 111
    with pytest.raises(InvalidInputError):
        select_subnet(model, loader, size)


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([0, 111], r"\[0, 111\)"),
        ([-1, 3], r"\[0, 111\)"),
        ([3, 5, 3], "duplicate"),
        ([], "non-empty"),
        ([[0, 1]], "1-D"),
        (torch.tensor([0.0, 1.0]), "integers"),
    ],
)
def test_bad_subnet_indices_are_rejected(indices, message, mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(InvalidInputError, match=message):
        fit_subnet_laplace(model, loader, indices)


@pytest.mark.parametrize(
    ("prior", "message"),
    [
        (math.nan, "non-finite"),
        (math.inf, "non-finite"),
        (torch.full((111,), math.nan), "non-finite"),
        (0.0, "> 0"),
        (-1.0, "> 0"),
        (torch.ones(7), "length 111"),
    ],
)
def test_non_finite_or_non_positive_prior_is_rejected(prior, message, mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(InvalidInputError, match=message):
        fit_subnet_laplace(model, loader, [0, 1], prior_precision=prior)
    with pytest.raises(InvalidInputError, match=message):
        select_subnet(model, loader, 2, prior_precision=prior)


def test_non_finite_prior_mean_is_rejected(mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(InvalidInputError, match="prior_mean"):
        fit_subnet_laplace(model, loader, [0, 1], prior_mean=math.inf)


def test_unknown_backend_or_structure_is_rejected(mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(InvalidInputError, match="backend"):
        fit_subnet_laplace(model, loader, [0, 1], backend="backpack")
    with pytest.raises(InvalidInputError, match="hessian_structure"):
        fit_subnet_laplace(model, loader, [0, 1], hessian_structure="kron")


def test_model_without_trainable_parameters_is_rejected():
    model = nn.Linear(5, 3).double().requires_grad_(False)
    loader = make_loader(torch.randn(6, 5, dtype=torch.float64), 3)
    with pytest.raises(InvalidInputError, match="no trainable parameters"):
        select_subnet(model, loader, 1)


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5, True])
def test_non_positive_or_non_integer_chunk_size_is_rejected(chunk_size, mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(InvalidInputError, match="chunk_size"):
        fit_subnet_laplace(model, loader, [0, 1], chunk_size=chunk_size)


@pytest.mark.parametrize("prior", [math.nan, math.inf, 0.0])
def test_posterior_built_directly_rejects_a_bad_prior(prior):
    mean = torch.zeros(4, dtype=torch.float64)
    ggn = torch.eye(2, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="prior_precision"):
        SubnetLaplacePosterior(mean, torch.tensor([0, 1]), ggn, torch.full((2,), prior))
