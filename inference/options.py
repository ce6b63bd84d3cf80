"""The documented options of :mod:`inference`, as ``str`` enums that also accept plain strings.

Every public function that takes one of these options accepts either the enum member or its
string value (``"full"`` or ``CovarianceStructure.FULL``); :meth:`Option.parse` does the
conversion and raises :class:`~inference.errors.InvalidInputError` naming the valid choices.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self

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
    """Which posterior :func:`inference.factory.fit_head` fits.

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
    ``mc``: average of ``softmax`` over posterior draws. ``map``: ``softmax`` at the mean.
    """

    PROBIT = "probit"
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

    ``newton``: damped Newton with the exact Hessian (float64; best up to a few thousand
    parameters). ``lbfgs``: L-BFGS with strong-Wolfe line search (needs only gradients).
    """

    NEWTON = "newton"
    LBFGS = "lbfgs"


class GuideKind(Option):
    """pyro autoguide of the MFVI head: ``auto_normal`` (AutoNormal, one loc/scale per site) or
    ``auto_diagonal_normal`` (AutoDiagonalNormal, one flat loc/scale)."""

    AUTO_NORMAL = "auto_normal"
    AUTO_DIAGONAL_NORMAL = "auto_diagonal_normal"


class Preconditioner(Option):
    """SGLD preconditioning: ``none`` (plain Welling-Teh SGLD) or ``rmsprop`` (pSGLD, Li et al.
    2016: a diagonal RMSprop preconditioner)."""

    NONE = "none"
    RMSPROP = "rmsprop"
