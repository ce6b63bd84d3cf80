"""Conjugate exponential-family heads: FedLog and FedLog-C (spec ``fedlog.md``).

Clients send :class:`SufficientStatistics` (class-wise sums of ``[1, phi]``); the server sums
them, adds a :class:`ConjugatePrior` once, and a :class:`ConjugatePosterior` gives the exact MAP
head (:func:`solve_map`), a structured Laplace approximation, NUTS draws and predictive
probabilities. :func:`compactness_loss` is FedLog-C's client-side term; :mod:`.privacy` holds the
Gaussian mechanism for statistics.
"""

from inference.conjugate.compactness import ClassMeans, compactness_loss
from inference.conjugate.laplace import ConjugateLaplace
from inference.conjugate.posterior import ConjugatePosterior
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.privacy import clip_features, gaussian_sigma, l2_sensitivity, privatize
from inference.conjugate.solver import map_gradient, map_objective, solve_map, solve_map_adam
from inference.conjugate.statistics import SufficientStatistics

__all__ = [
    "ClassMeans",
    "ConjugateLaplace",
    "ConjugatePosterior",
    "ConjugatePrior",
    "SufficientStatistics",
    "clip_features",
    "compactness_loss",
    "gaussian_sigma",
    "l2_sensitivity",
    "map_gradient",
    "map_objective",
    "privatize",
    "solve_map",
    "solve_map_adam",
]
