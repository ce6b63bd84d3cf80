"""The documented options of `inference`, as ``str`` enums that also accept plain strings.

Every public function that takes one of these options accepts either the enum member or its
string value (``"full"`` or ``CovarianceStructure.FULL``); `Option.parse` does the
conversion and raises `InvalidInputError` naming the valid choices.

Numeric options (prior precisions, step counts, learning rates, ...) are described by a
`NumberRule`; `NUMERIC_OPTIONS` lists those of the fitting functions, and
`NumberRule.parse` refuses NaN, infinities, booleans, strings and out-of-range values with
an [`InvalidInputError`][inference.errors.InvalidInputError] (an `InferenceError`
and a ``ValueError``) that names the option, the value and what it must be.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

import numpy as np

from inference.errors import InvalidInputError


class Option(StrEnum):
    """Base class: a string enum with a forgiving, explicit parser."""

    @classmethod
    def parse(cls, value: str | Self, name: str | None = None) -> Self:
        """Return the member whose value is ``value`` (case-insensitive).

        Raises:
            InvalidInputError: ``value`` is not one of the members' values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        choices = ", ".join(repr(m.value) for m in cls)
        raise InvalidInputError(
            f"{name or cls.__name__} must be one of {choices}; got {value!r}."
        )


class HeadKind(Option):
    """Which posterior [`inference.factory.fit_head`][inference.factory.fit_head] fits.

    ``conjugate``: FedLog's conjugate exponential-family head (inference.conjugate).
    ``laplace``: Laplace approximation of a softmax head on fixed features.
    ``subnet_laplace``: FedSI's GGN subnetwork Laplace of a whole network (inference.subnet).
    ``mfvi``: mean-field variational inference of a softmax head (pyro-ppl).
    ``sgld``: stochastic-gradient Langevin dynamics over a softmax head (sample ensemble).
    """

    CONJUGATE = "conjugate"
    LAPLACE = "laplace"
    SUBNET_LAPLACE = "subnet_laplace"
    MFVI = "mfvi"
    SGLD = "sgld"


class CovarianceStructure(Option):
    """Structure of a Gaussian precision matrix.

    ``diag``: diagonal. ``full``: dense symmetric. ``lowrank``: low-rank plus diagonal,
    ``diag(D) + L Lᵀ`` with ``L`` of shape ``(d, r)``.
    """

    DIAG = "diag"
    FULL = "full"
    LOWRANK = "lowrank"


class PredictiveMethod(Option):
    """How a posterior over softmax-head weights becomes class probabilities.

    ``probit``: logits' Gaussian mean ``f`` and per-class variance ``v`` give
    ``softmax(f / sqrt(1 + π v / 8))`` (the multiclass probit approximation of laplace-torch).
    ``centred_probit``: the same applied to the centred logits ``P f`` (``P = I − 11ᵀ/C``):
    ``softmax`` ignores a shift of all logits, so ``P f ~ N(P f̄, P V P)`` has exactly the
    predictive of ``f``, without the variance of the shift, which a prior puts there (the
    likelihood never sees it) and the marginal probit would count as uncertainty.
    ``mc``: average of ``softmax`` over posterior draws. ``map``: ``softmax`` at the mean.
    """

    PROBIT = "probit"
    CENTRED_PROBIT = "centred_probit"
    MC = "mc"
    MAP = "map"


class Likelihood(Option):
    """Observation model of a linear head ``f = W [1, x]``.

    ``softmax``: ``y ~ Categorical(softmax(f))`` (classification, the default).
    ``gaussian``: ``y ~ Normal(f, noise_std²)`` (regression; used by ground-truth tests).
    """

    SOFTMAX = "softmax"
    GAUSSIAN = "gaussian"


class MapSolver(Option):
    """Optimiser for the Laplace head's mode.

    ``newton``: damped Newton with the exact Hessian (float64; a softmax head solves its steps
    matrix-free by conjugate gradients, at any size; a Gaussian likelihood factorises, best up
    to a few thousand parameters). ``lbfgs``: L-BFGS with strong-Wolfe line search (needs only
    gradients).
    """

    NEWTON = "newton"
    LBFGS = "lbfgs"


