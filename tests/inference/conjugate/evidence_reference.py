"""Independent references for the conjugate model's log evidence (no ``inference`` code).

The model (``inference.conjugate.evidence``): a pair ``(x, y)``, ``x = [1, s phi]`` in ``R^k``,
has density ``pi^(-k/2) exp(<W_y, x> - ||x||^2 - A(W))``, ``A(W) = logsumexp_y ||W_y||^2 / 4``,
under the prior ``exp(<W, chi> - nu A(W)) / Z(chi, nu)``. Written here from the model alone:

* one class (C = 1): ``x = w / 2 + e`` with ``e ~ N(0, I / 2)`` and the prior is the Gaussian
  ``w / 2 ~ N(chi / nu, I / (2 nu))``, so the n samples of each coordinate are jointly Gaussian
  with mean ``chi_j / nu`` and covariance ``I / 2 + 11^T / (2 nu)``: the evidence is a sum of
  multivariate normal log densities (scipy), exact;
* two classes, one feature (C = 2, k = 2): the normaliser
  ``Z(S, N) = ∫ exp(<W, S> - N A(W)) dW`` over ``R^4`` in polar coordinates per class, where
  the angle integrates in closed form (``∫ exp(<w, S_y>) over the circle of radius r =
  2 pi r I_0(r ||S_y||)``), leaving a 2-D integral over the radii done on a grid.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special, stats


def one_class_log_evidence(phi: np.ndarray, scale: float, nu: float, chi: np.ndarray) -> float:
    """``log p(phi | s)`` in the body's units (Jacobian ``n d log s``) of one class's features
    ``phi (n, d)`` under the prior ``chi (d + 1,)``, ``nu > 0``: the prior's normaliser
    included."""
    n, d = phi.shape
    x = np.concatenate([np.ones((n, 1)), scale * phi], axis=1)
    covariance = 0.5 * np.eye(n) + 0.5 / nu * np.ones((n, n))
    total = sum(stats.multivariate_normal(np.full(n, chi[j] / nu), covariance).logpdf(x[:, j])
                for j in range(d + 1))
    return float(total) + n * d * math.log(scale)


def one_class_log_prior_normaliser(chi: np.ndarray, nu: float) -> float:
    """``log Z(chi, nu)`` for C = 1, a Gaussian integral:
    ``||chi||^2 / nu + (k/2) log(4 pi / nu)``."""
    return float(np.sum(chi ** 2)) / nu + chi.size / 2.0 * math.log(4.0 * math.pi / nu)


def _radial_log_weight(r: np.ndarray, statistic: np.ndarray) -> np.ndarray:
    """``log(2 pi r I_0(r ||S_y||))``: the angular integral of ``exp(<w, S_y>)`` over the circle
    of radius ``r`` in ``R^2`` (``ive`` is ``I_0`` scaled by ``exp(-z)``)."""
    z = r * math.hypot(*statistic)
    return np.log(2.0 * np.pi * r) + np.log(special.ive(0, z)) + z


def two_class_log_normalizer(S: np.ndarray, N: float, points: int = 801) -> float:
    """``log Z(S, N)`` for ``S (2, 2)`` by quadrature over the two radii: a coarse grid on
    ``[0, 40]^2`` finds the window where the integrand lies within ``e^-45`` of its peak, two
    refinements narrow the grid to it (a Riemann sum of a smooth integrand that vanishes at the
    window's edges: its error is far below the Laplace approximation's)."""
    lo, hi = np.full(2, 1e-9), np.full(2, 40.0)
    for _ in range(3):
        radii = [np.linspace(lo[i], hi[i], points) for i in range(2)]
        weight = [_radial_log_weight(radii[i], S[i]) for i in range(2)]
        log_f = (weight[0][:, None] + weight[1][None, :]
                 - N * np.logaddexp(radii[0][:, None] ** 2 / 4, radii[1][None, :] ** 2 / 4))
        keep = np.argwhere(log_f > log_f.max() - 45.0)
        steps = (hi - lo) / (points - 1)
        new_lo = np.array([radii[i][keep[:, i].min()] for i in range(2)]) - steps
        new_hi = np.array([radii[i][keep[:, i].max()] for i in range(2)]) + steps
        lo, hi = np.maximum(new_lo, 1e-12), new_hi
    return (float(special.logsumexp(log_f)) + math.log(radii[0][1] - radii[0][0])
            + math.log(radii[1][1] - radii[1][0]))


def two_class_log_evidence_less_prior(phi: np.ndarray, labels: np.ndarray, scale: float,
                                      nu: float) -> float:
    """The two-class evidence of 1-D features ``phi (n,)`` with labels in {0, 1} under chi = 0
    and ``nu``, without the prior's normaliser (a constant in ``s``):
    ``log Z(T(s), nu + n) - (n + s^2 Q) - n log pi + n log s``."""
    n = phi.size
    x = np.stack([np.ones(n), scale * phi], axis=1)
    table = np.stack([x[labels == c].sum(axis=0) for c in range(2)])
    return (two_class_log_normalizer(table, nu + n) - float(np.sum(x ** 2))
            - n * math.log(math.pi) + n * math.log(scale))


def two_class_best_scale(phi: np.ndarray, labels: np.ndarray, nu: float,
                         bounds: tuple[float, float] = (0.05, 5.0)) -> float:
    """The scale of largest two-class evidence (bounded Brent over ``log s``, ``xatol`` 1e-4)."""
    result = optimize.minimize_scalar(
        lambda log_s: -two_class_log_evidence_less_prior(phi, labels, math.exp(log_s), nu),
        bounds=tuple(math.log(b) for b in bounds), method="bounded", options={"xatol": 1e-4})
    return math.exp(float(result.x))
