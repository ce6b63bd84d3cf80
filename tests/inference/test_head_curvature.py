"""The softmax head's curvature built by blocks (issue 41): the same matrix as the sum of
per-row Kronecker products, for one head (the Hessian) and averaged over probability draws (the
variational Gaussian's expected curvature), whatever the chunking of the rows; exactly
symmetric (the Cholesky factorisations skip their symmetrisation on it); and every point's logit
covariance by block rows, the same as ``J_n Σ J_nᵀ`` with the Jacobian written out."""

from __future__ import annotations

import pytest
import torch

import inference.curvature as curvature_module
from inference.gaussian import cholesky_with_jitter
from inference.head_objective import likelihood_hessian, logit_covariance, softmax_curvature
from inference.options import Likelihood

F64 = torch.float64


def brute_force(probs: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``mean_s Σ_n (diag p_sn − p_sn p_snᵀ) ⊗ x_n x_nᵀ`` one row and one draw at a time: the
    definition, written independently of the block GEMM (the class index is the outer one of
    the flat ``(C (m + 1),)`` head, as ``W.reshape(-1)`` of a ``(C, m + 1)`` head)."""
    total = torch.zeros(probs.shape[-1] * inputs.shape[1], probs.shape[-1] * inputs.shape[1],
                        dtype=F64)
    for draw in probs:
        for p, x in zip(draw, inputs, strict=True):
            total += torch.kron(torch.diag(p) - torch.outer(p, p), torch.outer(x, x))
    return total / probs.shape[0]


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_the_block_curvature_is_the_sum_of_kronecker_products(chunk, monkeypatch):
    if chunk is not None:  # chunks of ~chunk rows (the GEMM is accumulated over them)
        monkeypatch.setattr(curvature_module, "_CHUNK_ELEMENTS", chunk * 10 * 5)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(23, 5, generator=gen, dtype=F64)
    probs = torch.softmax(2 * torch.randn(6, 23, 4, generator=gen, dtype=F64), -1)
    # float64 sums of 23 x 6 terms of size ≤ ~10: a few ulps of 100, far below 1e-10
    torch.testing.assert_close(softmax_curvature(probs, inputs), brute_force(probs, inputs),
                               atol=1e-10, rtol=0)


def test_one_head_s_curvature_is_the_hessian_of_its_negative_log_likelihood():
    gen = torch.Generator().manual_seed(1)
    inputs = torch.cat([torch.ones(40, 1, dtype=F64), torch.randn(40, 6, generator=gen,
                                                                  dtype=F64)], 1)
    targets = torch.randint(0, 5, (40,), generator=gen)
    theta = torch.randn(35, generator=gen, dtype=F64)

    def nll(flat):
        logits = inputs @ flat.reshape(5, 7).T
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")

    reference = torch.autograd.functional.hessian(nll, theta)
    hessian = likelihood_hessian(theta, inputs, 5, Likelihood.SOFTMAX, 1.0)
    # both exact in float64 (sums of 40 terms): 1e-10
    torch.testing.assert_close(hessian, reference, atol=1e-10, rtol=0)


def test_the_block_curvature_is_exactly_symmetric_so_its_factor_needs_no_symmetrisation():
    gen = torch.Generator().manual_seed(2)
    inputs = torch.randn(31, 6, generator=gen, dtype=F64)
    probs = torch.softmax(3 * torch.randn(5, 31, 4, generator=gen, dtype=F64), -1)
    curvature = softmax_curvature(probs, inputs)
    assert torch.equal(curvature, curvature.T)  # mirrored blocks: bit for bit
    precision = curvature + 0.5 * torch.eye(24, dtype=F64)
    assert torch.equal(cholesky_with_jitter(precision, symmetric=True),
                       cholesky_with_jitter(precision))


@pytest.mark.parametrize("num_classes", [1, 2, 5])
def test_logit_covariance_is_the_jacobian_sandwich_of_the_head_covariance(num_classes):
    gen = torch.Generator().manual_seed(3)
    width = 7
    inputs = torch.randn(19, width, generator=gen, dtype=F64)
    root = torch.randn(num_classes * width, num_classes * width, generator=gen, dtype=F64)
    covariance = root @ root.T
    eye = torch.eye(num_classes, dtype=F64)
    # J_n = I_C ⊗ x_nᵀ maps the flat (C (m + 1),) head to the logits of point n
    reference = torch.stack([torch.kron(eye, x[None]) @ covariance @ torch.kron(eye, x[None]).T
                             for x in inputs])
    out = logit_covariance(covariance, inputs, num_classes)
    # float64 sums of ~50 products of size ~10: a few ulps of ~1e3, far below 1e-9
    torch.testing.assert_close(out, reference, atol=1e-9, rtol=0)
    assert torch.equal(out, out.transpose(1, 2))


@pytest.mark.parametrize("draws", [1, 6])
def test_the_row_product_path_and_the_block_row_path_give_the_same_matrices(draws, monkeypatch):
    """Curvature and logit covariances from the cached row products ``x_n x_nᵀ`` (issue 41)
    against the definition, and against the block-row path that larger inputs take."""
    gen = torch.Generator().manual_seed(4)
    width, num_classes = 6, 4
    inputs = torch.randn(37, width, generator=gen, dtype=F64)  # 37 ≥ 4 (m + 1): products
    probs = torch.softmax(2 * torch.randn(draws, 37, num_classes, generator=gen, dtype=F64), -1)
    root = torch.randn(num_classes * width, num_classes * width, generator=gen, dtype=F64)
    covariance = root @ root.T
    eye = torch.eye(num_classes, dtype=F64)
    sandwich = torch.stack([torch.kron(eye, x[None]) @ covariance @ torch.kron(eye, x[None]).T
                            for x in inputs])
    assert curvature_module.row_products(inputs) is not None  # the product path runs
    by_products = softmax_curvature(probs, inputs), logit_covariance(covariance, inputs,
                                                                     num_classes)
    monkeypatch.setattr(curvature_module, "_PRODUCT_ELEMENTS", 0)
    assert curvature_module.row_products(inputs) is None  # the block-row path runs
    by_blocks = softmax_curvature(probs, inputs), logit_covariance(covariance, inputs,
                                                                   num_classes)
    # float64 sums of ≤ 37 x 6 terms of size ≤ ~10 (curvature) and ~600 products of size ~10
    # (covariances ~1e3): a few ulps, far below 1e-10 and 1e-9
    for curvature in (by_products[0], by_blocks[0]):
        torch.testing.assert_close(curvature, brute_force(probs, inputs), atol=1e-10, rtol=0)
        assert torch.equal(curvature, curvature.T)
    for out in (by_products[1], by_blocks[1]):
        torch.testing.assert_close(out, sandwich, atol=1e-9, rtol=0)
        assert torch.equal(out, out.transpose(1, 2))


def test_the_cached_row_products_follow_the_inputs():
    """The products are cached for the last inputs; an in-place change or other inputs of the
    same shape get their own."""
    gen = torch.Generator().manual_seed(5)
    inputs = torch.randn(30, 5, generator=gen, dtype=F64)
    probs = torch.softmax(torch.randn(1, 30, 3, generator=gen, dtype=F64), -1)
    first = softmax_curvature(probs, inputs)
    assert curvature_module.row_products(inputs) is curvature_module.row_products(inputs)
    inputs.mul_(2.0)  # in place: the curvature is 4x, not the cached one
    torch.testing.assert_close(softmax_curvature(probs, inputs), 4 * first, atol=1e-12,
                               rtol=0)
    other = torch.randn(30, 5, generator=gen, dtype=F64)
    torch.testing.assert_close(softmax_curvature(probs, other), brute_force(probs, other),
                               atol=1e-10, rtol=0)


def test_the_row_products_are_each_rows_upper_triangle_in_triu_order():
    """Every row's ``x xᵀ`` upper triangle, in ``torch.triu_indices`` order (what the gather
    indices of the curvature and the logit covariance assume), bit for bit."""
    inputs = torch.randn(7, 6, generator=torch.Generator().manual_seed(8), dtype=F64)
    rows, cols = torch.triu_indices(6, 6)
    expected = torch.einsum("np,nq->npq", inputs, inputs)[:, rows, cols]
    assert torch.equal(curvature_module.row_products(inputs), expected)


def test_a_head_too_large_for_the_gather_index_takes_the_block_row_path(monkeypatch):
    """Above ``_INDEX_ELEMENTS`` the curvature is built by block rows (the gather index would be
    as large as the result), with the same matrix."""
    gen = torch.Generator().manual_seed(6)
    inputs = torch.randn(33, 5, generator=gen, dtype=F64)
    probs = torch.softmax(torch.randn(2, 33, 3, generator=gen, dtype=F64), -1)
    monkeypatch.setattr(curvature_module, "_INDEX_ELEMENTS", 15 * 15 - 1)  # d = 15
    calls = []
    monkeypatch.setattr(curvature_module, "_curvature_index",
                        lambda *args: calls.append(args))  # must not be reached
    curvature = softmax_curvature(probs, inputs)
    assert not calls
    # as the product-path test: a few ulps of ~100
    torch.testing.assert_close(curvature, brute_force(probs, inputs), atol=1e-10, rtol=0)
    assert torch.equal(curvature, curvature.T)


def test_the_expected_softmax_hessian_is_the_draws_mean_whatever_their_layout():
    # the variational fit holds its draws as a (S, N, C) view of (S, C, N) memory: the result
    # must be the definition there too, and the same bits as the contraction on the view
    # itself (it runs on a contiguous copy only for speed; the fits' figures must not move)
    gen = torch.Generator().manual_seed(3)
    memory = torch.softmax(3 * torch.randn(16, 4, 9, generator=gen, dtype=F64), dim=1)
    view = memory.transpose(1, 2)  # (S, N, C), not contiguous
    assert not view.is_contiguous()
    expected = torch.stack([
        sum(torch.diag(p) - torch.outer(p, p) for p in view[:, n]) / view.shape[0]
        for n in range(view.shape[1])])
    # sums of 16 terms of size <= 1: a few ulps, far below 1e-12
    torch.testing.assert_close(curvature_module.expected_softmax_hessian(view), expected,
                               rtol=0, atol=1e-12)
    on_the_view = (torch.diag_embed(view.mean(0))
                   - torch.einsum("snc,snk->nck", view, view) / view.shape[0])
    assert torch.equal(curvature_module.expected_softmax_hessian(view), on_the_view)