class GuideKind(Option):
    """pyro autoguide of the MFVI head: ``auto_normal`` (AutoNormal, one loc/scale per site) or
    ``auto_diagonal_normal`` (AutoDiagonalNormal, one flat loc/scale)."""

    AUTO_NORMAL = "auto_normal"
    AUTO_DIAGONAL_NORMAL = "auto_diagonal_normal"


class Preconditioner(Option):
    """SGLD preconditioning: ``none`` (plain Welling-Teh SGLD), ``rmsprop`` (pSGLD, Li et al.
    2016: a diagonal RMSprop preconditioner) or ``laplace`` (a constant full preconditioner, the
    covariance of the Laplace posterior at the chains' start; see `inference.sgld`)."""

    NONE = "none"
    RMSPROP = "rmsprop"
    LAPLACE = "laplace"


# -- numeric options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class NumberRule:
    """Which numbers a numeric option takes: an integer or a finite real, within bounds.

    ``low`` / ``high`` are inclusive unless ``low_open`` / ``high_open``. Infinite and NaN values
    are never accepted (no option of [`inference`][inference] means anything at infinity), nor are
    booleans (``True`` is an ``int`` to Python, but never a meaningful count or scale).
    """

    integer: bool = False
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        """The rule in words, e.g. ``"an integer >= 1"`` or ``"a finite number in (0, 1]"``."""
        what = "an integer" if self.integer else "a finite number"
        has_low, has_high = math.isfinite(self.low), math.isfinite(self.high)
        low, high = _plain(self.low), _plain(self.high)
        if has_low and has_high:
            return (f"{what} in {'(' if self.low_open else '['}{low}, {high}"
                    f"{')' if self.high_open else ']'}")
        if has_low:
            return f"{what} {'>' if self.low_open else '>='} {low}"
        if has_high:
            return f"{what} {'<' if self.high_open else '<='} {high}"
        return what

    def parse(self, value: Any, name: str) -> int | float:
        """``value`` as a Python ``int`` / ``float`` if it satisfies the rule.

        NumPy scalars are accepted (``np.int64(5)``, ``np.float32(0.1)``); an integer option
        refuses floats, even whole ones (``1e3``), so that a typo does not pass silently.

        Raises:
            InvalidInputError: the wrong type, NaN or infinite, or out of bounds; the message
                names the option, the value and what it must be.
        """
        wanted = self.describe()
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            kind = "" if value is None else f" (a {type(value).__name__})"
            raise InvalidInputError(f"{name} must be {wanted}; got {value!r}{kind}.")
        if not isinstance(value, numbers.Integral) and not math.isfinite(float(value)):
            raise InvalidInputError(f"{name} must be {wanted}; got {value!r}.")
        if self.integer and not isinstance(value, numbers.Integral):
            raise InvalidInputError(
                f"{name} must be {wanted}; got {value!r} (a {type(value).__name__}); write it "
                "without a decimal point or exponent."
            )
        try:
            number: int | float = int(value) if self.integer else float(value)
        except OverflowError:  # an integer beyond float64's range for a real option
            raise InvalidInputError(f"{name} must be {wanted}; got {value!r}.") from None
        below = number <= self.low if self.low_open else number < self.low
        above = number >= self.high if self.high_open else number > self.high
        if below or above:
            raise InvalidInputError(f"{name} must be {wanted}; got {value!r}.")
        return number


def _plain(bound: float) -> str:
    return str(int(bound)) if math.isfinite(bound) and bound == int(bound) else f"{bound:g}"


POSITIVE = NumberRule(low=0.0, low_open=True)
NON_NEGATIVE = NumberRule(low=0.0)
FINITE = NumberRule()
UNIT_INTERVAL_OPEN_LEFT = NumberRule(low=0.0, high=1.0, low_open=True)
COUNT = NumberRule(integer=True, low=1)
NON_NEGATIVE_INT = NumberRule(integer=True, low=0)
SEED = NumberRule(integer=True, low=0, high=2**64 - 1)  # what torch.Generator.manual_seed takes

