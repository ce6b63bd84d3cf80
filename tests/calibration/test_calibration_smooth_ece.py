"""Smooth ECE: equal to relplot's smECE (the authors' reference implementation) on random and
edge-case inputs, close to the continuous definition it discretises, and smooth diagrams."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
import relplot
import torch
from calibration_reference import calibrated_labels, random_probs
from matplotlib.collections import LineCollection
from relplot.estimators import KernelSmoother
from relplot.kernels import ReflectedGaussianKernel

from calibration.diagram import SMOOTH_CURVE_LABEL, SUPPORT_FRACTION, reliability_diagram
from calibration.errors import InvalidInputError
from calibration.metrics import reliability_stats
from calibration.smooth_ece import (
    smooth_calibration_error,
    smooth_ece,
    smooth_ece_details,
    smooth_reliability_curve,
)
from tests.devices import DEVICES

RELPLOT_TOL = 1e-6  # acceptance tolerance against relplot (measured agreement: ~1e-15)


def relplot_multiclass(probs, labels, probs_are_logits=False):
    f, y = relplot.multiclass_logits_to_confidences(probs, labels, probs=not probs_are_logits)
    value, width = relplot.smECE(f, y, return_width=True)
    return float(value), float(width)


# ---- against relplot ----------------------------------------------------------------------
@pytest.mark.parametrize("seed, n, k, scale", [(0, 1, 3, 2.0), (1, 7, 2, 1.0), (2, 200, 4, 2.5),
                                               (3, 1000, 10, 1.0), (4, 3000, 5, 4.0)])
def test_multiclass_smooth_ece_equals_relplot(seed, n, k, scale):
    rng = np.random.default_rng(seed)
    probs = random_probs(rng, n, k, scale=scale)
    labels = calibrated_labels(rng, probs ** 1.5)  # a miscalibrated model
    expected, width = relplot_multiclass(probs, labels)
    got = smooth_ece_details(probs, labels)
    assert got.value == pytest.approx(expected, abs=RELPLOT_TOL)
    assert got.bandwidth == width  # the same bisection: the same multiple of 2^-10
    assert got.count == n
    assert smooth_ece(probs, labels) == got.value


def test_logits_are_scored_through_their_softmax_like_relplot():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(300, 6)) * 3
    labels = rng.integers(0, 6, 300)
    expected, _ = relplot_multiclass(logits, labels, probs_are_logits=True)
    assert smooth_ece(logits, labels, from_logits=True) == pytest.approx(expected,
                                                                         abs=RELPLOT_TOL)


def _binary_cases():
    rng = np.random.default_rng(6)
    f = rng.uniform(size=400)
    return {
        "random": (f, (rng.uniform(size=400) < f ** 2).astype(float)),
        "all correct": (rng.uniform(0.5, 1.0, size=100), np.ones(100)),
        "all wrong": (rng.uniform(0.5, 1.0, size=100), np.zeros(100)),
        "constant confidence": (np.full(50, 0.8), (np.arange(50) % 3 != 0).astype(float)),
        "n = 1": (np.array([0.3]), np.array([1.0])),
        "n = 1, certain and right": (np.array([1.0]), np.array([1.0])),
        "exactly 0 and 1": (np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]),
                            np.array([0.0, 1.0, 1.0, 0.0, 0.0, 1.0])),
        "all 1 and right": (np.ones(30), np.ones(30)),
        "all 0 and wrong": (np.zeros(30), np.ones(30)),
        "well calibrated, dense near 1": (
            (g := rng.uniform(0.9, 1.0, size=2000)), (rng.uniform(size=2000) < g).astype(float)),
    }


@pytest.mark.parametrize("case", list(_binary_cases()))
def test_binary_smooth_ece_equals_relplot_on_edge_cases(case):
    f, y = _binary_cases()[case]
    expected, width = relplot.smECE(f, y, return_width=True)
    got = smooth_calibration_error(f, y)
    assert got.value == pytest.approx(float(expected), abs=RELPLOT_TOL)
    assert got.bandwidth == float(width)


@pytest.mark.parametrize("case, probs, labels", [
    ("all correct", np.eye(4)[[0, 1, 2, 3, 1]], [0, 1, 2, 3, 1]),
    ("all wrong", np.eye(4)[[0, 1, 2, 3, 1]], [1, 2, 3, 0, 0]),
    ("uniform rows", np.full((9, 3), 1 / 3), [0, 1, 2] * 3),
    ("one sample", np.array([[0.2, 0.8]]), [0]),
])
def test_multiclass_edge_cases_equal_relplot(case, probs, labels):
    expected, width = relplot_multiclass(probs, np.array(labels))
    got = smooth_ece_details(probs, labels)
    assert got.value == pytest.approx(expected, abs=RELPLOT_TOL), case
    assert got.bandwidth == width


@pytest.mark.parametrize("bandwidth", [0.3, 0.05, 0.00998, 0.0013])
def test_fixed_bandwidth_equals_relplot_smece_sigma(bandwidth):
    # 0.00998 gives relplot an even grid (1002 points): its kernel sits half a step off-centre
    rng = np.random.default_rng(7)
    f = rng.uniform(size=500)
    y = (rng.uniform(size=500) < np.sqrt(f)).astype(float)
    expected = relplot.smECE_sigma(f, y, bandwidth)
    got = smooth_calibration_error(f, y, bandwidth=bandwidth)
    assert got.value == pytest.approx(float(expected), abs=RELPLOT_TOL)
    assert got.bandwidth == bandwidth


@pytest.mark.parametrize("device", DEVICES)
def test_torch_numpy_float32_and_devices_agree(device):
    rng = np.random.default_rng(8)
    probs = random_probs(rng, 500, 5, dtype=np.float32)
    labels = calibrated_labels(rng, probs)
    expected, _ = relplot_multiclass(probs, labels)  # relplot widens float32 as we do
    got = smooth_ece(torch.from_numpy(probs).to(device), torch.from_numpy(labels).to(device))
    assert got == pytest.approx(expected, abs=RELPLOT_TOL)


# ---- against the definition -------------------------------------------------------------------
def reflected_gaussian(t, f, sigma):
    """K(t, f): a Gaussian density at f reflected once about 0 and about 1 (column per f)."""
    def phi(x):
        return np.exp(-x**2 / (2 * sigma**2)) / (np.sqrt(2 * np.pi) * sigma)
    t, f = t[:, None], f[None, :]
    return phi(t - f) + phi(t + f) + phi(t - (2 - f))


def test_fixed_bandwidth_value_approximates_the_continuous_definition():
    # smECE_sigma = int |sum_i K(t, f_i) r_i| dt / int sum_i K(t, f_i) dt, by a fine trapezoid
    rng = np.random.default_rng(9)
    f = rng.uniform(size=300)
    y = (rng.uniform(size=300) < f ** 1.5).astype(float)
    sigma = 0.05
    t = np.linspace(0, 1, 20001)
    kernel = reflected_gaussian(t, f, sigma)
    exact = np.trapezoid(np.abs(kernel @ (f - y)), t) / np.trapezoid(kernel.sum(1), t)
    # the estimator spreads the f_i onto a grid of spacing 1e-3 = sigma / 50 (an O((h/sigma)^2)
    # ~ 4e-4 change) and replaces both integrals by plain sums over 200 mesh points, which
    # weight the two end points fully where an integral weights them by half: up to
    # 1 / (200 - 1) = 5e-3 relative. Dropping the reflection changes this value by 2.6%.
    assert smooth_calibration_error(f, y, bandwidth=sigma).value == pytest.approx(exact,
                                                                                  rel=5e-3)


def test_a_single_confidence_value_has_smooth_ece_equal_to_its_gap():
    # all mass at one prediction c: the smoothed residual is (c - accuracy) everywhere
    y = (np.arange(40) % 4 != 0).astype(float)  # accuracy 0.75
    got = smooth_calibration_error(np.full(40, 0.9), y)
    # relplot's density floor of 1e-4 against a kernel sum of ~40 per mesh point: 3e-6
    assert got.value == pytest.approx(0.15, rel=1e-5)


def test_the_automatic_bandwidth_is_the_fixed_point_to_the_search_resolution():
    rng = np.random.default_rng(10)
    probs = random_probs(rng, 800, 4)
    labels = calibrated_labels(rng, probs ** 2)
    got = smooth_ece_details(probs, labels)
    step = 2.0 ** -10
    below = smooth_ece_details(probs, labels, bandwidth=got.bandwidth - step)
    assert got.bandwidth >= got.value  # sigma* >= smECE(sigma*) ...
    assert got.bandwidth - step < below.value  # ... and one step lower it is the other way


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("f, y, match", [
    ([0.5, 1.2], [1, 0], r"\[0, 1\]"),
    ([0.5, np.nan], [1, 0], r"\[0, 1\]"),
    ([0.5, 0.2], [1, 2], "0 or 1"),
    ([0.5, 0.2], [1], "mismatch"),
    ([], [], "empty"),
    ([[0.5]], [[1]], "1-D"),
])
def test_bad_binary_inputs_are_refused(f, y, match):
    with pytest.raises(InvalidInputError, match=match):
        smooth_calibration_error(np.array(f, dtype=float), np.array(y, dtype=float))


@pytest.mark.parametrize("bandwidth", [0.0, -0.1, np.inf, True, 1e-7])
def test_bad_bandwidths_are_refused(bandwidth):
    with pytest.raises(InvalidInputError, match="bandwidth"):
        smooth_calibration_error([0.5], [1], bandwidth=bandwidth)


def test_multiclass_inputs_are_validated_like_every_metric():
    with pytest.raises(InvalidInputError, match="sum to 1"):
        smooth_ece(np.array([[0.5, 0.6]]), [0])


# ---- smooth reliability diagrams --------------------------------------------------------------
def test_smooth_curve_is_relplots_kernel_smoother_and_its_density_integrates_to_one():
    rng = np.random.default_rng(11)
    f = rng.uniform(0.2, 0.8, size=600)
    y = (rng.uniform(size=600) < f).astype(float)
    curve = smooth_reliability_curve(f, y, bandwidth=0.05, mesh_points=101)
    smoother = KernelSmoother(ReflectedGaussianKernel(0.05)).fit(f[:, None], y)
    expected = smoother.predict(curve.mesh.numpy()[:, None])
    np.testing.assert_allclose(curve.mean_outcome.numpy(), expected, atol=1e-9)
    mass = np.trapezoid(curve.density.numpy(), curve.mesh.numpy())
    assert mass == pytest.approx(1.0, abs=1e-3)  # mass more than 4 sigma from the ends
    assert curve.smooth_ece.value == pytest.approx(relplot.smECE_sigma(f, y, 0.05), abs=1e-9)


def test_smooth_curve_uses_the_automatic_bandwidth_by_default():
    rng = np.random.default_rng(12)
    f = rng.uniform(size=300)
    y = (rng.uniform(size=300) < f).astype(float)
    assert smooth_reliability_curve(f, y).smooth_ece == smooth_calibration_error(f, y)


def test_smooth_reliability_diagram_draws_the_curve_density_and_smooth_ece():
    rng = np.random.default_rng(13)
    probs = random_probs(rng, 500, 4)
    labels = calibrated_labels(rng, probs ** 0.7)
    figure = reliability_diagram(probs, labels, smooth=True)
    top, strip = figure.axes[:2]
    curves = [c for c in top.collections
              if isinstance(c, LineCollection) and c.get_label() == SMOOTH_CURVE_LABEL]
    assert len(curves) == 1
    segments = curves[0].get_segments()
    confidence = probs.max(1)
    correct = (probs.argmax(1) == labels).astype(float)
    curve = smooth_reliability_curve(confidence, correct)
    density = curve.density.numpy()
    supported = density >= SUPPORT_FRACTION * density.max()
    drawn = supported[:-1] & supported[1:]
    assert 0 < drawn.sum() < len(drawn)  # confidences never reach 1/4 or 1 here
    np.testing.assert_allclose([s[0][1] for s in segments],
                               curve.mean_outcome.numpy()[:-1][drawn], atol=1e-12)
    np.testing.assert_allclose([s[0][0] for s in segments], curve.mesh.numpy()[:-1][drawn],
                               atol=1e-12)
    value = smooth_ece(probs, labels)
    assert any(f"smECE = {100 * value:.2f}%" in text.get_text() for text in top.texts)
    assert strip.get_ylabel() == "Density" and strip.get_xlabel() == "Confidence"
    assert plt.get_fignums() == []


def test_smooth_diagram_needs_probabilities_and_labels():
    rng = np.random.default_rng(14)
    probs = random_probs(rng, 50, 3)
    labels = calibrated_labels(rng, probs)
    with pytest.raises(InvalidInputError, match="BinStats"):
        reliability_diagram(reliability_stats(probs, labels), smooth=True)
    with pytest.raises(InvalidInputError, match="labels are required"):
        reliability_diagram(probs, smooth=True)
