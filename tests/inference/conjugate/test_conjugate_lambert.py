"""lambert_w0_from_log: principal Lambert W from log(x), against scipy and identities."""

import numpy as np
import torch
from scipy.special import lambertw

from inference.conjugate.lambert import lambert_w0_from_log


def test_matches_scipy_over_the_representable_range():
    t = torch.linspace(-60.0, 700.0, 20001, dtype=torch.float64)
    w, log_w = lambert_w0_from_log(t)
    reference = np.real(lambertw(np.exp(t.numpy())))
    assert np.max(np.abs(w.numpy() - reference) / reference) <= 1e-14  # a few ulps
    assert np.max(np.abs(log_w.numpy() - np.log(reference))) <= 1e-13


def test_defining_identity_holds_far_beyond_float64_arguments():
    # w + log(w) = t, checked in relative terms for x = e^t from 1e-434294 to e^(1e300).
    t = torch.tensor([-1e6, -800.0, -45.0, 3.0, 1e3, 1e10, 1e300], dtype=torch.float64)
    w, log_w = lambert_w0_from_log(t)
    assert bool(torch.isfinite(log_w).all())
    residual = (w + log_w - t).abs() / t.abs()
    assert float(residual.max()) <= 1e-15


def test_zero_argument_gives_zero():
    w, log_w = lambert_w0_from_log(torch.tensor([float("-inf")], dtype=torch.float64))
    assert float(w) == 0.0
    assert float(log_w) == float("-inf")