#: The numeric options of the fitting functions behind `inference.fit_head`, by name.
#: `inference.factory.fit_head` checks every option it is given against this table
#: before the fitting function runs (a ``None`` or string passes where the fitting function's
#: signature declares it, e.g. ``batch_size=None`` for full batches).
NUMERIC_OPTIONS: dict[str, NumberRule] = {
    "prior_precision": POSITIVE,
    "prior_mean": FINITE,
    "noise_std": POSITIVE,
    "rank": NON_NEGATIVE_INT,
    "max_iter": COUNT,
    "num_steps": COUNT,
    "lr": POSITIVE,
    "final_lr_fraction": UNIT_INTERVAL_OPEN_LEFT,
    "batch_size": COUNT,
    "num_particles": COUNT,
    "init_scale": POSITIVE,
    "seed": SEED,
    "step_size": POSITIVE,
    "num_samples": COUNT,
    "burn_in": NON_NEGATIVE_INT,
    "thinning": COUNT,
    "num_chains": COUNT,
    "divergence_threshold": POSITIVE,
    "nu": NON_NEGATIVE,
    "chi": FINITE,
    "feature_scale": POSITIVE,
    "num_draws": COUNT,
    "elbo_max_iter": COUNT,
    "max_root_steps": COUNT,
    "empirical_bayes_warmup": NumberRule(low=0.0, high=1.0, high_open=True),
}


def check_number(value: Any, name: str, rule: NumberRule) -> int | float:
    """``rule.parse(value, name)``: the option as a Python number, or
    [`InvalidInputError`][inference.InvalidInputError] saying what it must be."""
    return rule.parse(value, name)


class PriorPrecisionMethod(Option):
    """How a head chooses its prior precision λ when none is given (see
    `inference.hyperparameters`).

    ``marglik``: maximise the log marginal likelihood (evidence) ``log p(y | X, λ)`` over
    ``log λ`` in bounds, continuously (grid, then bounded Brent); needs only the training data.
    ``validation``: the λ of a log-spaced grid with the lowest NLL of the head's predictive on
    held-out data (laplace-torch's ``gridsearch``); needs ``validation_data``.
    """

    MARGLIK = "marglik"
    VALIDATION = "validation"


class VariationalPriorMethod(Option):
    """How the MFVI head chooses its prior precision λ when none is given (see
    `inference.mfvi.fit_mfvi_head`).

    ``elbo``: empirical Bayes on the ELBO: λ is learnt with the guide (the ELBO's exact
    maximiser in λ for the current guide, bounded). ``marglik``: the λ maximising the Laplace
    evidence of the same model (`inference.laplace_head.fit_laplace_head`).
    """

    ELBO = "elbo"
    MARGLIK = "marglik"


class FeatureScaleMethod(Option):
    """How the conjugate head chooses its feature scale ``s`` (the model's class-conditional
    standard deviation is ``1 / (s √2)``) when none is given (see
    `inference.conjugate.feature_scale`).

    ``conditional``: maximise the conditional log likelihood of the training labels,
    ``Σ log p(y_i | s φ_i, W*(s))``, over ``log s`` (grid, then bounded Brent); training data only.
    ``validation``: the same on held-out ``validation_data`` (an unbiased choice when the body
    was trained on the training set, whose features it separates better than new ones).
    ``evidence``: maximise the model's own log evidence of the features and labels (type-II
    maximum likelihood, `inference.conjugate.evidence`): a function of the statistics and
    ``Σ ||φ_i||²``, so a federation can compute it from sums.
    """

    CONDITIONAL = "conditional"
    VALIDATION = "validation"
    EVIDENCE = "evidence"


class GaussianApproximation(Option):
    """Which Gaussian the feature-head Laplace fitter returns (`inference.laplace_head`).

    ``laplace``: ``N(W*, (λI + H(W*))⁻¹)``, the curvature at the mode (laplace-torch's).
    ``variational``: the Gaussian closest to the posterior in ``KL(q ‖ p)``, ``Λ = λI +
    E_q[H]``, started from the Laplace one (`inference.variational_gaussian`); the same
    for a Gaussian likelihood, where both are exact.
    """

    LAPLACE = "laplace"
    VARIATIONAL = "variational"
