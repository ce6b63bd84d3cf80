"""inference.curvature (issue 42: the curvature written once) against autograd.

The oracle is independent of the closed forms: ``torch.func.hessian`` of the softmax NLL in
logit space, and, for the GGN, ``torch.func.jacrev`` of a small network's logits chained through
that Hessian one row at a time (``sum_b J_b^T H_b J_b``). Tolerances: float64 throughout; the
quantities are sums of at most a few hundred products of O(1) numbers, so their rounding error is
~1e-15 relative; 1e-12 leaves room for different summation orders and still catches any wrong
term (a sign, a missing ``p p^T``, a transposed Jacobian moves entries by O(1e-2) or more)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from inference.curvature import (
    ggn,
    ggn_diagonal,
    ggn_diagonal_from_sqrt,
    ggn_from_sqrt,
    softmax_hessian_sqrt,
    softmax_hessian_sqrt_reduced,
    softmax_nll_hessian,
)
from inference.errors import InvalidInputError
from inference.subnet import diagonal_ggn, subnet_ggn

F64 = torch.float64
RTOL, ATOL = 1e-12, 1e-14


def autograd_nll_hessian(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, C, C) Hessian of ``-log softmax(f)_y`` in f, row by row, by torch.func.hessian."""
    def nll(f, y):
        return -torch.log_softmax(f, dim=-1)[y]
    return torch.stack([hessian(nll)(f, y) for f, y in zip(logits, labels, strict=True)])


def small_network(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    x = torch.randn(7, 4, dtype=F64)
    y = torch.randint(0, 3, (7,))
    return model, x, y


def autograd_jacobians(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, C, P) per-row Jacobians of the logits, parameters flattened in registration order."""
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for _, p in model.named_parameters())

    def logits(*flat):
        return functional_call(model, dict(zip(names, flat, strict=True)), (x,))

    parts = jacrev(logits, argnums=tuple(range(len(params))))(*params)
    return torch.cat([p.reshape(x.shape[0], -1, q.numel()) for p, q in
                      zip(parts, params, strict=True)], dim=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_softmax_nll_hessian_and_its_square_roots_are_autograd_hessian(seed):
    torch.manual_seed(seed)
    logits = 3.0 * torch.randn(5, 4, dtype=F64)
    labels = torch.randint(0, 4, (5,))
    reference = autograd_nll_hessian(logits, labels)
    probs = torch.softmax(logits, dim=-1)
    hess = softmax_nll_hessian(probs)
    torch.testing.assert_close(hess, reference, rtol=RTOL, atol=ATOL)
    assert torch.equal(hess, hess.transpose(1, 2))
    for root, k in ((softmax_hessian_sqrt(probs), 4), (softmax_hessian_sqrt_reduced(probs), 3)):
        assert root.shape == (k, 5, 4)
        torch.testing.assert_close(torch.einsum("kbc,kbd->bcd", root, root), reference,
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_ggn_and_its_diagonal_are_the_autograd_sandwich(seed):
    model, x, y = small_network(seed)
    J = autograd_jacobians(model, x)  # (B, C, P)
    with torch.no_grad():
        logits = model(x)
    H = autograd_nll_hessian(logits, y)
    reference = sum(J[b].T @ H[b] @ J[b] for b in range(x.shape[0]))
    probs = torch.softmax(logits, dim=-1)
    full = ggn(J, probs)
    torch.testing.assert_close(full, reference, rtol=RTOL, atol=ATOL)
    assert torch.equal(full, full.T)
    torch.testing.assert_close(ggn_diagonal(J, probs), reference.diagonal(), rtol=RTOL,
                               atol=ATOL)
    # the square-root forms on the same Jacobians (what the subnet code contracts)
    root = softmax_hessian_sqrt(probs)
    Z = torch.einsum("bop,kbo->pkb", J, root).reshape(J.shape[2], -1)
    torch.testing.assert_close(ggn_from_sqrt(Z), reference, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ggn_diagonal_from_sqrt(Z), reference.diagonal(), rtol=RTOL,
                               atol=ATOL)


def test_subnet_curvature_goes_through_the_same_definition():
    """The subnet code's GGN block and diagonal (their own Jacobian paths) equal the autograd
    sandwich: one definition, whichever path computes it."""
    model, x, y = small_network(3)
    J = autograd_jacobians(model, x)
    with torch.no_grad():
        H = autograd_nll_hessian(model(x), y)
    reference = sum(J[b].T @ H[b] @ J[b] for b in range(x.shape[0]))
    loader = [(x[:4], y[:4]), (x[4:], y[4:])]
    torch.testing.assert_close(diagonal_ggn(model, loader), reference.diagonal(), rtol=RTOL,
                               atol=ATOL)
    idx = torch.tensor([0, 5, 11, 23, 30, 40, 50], dtype=torch.int64)
    block, n = subnet_ggn(model, loader, idx)
    assert n == x.shape[0]
    torch.testing.assert_close(block, reference[idx][:, idx], rtol=RTOL, atol=ATOL)


def test_bad_shapes_are_refused_with_a_clear_error():
    probs = torch.full((2, 3), 1 / 3, dtype=F64)
    with pytest.raises(InvalidInputError, match=r"\(B, C, P\)"):
        ggn(torch.zeros(2, 4, 5, dtype=F64), probs)
    with pytest.raises(InvalidInputError, match="probs must be"):
        softmax_nll_hessian(torch.ones(3, dtype=F64))
    with pytest.raises(InvalidInputError, match=r"\(P, K\)"):
        ggn_from_sqrt(torch.ones(3, dtype=F64))
