"""The subnet posterior's marginal variances by Woodbury on the GGN's low-rank factor
(`inference.subnet.lowrank`) equal the dense posterior's.

Tolerances: float64 models, so both routes sum the same float64 terms in another order (one
factorises the S x S precision, the other the r x r Woodbury kernel): 1e-10 relative, far
below any change of the algebra (a missing sample or unit moves them by > 1e-3 here).
"""

from __future__ import annotations

import pytest
import torch
from subnet_cases import make_cnn, make_loader
from torch import nn

from inference.errors import InvalidInputError
from inference.subnet import fit_subnet_laplace, flat_trainable_parameters
from inference.subnet.diagonal import softmax_hessian_sqrt
from inference.subnet.fit import subnet_ggn
from inference.subnet.lowrank import (
    _projected_variance,
    _sample_factors,
    _unit_factors,
    lowrank_ggn,
    lowrank_logit_variance,
    lowrank_predict_proba,
    softmax_hessian_sqrt_reduced,
    subnet_lowrank_posterior,
    subnet_marginal_variance,
)


def _wide_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 9), nn.Tanh(),
                         nn.Linear(9, 4)).to(torch.float64).eval()


def _data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return make_loader(torch.randn(n, 20, generator=g, dtype=torch.float64), 4, seed)


def _two_layer_case(n: int) -> tuple[nn.Module, object, torch.Tensor, torch.Tensor]:
    """The wide MLP, ``n`` rows, a random prior precision over all its parameters and a subnet
    of units 2-8 of the first layer (weights and biases) and two units of the second: runs of
    several units in two layers; with n = 3 some samples have fewer active units than C - 1."""
    model = _wide_mlp()
    P = flat_trainable_parameters(model).numel()
    prior = 0.5 + torch.rand(P, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    first = [u * 20 + i for u in range(2, 9) for i in range(20)] + [240 + u for u in (2, 5)]
    second = [252 + u * 12 + i for u in (1, 4) for i in range(12)]
    return model, _data(n), prior, torch.tensor(sorted(first + second))


def test_reduced_softmax_hessian_sqrt_has_c_minus_1_columns_and_the_same_product():
    p = torch.softmax(3 * torch.randn(50, 6, dtype=torch.float64), -1)
    p[0] = torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.float64)  # one-hot: Lambda = 0
    V, full = softmax_hessian_sqrt_reduced(p), softmax_hessian_sqrt(p)
    assert V.shape == (5, 50, 6)
    product = torch.einsum("kbc,kbd->bcd", V, V)
    torch.testing.assert_close(product, torch.einsum("kbc,kbd->bcd", full, full),
                               rtol=0, atol=1e-15)


def test_sample_factors_keep_each_samples_gram_with_at_most_min_active_j_columns():
    g = torch.Generator().manual_seed(3)
    Q = torch.randn(6, 5, 3, generator=g, dtype=torch.float64)
    Q[0] = 0.0  # no active unit
    Q[1, 1:] = 0.0  # one active unit
    Q[2, [0, 2, 3]] = 0.0  # two active units, not the first
    F, valid = _sample_factors(Q)
    assert valid.sum(1).tolist() == [0, 1, 2, 3, 3, 3]
    assert bool((F[~valid.unsqueeze(1).expand_as(F)] == 0).all())
    torch.testing.assert_close(F @ F.transpose(1, 2), Q @ Q.transpose(1, 2), rtol=0, atol=1e-14)


@pytest.mark.parametrize("n", [3, 10, 25])
def test_woodbury_variances_equal_the_dense_posteriors(n):
    model, loader, prior, idx = _two_layer_case(n)
    dense = fit_subnet_laplace(model, loader, idx, prior).marginal_variance_subnet()
    lowrank = subnet_marginal_variance(model, loader, idx, prior[idx])
    assert lowrank is not None
    torch.testing.assert_close(lowrank, dense, rtol=1e-10, atol=0)
    assert float((dense * prior[idx]).min()) < 0.999  # the data shrink the variances


