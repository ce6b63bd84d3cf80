"""Posteriors over probabilistic heads: conjugate (FedLog), Laplace / subnet Laplace (FedSI),
MFVI (pyro-ppl) and SGLD, behind one protocol (`inference.posterior.Posterior`).

Switch methods with one string: ``inference.fit_head(kind, ...)``. This package knows nothing
about clients, rounds or messages. ``inference.mfvi`` (pyro) is imported only when used.
"""

from inference.body_posterior import BodyPosterior
from inference.conjugate import (
    ClassMeans,
    ConjugateLaplace,
    ConjugatePosterior,
    ConjugatePrior,
    DPNoiseReport,
    NoisyConjugatePosterior,
    PrivacyNoiseWarning,
    SufficientStatistics,
    clip_features,
    compactness_loss,
    gaussian_sigma,
    l2_sensitivity,
    privacy_signal_to_noise,
    privatize,
    solve_map,
)
from inference.ensemble import EnsemblePosterior
from inference.errors import (
    InferenceError,
    InvalidInputError,
    MemoryBudgetError,
    NumericalError,
    PosteriorFileError,
    UnknownOptionError,
)
from inference.factory import fit_head
from inference.gaussian import GaussianPosterior, GaussianTerm, average, combine, gaussian_prior
from inference.laplace_head import fit_laplace_head, log_marginal_likelihood
from inference.network_gaussian import NetworkGaussian
from inference.options import (
    CovarianceStructure,
    GuideKind,
    HeadKind,
    Likelihood,
    MapSolver,
    Preconditioner,
    PredictiveMethod,
)
from inference.posterior import Posterior, check, register_posterior
from inference.posterior_file import load_posterior, save_posterior
from inference.sgld import fit_sgld_head
from inference.subnet import (
    SubnetLaplacePosterior,
    diagonal_ggn,
    fit_subnet_laplace,
    select_subnet,
)

__all__ = [
    "BodyPosterior",
    "ClassMeans",
    "ConjugateLaplace",
    "ConjugatePosterior",
    "ConjugatePrior",
    "CovarianceStructure",
    "DPNoiseReport",
    "EnsemblePosterior",
    "GaussianPosterior",
    "GaussianTerm",
    "GuideKind",
    "HeadKind",
    "InferenceError",
    "InvalidInputError",
    "Likelihood",
    "MapSolver",
    "MemoryBudgetError",
    "NetworkGaussian",
    "NoisyConjugatePosterior",
    "NumericalError",
    "Posterior",
    "PosteriorFileError",
    "Preconditioner",
    "PredictiveMethod",
    "PrivacyNoiseWarning",
    "SubnetLaplacePosterior",
    "SufficientStatistics",
    "UnknownOptionError",
    "average",
    "check",
    "clip_features",
    "combine",
    "compactness_loss",
    "diagonal_ggn",
    "fit_head",
    "fit_laplace_head",
    "fit_sgld_head",
    "fit_subnet_laplace",
    "gaussian_prior",
    "gaussian_sigma",
    "l2_sensitivity",
    "load_posterior",
    "log_marginal_likelihood",
    "privacy_signal_to_noise",
    "privatize",
    "register_posterior",
    "save_posterior",
    "select_subnet",
    "solve_map",
]
