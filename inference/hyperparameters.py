"""Choosing a scalar hyperparameter from the data: the bounded search over its log, and its record.

A head supplies ``criterion(value)`` — the Laplace head its log evidence ``log p(y | X, λ)``
over the prior precision ``λ`` (maximised) or its validation NLL (minimised), the conjugate
head its conditional NLL over the feature scale — and `search_log_space` optimises it
over ``log value`` in a bounded interval:

1. a coarse grid, ``points_per_decade`` points a decade over ``[lower, upper]`` (ends included),
   finds the best cell; a smooth unimodal criterion has its optimiser in the two cells around
   the best grid point;
2. bounded Brent (``scipy.optimize.minimize_scalar(method="bounded")``) on those two cells to
   ``xatol`` in ``log value`` (skipped with ``refine=False``: a grid search, as laplace-torch's
   ``gridsearch`` of the prior precision).

The result, a `HyperparameterChoice`, says which value won, by what criterion value, and
whether it sits at an end of the interval (then the optimum may lie beyond it: widen the
bounds, or read it as a sign that the model does not fit the data at any value in them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inference.errors import InvalidInputError, NumericalError

#: Default search interval, laplace-torch's ``optimize_prior_precision`` grid (1e-4 .. 1e4).
DEFAULT_BOUNDS = (1e-4, 1e4)
#: Brent's absolute tolerance on ``log value``: the value to a relative 1e-6, far below any
#: effect on the posterior (a smooth criterion is flat to second order there: ~κ·1e-12 off).
LOG_XATOL = 1e-6


@dataclass(frozen=True)
class HyperparameterChoice:
    """A chosen hyperparameter and how it was found.

    Attributes:
        name: what was chosen (``"prior_precision"``, ``"feature_scale"``).
        method: the criterion's method name (``"marglik"``, ``"validation"``, ...).
        value: the chosen value (> 0).
        criterion_name: what ``criterion`` is (``"log_evidence"`` in nats, ``"validation_nll"``
            / ``"training_nll"`` in nats per point).
        criterion: its value at ``value``.
        maximised: whether larger ``criterion`` is better.
        bounds: the search interval ``(lower, upper)``.
        at_bound: ``"lower"`` or ``"upper"`` when ``value`` is (within the tolerance) an end
            of the interval, else ``None``.
        evaluations: criterion evaluations.
        grid: ``(value, criterion)`` pairs of the coarse grid, for plots and checks.
    """

    name: str
    method: str
    value: float
    criterion_name: str
    criterion: float
    maximised: bool
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
        return {"method": self.method, self.name: self.value,
                self.criterion_name: self.criterion, "bounds": list(self.bounds),
                "at_bound": self.at_bound, "evaluations": self.evaluations}


def check_bounds(bounds: tuple[float, float], name: str) -> tuple[float, float]:
    """``bounds`` as floats if ``0 < lower < upper < inf``; else `InvalidInputError`."""
    try:
        lower, upper = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name} must be a pair (lower, upper); got {bounds!r}.") from None
    if not (0 < lower < upper < math.inf):
        raise InvalidInputError(f"{name} must satisfy 0 < lower < upper < inf; got {bounds!r}.")
    return lower, upper


@dataclass(frozen=True)
class Criterion:
    """What `search_log_space` optimises: ``function(value) -> float``, its name, the
    method it belongs to, and whether it is maximised (an evidence) or minimised (an NLL)."""

    function: Callable[[float], float]
    name: str
    method: str
    maximise: bool


def search_log_space(
    criterion: Criterion,
    name: str,
    bounds: tuple[float, float] = DEFAULT_BOUNDS,
    points_per_decade: int = 1,
    refine: bool = True,
    xatol: float = LOG_XATOL,
) -> HyperparameterChoice:
    """Optimise ``criterion`` over ``log value`` in ``bounds`` (grid, then bounded Brent).

    Args:
        criterion: the function of the hyperparameter to optimise (finite floats).
        name: the hyperparameter's name (recorded; used in messages).
        bounds: ``(lower, upper)``, ``0 < lower < upper``.
        points_per_decade: coarse-grid density (at least 1).
        refine: run Brent between the grid neighbours of the best grid point.
        xatol: Brent's tolerance on ``log value``.

    Raises:
        InvalidInputError: bad bounds or grid density. NumericalError: a non-finite criterion.
    """
    lower, upper = check_bounds(bounds, f"{name}_bounds")
    if points_per_decade < 1:
        raise InvalidInputError(f"points_per_decade must be at least 1; got {points_per_decade}.")
    sign = 1.0 if criterion.maximise else -1.0
    log_lo, log_hi = math.log(lower), math.log(upper)
    count = max(2, round(points_per_decade * (log_hi - log_lo) / math.log(10)) + 1)
    log_grid = np.linspace(log_lo, log_hi, count)
    log_grid[0], log_grid[-1] = log_lo, log_hi  # exact ends (value() maps them back)
    scores: dict[float, float] = {}  # sign * criterion: always maximised

    def value(log_value: float) -> float:  # the ends exactly, not exp(log(end))
        return lower if log_value == log_lo else upper if log_value == log_hi else math.exp(
            log_value)

    def score(log_value: float) -> float:
        if log_value not in scores:
            result = float(criterion.function(value(log_value)))
            if not math.isfinite(result):
                raise NumericalError(
                    f"the {criterion.method} criterion is {result} at {name} = "
                    f"{value(log_value):.4g}; narrow {name}_bounds.")
            scores[log_value] = sign * result
        return scores[log_value]

    grid_scores = [score(float(x)) for x in log_grid]
    best = int(np.argmax(grid_scores))
    log_best, score_best = float(log_grid[best]), grid_scores[best]
    if refine:
        import scipy.optimize  # here: 0.5 s of import that most callers of inference never need

        a, b = float(log_grid[max(best - 1, 0)]), float(log_grid[min(best + 1, count - 1)])
        result = scipy.optimize.minimize_scalar(lambda x: -score(float(x)), bounds=(a, b),
                                                method="bounded", options={"xatol": xatol})
        if -float(result.fun) > score_best:
            log_best, score_best = float(result.x), -float(result.fun)
    at_bound = None
    if log_best - log_lo <= 2 * xatol:
        at_bound = "lower"
    elif log_hi - log_best <= 2 * xatol:
        at_bound = "upper"
    return HyperparameterChoice(
        name=name, method=criterion.method, value=value(log_best),
        criterion_name=criterion.name, criterion=sign * score_best,
        maximised=criterion.maximise, bounds=(lower, upper), at_bound=at_bound,
        evaluations=len(scores),
        grid=tuple((value(float(x)), sign * s) for x, s in zip(log_grid, grid_scores,
                                                                strict=True)),
    )
