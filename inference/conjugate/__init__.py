"""Conjugate exponential-family heads: FedLog and FedLog-C (spec ``fedlog.md``).

Clients send `SufficientStatistics` (class-wise sums of ``[1, phi]``); the server sums
them, adds a `ConjugatePrior` once, and a `ConjugatePosterior` gives the exact MAP
head (`solve_map`), a structured Laplace approximation, NUTS draws and predictive
probabilities. `compactness_loss` is FedLog-C's client-side term; `.privacy` holds the
Gaussian mechanism for statistics and the check that its noise does not swamp them;
`NoisyConjugatePosterior` is the posterior of noisy statistics with the noise accounted
for (`.noise_aware`). `evidence_feature_scale` chooses the feature scale by the model's
log evidence of summed statistics (`.evidence`: federated type-II maximum likelihood).
"""

from inference.conjugate.compactness import ClassMeans, compactness_loss
from inference.conjugate.evidence import evidence_feature_scale, log_evidence
from inference.conjugate.laplace import ConjugateLaplace
from inference.conjugate.noise_aware import NoiseAwareLaplace, NoisyConjugatePosterior
from inference.conjugate.posterior import ConjugatePosterior
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.privacy import (
    DPNoiseReport,
    PrivacyNoiseWarning,
    clip_features,
    gaussian_sigma,
    l2_sensitivity,
    privacy_signal_to_noise,
    privatize,
)
from inference.conjugate.solver import map_gradient, map_objective, solve_map, solve_map_adam
from inference.conjugate.statistics import SufficientStatistics

__all__ = [
    "ClassMeans",
    "ConjugateLaplace",
    "ConjugatePosterior",
    "ConjugatePrior",
    "DPNoiseReport",
    "NoiseAwareLaplace",
    "NoisyConjugatePosterior",
    "PrivacyNoiseWarning",
    "SufficientStatistics",
    "clip_features",
    "compactness_loss",
    "evidence_feature_scale",
    "gaussian_sigma",
    "l2_sensitivity",
    "log_evidence",
    "map_gradient",
    "map_objective",
    "privacy_signal_to_noise",
    "privatize",
    "solve_map",
    "solve_map_adam",
]