@pytest.mark.parametrize("n", [3, 25])
def test_the_ggn_rebuilt_from_the_lowrank_factors_is_the_subnet_ggn(n):
    # H = W W^T from the factors' A and F (before any truncation) against subnet_ggn's own
    # product of the full softmax Hessian's square root: float64 networks, the same terms
    # summed in another order (~1e-15 relative); a unit's rows mixed up, or F F^T taken as F^T
    # F, moves entries by O(1) of the largest
    model, loader, prior, idx = _two_layer_case(n)
    factors = subnet_lowrank_posterior(model, loader, idx, prior[idx])
    assert factors is not None
    rebuilt = lowrank_ggn(model, flat_trainable_parameters(model), factors)
    expected, _ = subnet_ggn(model, loader, idx)
    assert torch.equal(rebuilt, rebuilt.T)
    torch.testing.assert_close(rebuilt, expected, rtol=0, atol=1e-12 * float(expected.abs().max()))
    # factors of another subnet are refused
    with pytest.raises(InvalidInputError, match="do not belong"):
        lowrank_ggn(model, flat_trainable_parameters(model), {**factors, "subnet": idx[:-3]})


def test_routes_that_do_not_apply_or_do_not_pay_return_none():
    model = _wide_mlp()
    P = flat_trainable_parameters(model).numel()
    prior = torch.ones(5, dtype=torch.float64)
    # r = n (C - 1) >= S: the dense route is the cheaper one
    assert subnet_marginal_variance(model, _data(25), torch.arange(5), prior) is None
    # a Conv2d entry: no Linear factorisation
    cnn = make_cnn().eval()
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    assert subnet_marginal_variance(cnn, make_loader(x, 4), torch.arange(5), prior) is None
    # the data shrink an entry's variance > MAX_SHRINKAGE-fold: cancellation, dense route.
    # One input along feature 0: of one active unit's 20 weights only (u, 0) has curvature.
    x = torch.zeros(1, 20, dtype=torch.float64)
    x[0, 0] = 3.0
    unit = int(torch.nonzero(model[0](x)[0] > 0)[0])
    idx = torch.arange(unit * 20, unit * 20 + 20)
    weak = torch.full((20,), 1e-6, dtype=torch.float64)
    assert P > 20 and subnet_marginal_variance(model, make_loader(x, 4), idx, weak) is None
    kept = subnet_marginal_variance(model, make_loader(x, 4), idx, weak * 1e6)
    dense = fit_subnet_laplace(model, make_loader(x, 4), idx,
                               torch.ones(P, dtype=torch.float64)).marginal_variance_subnet()
    torch.testing.assert_close(kept, dense, rtol=1e-10, atol=0)


