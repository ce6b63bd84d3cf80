"""Subnet selection: largest diagonal-GGN-Laplace marginal variance, trainable index space."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from laplace import Laplace
from laplace.curvature import AsdlGGN
from subnet_cases import laplace_subnet_reference, make_loader, make_mlp
from torch import nn

from inference.errors import InvalidInputError
from inference.subnet import (
    diagonal_ggn,
    fit_subnet_laplace,
    flat_trainable_parameters,
    rank_by_variance,
    select_subnet,
)


def linear_case(seed=0):
    """Softmax regression f(x) = W x + b: the diagonal GGN has a closed form."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(25, 4, generator=g, dtype=torch.float64) * torch.tensor(
        [0.2, 1.0, 2.0, 0.5], dtype=torch.float64
    )
    return model, x, make_loader(x, 3, batch_size=7)


def closed_form_diag_ggn(model, x):
    """diag GGN of W[i, j] = sum_x (p_i - p_i^2) x_j^2 and of b[i] = sum_x (p_i - p_i^2)."""
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    lam = p - p.square()  # (N, C): diagonal of diag(p) - p p^T
    return torch.cat([(lam.T @ x.square()).reshape(-1), lam.sum(0)])


def test_diagonal_ggn_of_softmax_regression_equals_the_closed_form():
    model, x, loader = linear_case()
    assert torch.allclose(diagonal_ggn(model, loader), closed_form_diag_ggn(model, x), atol=1e-12)


def test_selection_returns_the_true_top_k_variances_of_softmax_regression():
    model, x, loader = linear_case()
    n = flat_trainable_parameters(model).numel()
    prior = torch.linspace(0.5, 4.0, n, dtype=torch.float64).flip(0)
    variance = 1.0 / (closed_form_diag_ggn(model, x) + prior)
    for k in (1, 5, 9, n):
        expected = torch.topk(variance, k).indices.sort().values
        idx = select_subnet(model, loader, k, prior)
        assert idx.dtype == torch.int64 and idx.device.type == "cpu"
        assert torch.equal(idx, expected)


def test_diagonal_ggn_matches_laplace_torch_diag_laplace(mlp_case):
    model, loader, _ = mlp_case
    la = Laplace(
        copy.deepcopy(model),
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        backend=AsdlGGN,
    )
    la.fit(loader)
    assert torch.allclose(diagonal_ggn(model, loader), la.H, atol=1e-10, rtol=0)


def test_fraction_size_is_floor_of_the_fraction_of_trainable_parameters(mlp_case):
    model, loader, _ = mlp_case
    n = flat_trainable_parameters(model).numel()
    assert select_subnet(model, loader, 0.1).numel() == int(0.1 * n)
    assert select_subnet(model, loader, 1e-9).numel() == 1


def test_frozen_head_is_outside_the_index_space_and_agrees_with_laplace_torch(mlp_case):
    model, loader, x_test = mlp_case
    model[4].requires_grad_(False)  # the head
    n_body = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert flat_trainable_parameters(model).numel() == n_body
    idx = select_subnet(model, loader, 20, 1.0)
    assert int(idx.max()) < n_body
    post = fit_subnet_laplace(model, loader, idx, 1.0)
    la = laplace_subnet_reference(model, loader, idx)
    assert torch.allclose(post.precision, la.posterior_precision, atol=1e-10)
    assert torch.allclose(post.predict_proba(x_test), la(x_test, link_approx="probit"), atol=1e-10)


def dead_unit_case():
    """MLP whose hidden unit 0 never fires: its 5 incoming weights and bias have no curvature."""
    model = make_mlp()
    with torch.no_grad():
        model[2].bias[0] = -1e3  # second Linear: unit 0 pre-activation << 0 -> ReLU dead
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    dead = [42 + j for j in range(7)] + [84]  # model[2].weight row 0 and model[2].bias[0]
    return model, make_loader(x, 3), torch.tensor(dead)


def test_zero_curvature_parameters_are_ranked_last_unless_faithful():
    model, loader, dead = dead_unit_case()
    diag = diagonal_ggn(model, loader)
    assert bool((diag[dead] == 0).all())
    # Dead weights have the largest variance (= prior variance) ...
    faithful = select_subnet(model, loader, 8, 1.0, filter_zero_curvature=False)
    assert set(dead.tolist()) <= set(faithful.tolist())
    # ... but cannot change predictions: filtered by default.
    filtered = select_subnet(model, loader, 8, 1.0)
    assert not set(dead.tolist()) & set(filtered.tolist())
    n = flat_trainable_parameters(model).numel()
    # Head weights fed by the dead unit (model[4].weight[:, 0]) also carry no curvature.
    n_alive = int((diag > 1e-12 * diag.max()).sum())
    with pytest.warns(UserWarning, match="zero-curvature"):
        everything = select_subnet(model, loader, n_alive + 1, 1.0)
    assert everything.numel() == n_alive + 1 and int(everything.max()) < n


def test_ties_break_by_larger_curvature_then_lower_index():
    diag = torch.tensor([1.0, 2.0, 0.5, 1.0, 0.0], dtype=torch.float64)
    prior = torch.tensor([2.0, 1.0, 2.5, 2.0, 3.0], dtype=torch.float64)  # all variances 1/3
    assert rank_by_variance(diag, prior, 1).tolist() == [1]
    assert rank_by_variance(diag, prior, 2).tolist() == [0, 1]
    assert rank_by_variance(diag, prior, 3).tolist() == [0, 1, 3]
    assert rank_by_variance(diag, prior, 4).tolist() == [0, 1, 2, 3]  # zero curvature last
    assert torch.equal(rank_by_variance(diag, prior, 4), rank_by_variance(diag, prior, 4))


@pytest.mark.parametrize("size", [0, 6, 2.0])
def test_rank_by_variance_rejects_a_size_outside_one_to_p(size):
    diag = torch.ones(5, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="size"):
        rank_by_variance(diag, diag, size)
    with pytest.raises(InvalidInputError, match=r"\(P,\)"):
        rank_by_variance(diag, torch.ones(4, dtype=torch.float64), 2)


def test_the_partition_ranking_picks_what_a_full_lexsort_picks():
    # first_in_lexsort_order against np.lexsort itself (the former code): keys with many ties
    # (small integers, both signs, +0.0 against -0.0) so that every level of the partition is
    # reached, and one NaN key (its fallback); 2,000 random cases, every size
    from inference.subnet.selection import first_in_lexsort_order

    rng = np.random.default_rng(7)
    for _ in range(2000):
        count = int(rng.integers(1, 50))
        keys = [np.arange(count)]
        for _ in range(int(rng.integers(1, 4))):
            kind = rng.integers(4)
            if kind == 0:
                keys.append(rng.integers(0, 3, count) * rng.choice([-1.0, 1.0]))
            elif kind == 1:
                keys.append(rng.normal(size=count))
            elif kind == 2:
                keys.append(np.where(rng.random(count) < 0.5, 0.0, -0.0))
            else:
                keys.append(rng.integers(0, 2, count).astype(np.int8))
        if rng.random() < 0.05:
            keys[-1] = np.where(rng.random(count) < 0.2, np.nan, 1.0)
        size = int(rng.integers(1, count + 1))
        np.testing.assert_array_equal(first_in_lexsort_order(keys, size),
                                      np.sort(np.lexsort(keys)[:size]))
