"""The prior precision of a head that has no usable evidence of its own: the Laplace evidence.

SGLD returns draws, from which the evidence ``p(y | X, λ)`` cannot be read; the MFVI head has its
ELBO, a lower bound whose gap (the KL from the mean-field guide to the posterior) itself depends
on λ and biases its maximiser towards strong priors (Turner & Sahani, 2011, "Two problems with
variational expectation maximisation for time-series models"). Both heads are the same model as
the Laplace head — a linear head with the prior ``N(μ₀, I/λ)`` and the same likelihood — so the
λ that maximises that model's Laplace evidence (`inference.laplace_head.fit_laplace_head`
with ``prior_precision="marglik"``: a bounded, continuous search over ``log λ``, the mode refitted
at every λ) is a choice of λ for them too, made from the training data alone.
"""

from __future__ import annotations

from torch import Tensor

from inference.hyperparameters import DEFAULT_BOUNDS, HyperparameterChoice
from inference.laplace_head import fit_laplace_head
from inference.options import (
    CovarianceStructure,
    GaussianApproximation,
    Likelihood,
    PriorPrecisionMethod,
)


def laplace_evidence_prior_precision(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_mean: float = 0.0,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    bounds: tuple[float, float] = DEFAULT_BOUNDS,
) -> HyperparameterChoice:
    """The λ maximising the Laplace evidence of the linear head on ``features (N, m)``.

    Returns:
        The `HyperparameterChoice` (method ``"marglik"``: λ,
        the log evidence there in nats, whether λ hit a bound).

    Raises:
        InvalidInputError: bad data or bounds. NumericalError: a mode did not converge.
    """
    laplace = fit_laplace_head(features, labels, num_classes,
                               prior_precision=PriorPrecisionMethod.MARGLIK,
                               prior_mean=prior_mean, structure=CovarianceStructure.FULL,
                               likelihood=likelihood, noise_std=noise_std,
                               prior_precision_bounds=bounds,
                               approximation=GaussianApproximation.LAPLACE)  # λ is all we use
    return laplace.prior_selection