def _collinear_case(n: int = 25):
    """The wide MLP on inputs of rank 2 (in 20 features): the first layer's unit Grams
    ``M_u = A_u D_u^{-1} A_u^T`` have rank <= 2, so the Woodbury kernel ``E = W^T D^{-1} W``
    has rank <= 2 U << r ~ n (C - 1): most of it may be dropped."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64) @ torch.randn(
        2, 20, generator=g, dtype=torch.float64)
    model = _wide_mlp()
    P = flat_trainable_parameters(model).numel()
    prior = 0.5 + torch.rand(P, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    idx = torch.tensor([u * 20 + i for u in range(2, 9) for i in range(20)])
    return model, make_loader(x, 4, 3), idx, prior


def test_unit_factors_keep_a_full_rank_unit_whole_and_drop_a_low_rank_units_null_space():
    # the Grams M_u = X_u^T X_u of the rows of X in each unit's runs: unit 0 (two runs, so its
    # Gram is accumulated): G G^T + I/2 (every eigenvalue >= 1/2 > truncation / (U n)),
    # nothing may be dropped, T_0 T_0^T = M_0 to rounding (entries ~40: 1e-12 absolute is ~50
    # eps of them); unit 1: rank 5 in 30, k = 5 columns kept, the rest is rounding; unit 2: no
    # rows, no column
    g = torch.Generator().manual_seed(0)
    G = torch.randn(30, 30, generator=g, dtype=torch.float64)
    H = torch.randn(30, 5, generator=g, dtype=torch.float64)
    half = 0.5**0.5 * torch.eye(30, dtype=torch.float64)
    X = torch.cat([G.T[:20], H.T, G.T[20:], half])  # unit 0, unit 1, unit 0
    runs = [(0, 20, 0), (20, 25, 1), (25, 65, 0)]
    M = [G @ G.T + 0.5 * torch.eye(30, dtype=torch.float64), H @ H.T]
    for lapack in (None, False):  # LAPACK (dsyrk, dpstrf) and the eigendecomposition off it
        T, unit = _unit_factors(X, runs, 3, 1e-12, lapack=lapack)
        assert unit.tolist() == [0] * 30 + [1] * 5
        for u in (0, 1):
            T_u = T[:, unit == u]
            torch.testing.assert_close(T_u @ T_u.T, M[u], rtol=0, atol=1e-12)


def test_truncated_woodbury_drops_most_of_a_collinear_kernel_within_the_bound(monkeypatch):
    # The bound (module docstring): with K_t = I + C C^T, K - K_t = Delta PSD of trace <= tau,
    # 0 <= K_t^{-1} - K^{-1} <= K_t^{-1} Delta K_t^{-1}, so the variance
    # v_s = (1 - b_s^T K^{-1} b_s) / D_s (b_s = W_s / sqrt(D_s), |b_s|^2 = H_ss / D_s) moves
    # down by 0 <= v_s - v_t,s <= tau |b_s|^2 / D_s. Checked against the dense posterior with
    # 1e-12 relative slack for the two routes' rounding (their agreement at tau = 0 is ~1e-15).
    import inference.subnet.lowrank as lowrank

    model, loader, idx, prior = _collinear_case()
    dense = fit_subnet_laplace(model, loader, idx, prior)
    v = dense.marginal_variance_subnet()
    H_ss = dense.ggn.diagonal()
    D = prior[idx]
    ranks = []
    original = lowrank._unit_factors

    def spy(X, runs, U, truncation):
        T, unit = original(X, runs, U, truncation)
        ranks.append(T.shape[1])
        return T, unit

    monkeypatch.setattr(lowrank, "_unit_factors", spy)
    exact = subnet_marginal_variance(model, loader, idx, D)  # default truncation 1e-12
    torch.testing.assert_close(exact, v, rtol=1e-10, atol=0)
    (k,) = ranks
    assert k <= 2 * 7  # rank <= 2 per unit (7 units, weights only), against r ~ n (C - 1) = 75
    # tau = 1 and 10 drop 1 and 2 of the 14 unit directions (their per-entry tolerance
    # tau / (U n) against the scaled unit Grams' eigenvalues), visibly above rounding (the drop
    # reaches ~0.5% of its bound)
    for tau in (1.0, 10.0):
        truncated = subnet_marginal_variance(model, loader, idx, D, truncation=tau)
        drop = v - truncated
        bound = tau * H_ss / D.square()
        assert bool((drop >= -1e-12 * v).all())
        assert bool((drop <= bound + 1e-12 * v).all())
        assert float((drop / bound).max()) > 1e-4  # something was dropped
    assert ranks[1] < k and ranks[2] < ranks[1]


def _dense_logit_variance(posterior, x):
    """The dense posterior's linearised logit variances (B, C): the triangular solve on the
    full subnet Jacobian (`SubnetLaplacePosterior._logit_variance`), an independent route."""
    Jt, _ = posterior._subnet_jacobian()(x, column_scale=posterior._solve_scale)
    return posterior._logit_variance(Jt)


@pytest.mark.parametrize("truncation", [0.0, 1e-12])
def test_lowrank_logit_variances_and_predictive_equal_the_dense_posteriors(truncation):
    # float64 model: both routes sum the same float64 terms in another order (the dense one
    # factorises the S x S precision, this one the m x m truncated kernel); the truncation's
    # bound, 1e-12 |z|^2 (test below), is far smaller: 1e-10 relative, as the marginals'
    model, loader, prior, idx = _two_layer_case(10)
    factors = subnet_lowrank_posterior(model, loader, idx, prior[idx], truncation=truncation)
    assert factors is not None
    dense = fit_subnet_laplace(model, loader, idx, prior).bind(model)
    x = torch.randn(37, 20, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    mean = flat_trainable_parameters(model)
    f_var, logits = lowrank_logit_variance(model, mean, factors, x, rows=5)
    expected = _dense_logit_variance(dense, x)
    torch.testing.assert_close(f_var, expected, rtol=1e-10, atol=0)
    assert float(expected.min()) > 0
    probit, plugin = lowrank_predict_proba(model, mean, factors, x, chunk_size=8)
    torch.testing.assert_close(probit, dense.predict_proba(x, "glm_probit", chunk_size=8),
                               rtol=1e-12, atol=1e-14)
    # the plug-in: the same logits through the same chunks, bit for bit
    assert torch.equal(plugin, dense.predict_proba(x, "map", chunk_size=8))
    assert torch.equal(logits, dense._subnet_jacobian().logits(x))


def test_lowrank_logit_variances_move_within_the_truncation_bound():
    # Sigma_t = D^-1 - D^-1 W K_t^-1 W^T D^-1 with K_t <= K: the logit variance of J_o moves
    # down by 0 <= z^T (K_t^-1 - K^-1) z <= tau |K_t^-1 z|^2 <= tau |z|^2, z = W^T D^-1 J_o^T,
    # |z|^2 = J_o D^-1 H D^-1 J_o^T from the dense GGN H (an independent computation). 1e-12
    # relative slack for the two routes' rounding, as for the marginals.
    model, loader, idx, prior = _collinear_case()
    dense = fit_subnet_laplace(model, loader, idx, prior).bind(model)
    mean = flat_trainable_parameters(model)
    x = torch.randn(11, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) @ \
        torch.randn(2, 20, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    v = _dense_logit_variance(dense, x)
    Jt, _ = dense._subnet_jacobian()(x)  # (S, C, B)
    Dinv = prior[idx].reciprocal()
    u = Jt * Dinv[:, None, None]
    z2 = torch.einsum("scb,st,tcb->bc", u, dense.ggn, u)
    for tau in (1.0, 10.0):
        factors = subnet_lowrank_posterior(model, loader, idx, prior[idx], truncation=tau)
        f_var, _ = lowrank_logit_variance(model, mean, factors, x)
        drop = v - f_var
        assert bool((drop >= -1e-12 * v).all())
        assert bool((drop <= tau * z2 + 1e-12 * v).all())
        assert float(drop.max()) > 1e-12 * float(v.max())  # something was dropped


def test_lowrank_logit_variance_declines_what_it_cannot_factor():
    cnn = make_cnn().eval()
    x = torch.randn(4, 1, 6, 6, dtype=torch.float64)
    prior = torch.ones(5, dtype=torch.float64)
    assert subnet_lowrank_posterior(cnn, make_loader(x, 4), torch.arange(5), prior) is None


def test_lowrank_logit_variance_declines_where_the_data_shrink_a_logit_past_max_shrinkage():
    # the marginals' cancellation case (above): one training input along feature 0 and a prior
    # variance of 1e6, so that input's logits have their prior variance cut > 1e3-fold and the
    # subtraction would keep too few digits: None (the caller's dense route). At prior
    # precision 1 the same input's logit variances are kept and equal the dense posterior's.
    model = _wide_mlp()
    P = flat_trainable_parameters(model).numel()
    x = torch.zeros(1, 20, dtype=torch.float64)
    x[0, 0] = 3.0
    unit = int(torch.nonzero(model[0](x)[0] > 0)[0])
    idx = torch.arange(unit * 20, unit * 20 + 20)
    mean = flat_trainable_parameters(model)
    weak = torch.full((20,), 1e-6, dtype=torch.float64)
    factors = subnet_lowrank_posterior(model, make_loader(x, 4), idx, weak)
    assert factors is not None and lowrank_logit_variance(model, mean, factors, x) is None
    factors = subnet_lowrank_posterior(model, make_loader(x, 4), idx, weak * 1e6)
    f_var, _ = lowrank_logit_variance(model, mean, factors, x)
    dense = fit_subnet_laplace(model, make_loader(x, 4), idx,
                               torch.ones(P, dtype=torch.float64)).bind(model)
    torch.testing.assert_close(f_var, _dense_logit_variance(dense, x), rtol=1e-10, atol=0)


@pytest.mark.parametrize("projected", [True, False])
def test_projected_route_and_its_fallback_give_the_dense_variances(monkeypatch, projected):
    # the marginals by the unit bases (_projected_variance) or, where its a-posteriori bound
    # is refused (forced here by a negative tolerance), by the Y route: both equal the dense
    # posterior's to 1e-10 relative (float64, the same algebra in another order)
    import inference.subnet.lowrank as lowrank

    used = []
    original = lowrank._projected_variance

    def spy(*args):
        out = original(*args)
        used.append(out is not None)
        return out

    monkeypatch.setattr(lowrank, "_projected_variance", spy)
    if not projected:
        monkeypatch.setattr(lowrank, "PROJECTION_TOLERANCE", -1.0)
    model, loader, prior, idx = _two_layer_case(10)
    dense = fit_subnet_laplace(model, loader, idx, prior).marginal_variance_subnet()
    out = subnet_marginal_variance(model, loader, idx, prior[idx])
    assert used == [projected]
    torch.testing.assert_close(out, dense, rtol=1e-10, atol=0)


def test_projected_route_refuses_a_basis_that_misses_part_of_an_entrys_vector():
    # one unit, J = 1 and g = 1 (every sample active): the route's variances are those of the
    # precision I + X X^T (D = I, x_s the rows of X), 1 - x_s^T (I + X^T X)^{-1} x_s. With the
    # unit Gram's whole factor (rank 3) they are that to rounding (1e-12); with its last pivot
    # column dropped the entries' vectors leave the basis (|eps_s| ~ |x_s|), and the
    # a-posteriori bound (tau |b|^2 + 2 |b| |eps| + |eps|^2 with tau = 0) must refuse the
    # route: None. A bound that ignored eps_s would return wrong variances instead.
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(5)
    X = torch.randn(4, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 6, generator=g, dtype=torch.float64) * 0.3  # 4 entries in a 3-dim subspace of R^6
    plan = SimpleNamespace(runs=[(0, 4, 0)])
    T, unit = _unit_factors(X, plan.runs, 1, 0.0)
    assert T.shape == (6, 3)
    ones = torch.ones(6, 1, 1, dtype=torch.float64)
    dinv = torch.ones(4, dtype=torch.float64)
    exact = torch.linalg.inv(torch.eye(4, dtype=torch.float64) + X @ X.T).diagonal()
    full = _projected_variance(X, dinv, T, unit, [3], ones, plan, 0.0)
    torch.testing.assert_close(full, exact, rtol=1e-12, atol=0)
    assert _projected_variance(X, dinv, T[:, :2], unit[:2], [2], ones, plan, 0.0) is None


def test_projected_route_holds_its_bound_on_a_collinear_kernel():
    # with tau = 1 and 10 unit directions are dropped, so eps_s is not rounding: whichever
    # route runs, each variance is within its bound of the dense one; for the projected
    # route: (tau |b|^2 + 2 |b| |eps| + |eps|^2) / D <= PROJECTION_TOLERANCE v (refused
    # otherwise), for the Y route tau |b|^2 / D (test above). 1e-12 relative slack for
    # rounding.
    from inference.subnet.lowrank import PROJECTION_TOLERANCE

    model, loader, idx, prior = _collinear_case()
    dense = fit_subnet_laplace(model, loader, idx, prior)
    v = dense.marginal_variance_subnet()
    D = prior[idx]
    for tau in (1e-12, 1.0, 10.0):
        out = subnet_marginal_variance(model, loader, idx, D, truncation=tau)
        bound = torch.maximum(tau * dense.ggn.diagonal() / D.square(), PROJECTION_TOLERANCE * v)
        assert bool(((v - out).abs() <= bound + 1e-12 * v).all())
