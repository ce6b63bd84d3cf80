"""Bin edges and bin membership conventions."""

import numpy as np
import torch

from calibration.binning import bin_indices, quantile_edges, uniform_edges


def test_uniform_edges_equal_numpy_linspace_exactly():
    for n_bins in (1, 7, 10, 15, 100):
        assert np.array_equal(uniform_edges(n_bins).numpy(), np.linspace(0, 1, n_bins + 1))


def test_bins_are_half_open_and_the_last_is_closed():
    edges = uniform_edges(10)
    confidence = torch.tensor([0.0, 0.1, 0.0999999, 0.5, 0.9, 0.95, 1.0], dtype=torch.float64)
    assert bin_indices(confidence, edges).tolist() == [0, 1, 0, 5, 9, 9, 9]


def test_float32_confidence_on_an_edge_is_compared_exactly_in_float64():
    # float32(0.4) is slightly above 0.4, so it falls in the bin that starts at 0.4 (index 6 of 15),
    # as numpy's searchsorted on the widened value does (and netcal with it).
    confidence = torch.tensor([0.4], dtype=torch.float32)
    expected = np.searchsorted(np.linspace(0, 1, 16), np.float64(np.float32(0.4)), side="right") - 1
    assert bin_indices(confidence, uniform_edges(15)).item() == expected


def test_quantile_edges_equal_numpy_quantile_with_ends_forced_to_zero_and_one():
    values = torch.tensor(np.random.default_rng(0).random(1001) * 0.6 + 0.3)
    expected = np.quantile(values.numpy(), np.linspace(0, 1, 11))
    expected[0], expected[-1] = 0.0, 1.0
    np.testing.assert_allclose(quantile_edges(values, 10).numpy(), expected, rtol=0, atol=1e-15)


def test_quantile_edges_with_repeated_confidences_stay_sorted():
    values = torch.tensor([0.5] * 50 + [0.9] * 3, dtype=torch.float64)
    edges = quantile_edges(values, 8)
    assert torch.all(edges[1:] >= edges[:-1])
    assert bin_indices(values, edges).max().item() <= 7
