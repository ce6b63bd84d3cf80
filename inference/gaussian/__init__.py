"""Gaussian posteriors in natural parameters, with the likelihood term kept apart from the prior.

A Gaussian over a flat parameter vector ``θ ∈ R^d`` is stored as natural parameters: a precision
``Λ`` and a precision-times-mean ``η = Λ μ`` (a `GaussianTerm`). The precision lives in
one structure, each its own class behind one interface (`inference.gaussian.precision`):
diagonal, dense (full), or low rank plus diagonal; a new structure is a subclass.
A `GaussianPosterior` keeps two terms, as laplace-torch keeps ``H`` apart from the prior
precision::

    Λ = Λ_prior + Λ_lik          η = η_prior + η_lik

The likelihood term is *defined* as the posterior's natural parameters minus the prior's, so a
client's local posterior (Laplace, MFVI or closed form) is ``prior + its likelihood term``, and the
global posterior of K clients is ``prior + Σ_k likelihood_k`` with the prior counted once
(`combine`, or ``+`` on posteriors). For a linear-Gaussian model this product is exact.
`average` is the other aggregation: the moment-matched Gaussian of a mixture.

Modules, one concept each: `cholesky` (the one jitter policy),
`precision` (the structure interface) with
`diagonal`, `full` and
`low_rank`, `term` (a factor),
`posterior` (the posterior and its predictive), `factor_memo` (a fitted posterior's
factorisation, kept for the state tensors it is rebuilt from),
`aggregation` (product and average).

Numerics: every solve, factorisation and sample runs in float64; results come back in the
posterior's storage dtype. Cholesky factorisations follow one jitter policy
(`cholesky_with_jitter`). Samples use the precision's Cholesky factor (or, for low rank,
perturb-and-solve); no covariance is inverted explicitly except where a caller asks for it
(`GaussianPosterior.covariance`) or the probit predictive of a dense posterior needs the
per-class covariance blocks.
"""

from inference.gaussian.aggregation import average, combine
from inference.gaussian.cholesky import JITTER_SCHEDULE, cholesky_with_jitter, solve_with_factor
from inference.gaussian.diagonal import DiagonalPrecision
from inference.gaussian.full import FullPrecision
from inference.gaussian.low_rank import LowRankPrecision
from inference.gaussian.posterior import GaussianPosterior
from inference.gaussian.precision import Precision, precision_class
from inference.gaussian.term import GaussianTerm, gaussian_prior

__all__ = [
    "JITTER_SCHEDULE",
    "DiagonalPrecision",
    "FullPrecision",
    "GaussianPosterior",
    "GaussianTerm",
    "LowRankPrecision",
    "Precision",
    "average",
    "cholesky_with_jitter",
    "combine",
    "gaussian_prior",
    "precision_class",
    "solve_with_factor",
]
