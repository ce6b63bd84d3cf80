"""Choosing a prior's strength (a precision λ > 0) from the data: the search and its record.

Two criteria, one search. A head supplies ``criterion(λ)`` — its log evidence ``log p(y | X, λ)``
(``"marglik"``, maximised) or minus its validation NLL (``"validation"``) — and
:func:`maximise_log_space` maximises it over ``log λ`` in a bounded interval:

1. a coarse grid, ``points_per_decade`` points a decade over ``[lower, upper]`` (ends included),
   finds the best cell; a smooth unimodal criterion has its maximiser in the two cells around
   the best grid point;
2. bounded Brent (``scipy.optimize.minimize_scalar(method="bounded")``) on those two cells to
   ``xatol`` in ``log λ`` (skipped for the ``"validation"`` grid search, which keeps the grid,
   as laplace-torch's ``gridsearch`` does).

The result, a :class:`PriorPrecisionChoice`, says which λ won, by what criterion value, and
whether it sits at an end of the interval (then the optimum may lie beyond it: widen
``bounds``, or read it as "the data want no prior" / "the prior dominates").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.optimize

from inference.errors import InvalidInputError, NumericalError
from inference.options import PriorPrecisionMethod

#: Default search interval, laplace-torch's ``optimize_prior_precision`` grid (1e-4 .. 1e4).
DEFAULT_BOUNDS = (1e-4, 1e4)
#: Brent's absolute tolerance on ``log λ``: λ to a relative 1e-6, far below any effect on the
#: posterior (the criterion is flat to second order there: ~κ·1e-12 nats off the maximum).
LOG_XATOL = 1e-6


@dataclass(frozen=True)
class PriorPrecisionChoice:
    """The chosen prior precision and how it was found.

    Attributes:
        method: ``"marglik"`` (maximised log evidence) or ``"validation"`` (validation NLL).
        value: the chosen ``λ``.
        criterion: at ``value``: the log evidence in nats (marglik) or the mean validation NLL
            in nats per point (validation).
        bounds: the search interval ``(lower, upper)``.
        at_bound: ``"lower"`` or ``"upper"`` when ``value`` is (within the tolerance) an end
            of the interval, else ``None``.
        evaluations: criterion evaluations (each a MAP refit).
        grid: ``(λ, criterion)`` pairs of the coarse grid, for plots and checks.
    """

    method: str
    value: float
    criterion: float
    bounds: tuple[float, float]
    at_bound: str | None
    evaluations: int
    grid: tuple[tuple[float, float], ...]

    @property
    def hit_bound(self) -> bool:
        """True when the choice is an end of the search interval."""
        return self.at_bound is not None

    def summary(self) -> dict[str, object]:
        """JSON-ready figures (without the grid)."""
        name = "log_evidence" if self.method == PriorPrecisionMethod.MARGLIK else "validation_nll"
        return {"method": self.method, "prior_precision": self.value, name: self.criterion,
                "bounds": list(self.bounds), "at_bound": self.at_bound,
                "evaluations": self.evaluations}


def check_bounds(bounds: tuple[float, float]) -> tuple[float, float]:
    """``bounds`` as floats if ``0 < lower < upper < inf``; else :class:`InvalidInputError`."""
    try:
        lower, upper = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise InvalidInputError(
            f"prior_precision_bounds must be a pair (lower, upper); got {bounds!r}.") from None
    if not (0 < lower < upper < math.inf):
        raise InvalidInputError(
            f"prior_precision_bounds must satisfy 0 < lower < upper < inf; got {bounds!r}.")
    return lower, upper


def maximise_log_space(
    criterion: Callable[[float], float],
    method: PriorPrecisionMethod,
    bounds: tuple[float, float] = DEFAULT_BOUNDS,
    points_per_decade: int = 1,
    refine: bool = True,
    xatol: float = LOG_XATOL,
) -> PriorPrecisionChoice:
    """Maximise ``criterion(λ)`` over ``log λ`` in ``bounds`` (grid, then bounded Brent).

    Args:
        criterion: ``λ -> value`` to maximise (finite floats; a non-finite value is an error).
        method: what the criterion is (recorded; the validation criterion is minus the NLL).
        bounds: ``(lower, upper)``, ``0 < lower < upper``.
        points_per_decade: coarse-grid density (at least 1).
        refine: run Brent between the grid neighbours of the best grid point.
        xatol: Brent's tolerance on ``log λ``.

    Raises:
        InvalidInputError: bad bounds or grid density. NumericalError: a non-finite criterion.
    """
    lower, upper = check_bounds(bounds)
    if points_per_decade < 1:
        raise InvalidInputError(f"points_per_decade must be at least 1; got {points_per_decade}.")
    log_lo, log_hi = math.log(lower), math.log(upper)
    count = max(2, round(points_per_decade * (log_hi - log_lo) / math.log(10)) + 1)
    log_grid = np.linspace(log_lo, log_hi, count)
    log_grid[0], log_grid[-1] = log_lo, log_hi  # exact ends (precision() maps them back)
    values: dict[float, float] = {}

    def precision(log_value: float) -> float:  # the ends exactly, not exp(log(end))
        return lower if log_value == log_lo else upper if log_value == log_hi else math.exp(
            log_value)

    def evaluate(log_value: float) -> float:
        if log_value not in values:
            value = float(criterion(precision(log_value)))
            if not math.isfinite(value):
                raise NumericalError(
                    f"the {method.value} criterion is {value} at prior precision "
                    f"{precision(log_value):.4g}; narrow prior_precision_bounds.")
            values[log_value] = value
        return values[log_value]

    grid_values = [evaluate(float(x)) for x in log_grid]
    best = int(np.argmax(grid_values))
    log_best, value_best = float(log_grid[best]), grid_values[best]
    if refine:
        a, b = float(log_grid[max(best - 1, 0)]), float(log_grid[min(best + 1, count - 1)])
        result = scipy.optimize.minimize_scalar(lambda x: -evaluate(float(x)), bounds=(a, b),
                                                method="bounded", options={"xatol": xatol})
        if -float(result.fun) > value_best:
            log_best, value_best = float(result.x), -float(result.fun)
    at_bound = None
    if log_best - log_lo <= 2 * xatol:
        at_bound = "lower"
    elif log_hi - log_best <= 2 * xatol:
        at_bound = "upper"
    sign = 1.0 if method is PriorPrecisionMethod.MARGLIK else -1.0
    return PriorPrecisionChoice(
        method=method.value, value=precision(log_best), criterion=sign * value_best,
        bounds=(lower, upper), at_bound=at_bound, evaluations=len(values),
        grid=tuple((precision(float(x)), sign * v) for x, v in zip(log_grid, grid_values,
                                                                     strict=True)),
    )
