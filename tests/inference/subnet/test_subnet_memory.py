"""Memory preflight: an estimate before allocation, and an error with numbers and advice."""

from __future__ import annotations

import pytest
import torch

from inference.errors import MemoryBudgetError
from inference.subnet import fit_subnet_laplace
from inference.subnet.memory import available_memory_bytes, check_memory, tensor_bytes


def test_available_memory_is_a_positive_byte_count():
    assert available_memory_bytes("cpu") > 0


def test_check_memory_returns_the_total_when_it_fits_and_raises_with_numbers_otherwise():
    plan = {"a": 1000, "b": 24}
    assert check_memory(plan, device="cpu", advice="", max_memory_bytes=1024) == 1024
    with pytest.raises(MemoryBudgetError, match=r"needs 1.00 KiB \(a 1000 B, b 24 B\).*1023 B"):
        check_memory(plan, device="cpu", advice="Shrink it.", max_memory_bytes=1023)
    assert tensor_bytes((3, 4), torch.float64) == 96


def test_fit_preflight_counts_the_subnet_hessian_and_jacobian_chunk(mlp_case):
    model, loader, _ = mlp_case
    idx = torch.arange(40)
    hessians = 3 * 40 * 40 * 8
    with pytest.raises(MemoryBudgetError, match=r"smaller subnet.*chunk_size.*batch size"):
        fit_subnet_laplace(model, loader, idx, max_memory_bytes=hessians)
    jac_chunk = 2 * 3 * 8 * 40 * 8  # (C, rows, S) float64, twice
    budget = hessians + jac_chunk + 40 * 40 * 8
    fit_subnet_laplace(model, loader, idx, max_memory_bytes=budget)  # fits exactly
    with pytest.raises(MemoryBudgetError):
        fit_subnet_laplace(model, loader, idx, max_memory_bytes=budget - 1)
    fit_subnet_laplace(model, loader, idx, chunk_size=2, max_memory_bytes=budget - 1)


def test_laplace_torch_backend_preflight_counts_the_full_jacobian(mlp_case):
    model, loader, _ = mlp_case
    with pytest.raises(MemoryBudgetError, match="full per-batch Jacobian"):
        fit_subnet_laplace(
            model, loader, [0, 1], backend="laplace_torch", max_memory_bytes=8 * 3 * 111 * 8
        )


def test_predict_preflight_raises_and_advises_a_smaller_chunk(mlp_case):
    model, loader, x = mlp_case
    post = fit_subnet_laplace(model, loader, torch.arange(40))
    with pytest.raises(MemoryBudgetError, match="chunk_size"):
        post.predict_proba(x, chunk_size=11, max_memory_bytes=10_000)
    probs = post.predict_proba(x, chunk_size=1, max_memory_bytes=10_000)
    assert torch.allclose(probs, post.predict_proba(x), atol=1e-14)


def test_selection_preflight_counts_per_sample_conv_gradients(cnn_case):
    model, loader, _ = cnn_case
    from inference.subnet import select_subnet

    conv2 = 4 * 3 * 3 * 3  # the largest Conv2d weight
    needed = 2 * 8 * conv2 * 8  # (B x n) float64, twice, for a batch of 8
    with pytest.raises(MemoryBudgetError, match="Conv2d"):
        select_subnet(model, loader, 5, max_memory_bytes=needed - 1)
    assert select_subnet(model, loader, 5, max_memory_bytes=needed).numel() == 5
