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


def _float32_values_around(edges: np.ndarray) -> np.ndarray:
    """Every float32 within 3 ulps of each edge, plus random values."""
    near = [np.float32(e) for e in edges]
    values = []
    for centre in near:
        value = centre
        for _ in range(3):
            value = np.nextafter(value, np.float32(-1))
        for _ in range(7):
            values.append(value)
            value = np.nextafter(value, np.float32(2))
    values = np.clip(np.array(values, dtype=np.float32), 0, 1)
    random = np.random.default_rng(0).random(1000).astype(np.float32)
    return np.concatenate([values, random])


def numpy_bins(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    index = np.searchsorted(edges, values.astype(np.float64), side="right") - 1
    return np.clip(index, 0, len(edges) - 2)


def test_float32_confidences_near_uniform_edges_are_binned_as_in_float64():
    for n_bins in (3, 10, 15, 17):
        edges = np.linspace(0, 1, n_bins + 1)
        values = _float32_values_around(edges)
        got = bin_indices(torch.from_numpy(values), uniform_edges(n_bins)).numpy()
        np.testing.assert_array_equal(got, numpy_bins(values, edges))


def test_float32_confidences_near_quantile_edges_are_binned_as_in_float64():
    edges = np.array([0.0, 0.1234567891234, 0.3, 1 / 3, 0.7777777777777, 1.0])
    values = _float32_values_around(edges)
    got = bin_indices(torch.from_numpy(values), torch.from_numpy(edges)).numpy()
    np.testing.assert_array_equal(got, numpy_bins(values, edges))
