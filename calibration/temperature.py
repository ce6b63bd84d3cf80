"""Temperature scaling (Guo et al., 2017): one scalar T > 0 fitted by NLL on held-out data.

The calibrated predictive is ``softmax(z / T)`` for logits ``z`` (N, K). For *probabilities*
``p`` the same family is ``softmax(log p / T)``, i.e. ``p^(1/T)`` renormalised per row; log p is
taken as ``log max(p, 1e-12)`` (`calibration.row_scores.PROBABILITY_FLOOR`, the floor
the NLL metric uses), so an exact zero cannot make the NLL infinite at every T.

**The optimisation is exact and one-dimensional.** With ``s = log T`` and ``u = z e^{-s}`` a
sample's NLL is ``l(s) = logsumexp(u) - u_y``, and with ``p = softmax(u)``

    dl/ds   = u_y - E_p[u]
    d2l/ds2 = Var_p(u) - (u_y - E_p[u]).

``l`` is convex in ``beta = 1/T`` (a log-sum-exp minus a linear term), so ``dl/ds`` (equal to
``-beta dl/dbeta``) changes sign at most once: the summed NLL is unimodal in ``s`` and its
minimiser is bracketed by any two points with derivatives of opposite sign. It is *not* convex
in ``s``, so Newton steps are safeguarded: `temperature_search` keeps a bracket, takes
the Newton step when it lands inside and shrinks fast enough, and bisects otherwise
(Numerical Recipes' ``rtsafe``), until the step falls to machine precision.

**The search is a protocol, not a loop over data.** It only ever sees the *summed* triple
(NLL, dNLL/ds, d2NLL/ds2) at the ``s`` it proposes (`NLLDerivatives`). Centrally the
triple comes from `nll_derivatives` of all the data; federated, every client computes it
on its own held-out data and the server adds them up. Both follow the same path of proposals,
so federated and centralised temperatures agree to float rounding.

**Bounds.** T is searched in ``bounds`` (default `TEMPERATURE_BOUNDS` = [0.01, 100]).
Perfectly separable data have no finite optimum (the NLL keeps falling as T -> 0); such a fit
stops at the lower bound and says so (``TemperatureFit.at_bound == "lower"``, and
`fit_temperature` warns with `TemperatureAtBoundWarning`). Rows whose logits are
all equal carry no information about T; when every row is like that the NLL is flat, T = 1 is
returned and ``TemperatureFit.flat`` is set.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.errors import CalibrationError, InvalidInputError
from calibration.inputs import class_labels, score_matrix
from calibration.metrics import evaluate
from calibration.row_scores import PROBABILITY_FLOOR, row_scores

TEMPERATURE_BOUNDS = (1e-2, 1e2)
"""Default search range of T: a temperature outside it means the scores are so far from
calibrated (or the data so separable) that the number is no longer a meaningful correction."""

MAX_ITERATIONS = 200
"""Objective evaluations allowed per search; bisection alone reaches machine precision on the
default range in about 60, safeguarded Newton typically needs 5-8."""

_EPS = torch.finfo(torch.float64).eps
_STEP_TOLERANCE = 4 * _EPS  # relative to max(1, |s|): a step the float64 grid cannot resolve
_NOISE_FLOOR = math.sqrt(_EPS)  # below this, a Newton step that stops shrinking is rounding


class TemperatureAtBoundWarning(RuntimeWarning):
    """The fitted temperature hit a bound of its search range (e.g. separable data, T -> 0)."""


@dataclass(frozen=True)
class NLLDerivatives:
    """Summed NLL of temperature-scaled scores and its derivatives w.r.t. ``s = log T``.

    Attributes:
        log_temperature: the ``s`` they were computed at.
        nll_sum: sum over samples of ``-log softmax(z / T)_y``, nats.
        d1: its first derivative w.r.t. ``s``.
        d2: its second derivative w.r.t. ``s``.
        count: number of samples summed.

    This is all a federated client reveals about its data; parts add with ``+``.
    """

    log_temperature: float
    nll_sum: float
    d1: float
    d2: float
    count: int

    def __add__(self, other: NLLDerivatives) -> NLLDerivatives:
        if not isinstance(other, NLLDerivatives):
            return NotImplemented
        if other.log_temperature != self.log_temperature:
            raise InvalidInputError(
                "cannot add NLL derivatives taken at different temperatures "
                f"(log T = {self.log_temperature!r} and {other.log_temperature!r})")
        return NLLDerivatives(self.log_temperature, self.nll_sum + other.nll_sum,
                              self.d1 + other.d1, self.d2 + other.d2, self.count + other.count)


@dataclass(frozen=True)
class TemperatureFit:
    """The result of a temperature search.

    Attributes:
        temperature: the fitted T (> 0).
        log_temperature: ``log T``.
        nll: mean NLL per sample at T (nats).
        nll_at_one: mean NLL at T = 1 (the uncalibrated scores), or None when the search
            did not evaluate T = 1 (it does whenever 1 lies in the bounds).
        d1: summed derivative dNLL/d log T at T (about 0 at an interior optimum).
        count: number of samples.
        evaluations: objective evaluations (federated: communication rounds).
        at_bound: ``"lower"`` / ``"upper"`` when the optimum lies at or beyond that bound of
            ``bounds``, else None.
        flat: the NLL does not depend on T (every row's scores are constant); T = 1.
        bounds: the search range of T.
    """

    temperature: float
    log_temperature: float
    nll: float
    nll_at_one: float | None
    d1: float
    count: int
    evaluations: int
    at_bound: str | None
    flat: bool
    bounds: tuple[float, float]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["bounds"] = list(self.bounds)
        return out


# ---- client side: the scalar triple ----------------------------------------------------------
def log_scores(scores: Any, labels: Any, *, from_logits: bool) -> tuple[Tensor, Tensor]:
    """Validated float64 log-scores (N, K) and int64 labels (N,) to temperature-scale.

    Logits are returned as they are (finite); probabilities as ``log max(p, 1e-12)``.
    """
    if not isinstance(from_logits, bool | np.bool_):
        raise InvalidInputError(f"from_logits must be True or False, got {from_logits!r} "
                                "(the kind of scores is stated, never guessed)")
    from_logits = bool(from_logits)
    row_scores(scores, labels, from_logits=from_logits, confidence=False)  # full validation
    matrix = score_matrix(scores, "logits" if from_logits else "probs").to(torch.float64)
    label_index = class_labels(labels, matrix.shape[0], matrix.shape[1], matrix.device)
    if not from_logits:
        matrix = matrix.clamp(min=PROBABILITY_FLOOR).log()
    return matrix, label_index


def check_log_temperature(log_temperature: float) -> float:
    """``log_temperature`` as a finite float, else InvalidInputError."""
    if isinstance(log_temperature, bool) or not isinstance(log_temperature, int | float):
        raise InvalidInputError(f"log_temperature must be a real number, got {log_temperature!r}")
    if not math.isfinite(log_temperature):
        raise InvalidInputError(f"log_temperature must be finite, got {log_temperature!r}")
    return float(log_temperature)


def nll_derivatives_of_log_scores(
    log_scores_: Tensor, labels: Tensor, log_temperature: float
) -> NLLDerivatives:
    """`nll_derivatives` of already validated float64 log-scores (N, K), labels (N,)."""
    s = check_log_temperature(log_temperature)
    u = log_scores_ * math.exp(-s)
    u = u - u.amax(dim=1, keepdim=True)  # shift-invariant; keeps exp() in range
    log_normaliser = torch.logsumexp(u, dim=1)
    p = torch.exp(u - log_normaliser[:, None])
    mean_u = (p * u).sum(dim=1)
    label_u = u.gather(1, labels[:, None]).squeeze(1)
    margin = label_u - mean_u  # per-sample dl/ds
    variance = (p * (u - mean_u[:, None]).square()).sum(dim=1)
    return NLLDerivatives(
        log_temperature=s,
        nll_sum=float((log_normaliser - label_u).sum()),
        d1=float(margin.sum()),
        d2=float((variance - margin).sum()),
        count=int(labels.shape[0]),
    )


def nll_derivatives(
    scores: Any, labels: Any, log_temperature: float, *, from_logits: bool
) -> NLLDerivatives:
    """Summed NLL of ``softmax(log-scores / T)`` and its first two derivatives w.r.t. log T.

    Args:
        scores: (N, K) logits (``from_logits=True``) or probabilities, tensor or numpy.
        labels: (N,) integer class indices.
        log_temperature: ``s = log T`` at which to evaluate.

    The client half of federated temperature scaling: these four numbers are all it sends.
    """
    matrix, label_index = log_scores(scores, labels, from_logits=from_logits)
    return nll_derivatives_of_log_scores(matrix, label_index, log_temperature)


# ---- server side: the search -------------------------------------------------------------
def check_bounds(bounds: tuple[float, float]) -> tuple[float, float]:
    """``bounds`` as (low, high) floats with 0 < low < high < inf, else InvalidInputError."""
    try:
        low, high = (float(b) for b in bounds)
    except (TypeError, ValueError):
        raise InvalidInputError(f"bounds must be a pair (low, high) of temperatures, got "
                                f"{bounds!r}") from None
    if not (0.0 < low < high < math.inf):
        raise InvalidInputError(f"temperature bounds must satisfy 0 < low < high < inf, got "
                                f"({low}, {high})")
    return low, high


SearchProtocol = Generator[float, NLLDerivatives, TemperatureFit]


def temperature_search(
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    *,
    max_iterations: int = MAX_ITERATIONS,
) -> SearchProtocol:
    """The server side of temperature scaling as a generator protocol.

    It yields a proposed ``s = log T``; send it the *summed* `NLLDerivatives` at that
    ``s``; when done it raises ``StopIteration`` whose ``value`` is the `TemperatureFit`
    (`minimize_temperature` drives it from a callable)::

        search = temperature_search()
        s = next(search)
        while True:
            try:
                s = search.send(total_nll_derivatives_at(s))
            except StopIteration as done:
                fit = done.value
                break

    Raises (from ``send``):
        InvalidInputError: a triple for another ``s``, without samples, or not finite.
        CalibrationError: no convergence within ``max_iterations`` evaluations.
    """
    low, high = check_bounds(bounds)
    lo, hi = math.log(low), math.log(high)
    search = _Search(lo, hi, (low, high))
    s = min(max(0.0, lo), hi)  # T = 1: the uncalibrated scores
    for _ in range(max_iterations):
        point = yield s
        search.observe(s, point)
        outcome = search.next_point(s, point)
        if isinstance(outcome, TemperatureFit):
            return outcome
        s = outcome
    raise CalibrationError(f"temperature search did not converge in {max_iterations} "
                           "evaluations; the objective may not be a sum of NLL terms")


class _Search:
    """State of one safeguarded Newton search over s = log T (see the module docstring)."""

    def __init__(self, lo: float, hi: float, bounds: tuple[float, float]) -> None:
        self.lo, self.hi, self.bounds = lo, hi, bounds
        self.a, self.b = lo, hi          # the minimiser lies in [a, b]
        self.a_seen = self.b_seen = False  # whether a / b were evaluated (else a bare bound)
        self.step_before_last = hi - lo
        self.last_step = hi - lo
        self.last_newton: float | None = None
        self.evaluations = 0
        self.count: int | None = None
        self.nll_at_one: float | None = None
        self.flat_below: NLLDerivatives | None = None  # a flat point seen below the upper bound

    def observe(self, s: float, point: NLLDerivatives) -> None:
        if not isinstance(point, NLLDerivatives):
            raise InvalidInputError(f"send NLLDerivatives to the search, got {type(point)}")
        if point.log_temperature != s:
            raise InvalidInputError(f"the search proposed log T = {s!r} but received "
                                    f"derivatives at {point.log_temperature!r}")
        if point.count < 1:
            raise InvalidInputError("cannot fit a temperature without samples (count 0)")
        if self.count is not None and point.count != self.count:
            raise InvalidInputError(f"the number of samples changed during the search "
                                    f"({self.count} -> {point.count}); restart it")
        values = (point.nll_sum, point.d1, point.d2)
        if not all(math.isfinite(v) for v in values):
            raise InvalidInputError(f"NLL derivatives must be finite, got {values}")
        self.count = point.count
        self.evaluations += 1
        if s == 0.0:
            self.nll_at_one = point.nll_sum / point.count

    def fit(self, s: float, point: NLLDerivatives, at_bound: str | None = None,
            flat: bool = False) -> TemperatureFit:
        temperature = {"lower": self.bounds[0], "upper": self.bounds[1]}.get(
            at_bound, math.exp(s))  # a bound exactly as given, not exp(log(bound))
        return TemperatureFit(
            temperature=temperature, log_temperature=s, nll=point.nll_sum / point.count,
            nll_at_one=self.nll_at_one, d1=point.d1, count=point.count,
            evaluations=self.evaluations, at_bound=at_bound, flat=flat, bounds=self.bounds)

    def next_point(self, s: float, point: NLLDerivatives) -> float | TemperatureFit:
        """The next ``s`` to evaluate, or the fit when converged."""
        g, h = point.d1, point.d2
        if g == 0.0 and h == 0.0:
            return self._flat_point(s, point)
        if self.flat_below is not None:  # flat below, rising at the upper bound
            return self._lower_bound_of_flat()
        if g == 0.0:
            return self.fit(s, point)  # an exact stationary point: the unique minimiser
        if g > 0.0:
            self.b, self.b_seen = s, True
            if s == self.lo:
                return self.fit(s, point, at_bound="lower")
        else:
            self.a, self.a_seen = s, True
            if s == self.hi:
                return self.fit(s, point, at_bound="upper")
        scale = max(1.0, abs(s))
        if self.b - self.a <= _STEP_TOLERANCE * scale:
            return self.fit(s, point)
        if h > 0.0 and abs(g / h) <= _STEP_TOLERANCE * scale:
            return self.fit(s, point)  # Newton's step is below float64's resolution of s
        previous_newton = self.last_newton
        proposal = self._safeguarded_newton(s, g, h)
        step = proposal - s
        # Newton converges quadratically until rounding in the summed derivative takes over;
        # a tiny Newton step that no longer shrinks is that noise floor: s is as good as it gets.
        stalled = (self.last_newton is not None and previous_newton is not None
                   and abs(step) <= _NOISE_FLOOR * scale
                   and abs(step) >= 0.5 * abs(previous_newton))
        if abs(step) <= _STEP_TOLERANCE * scale or stalled:
            return self.fit(s, point)
        self.step_before_last, self.last_step = self.last_step, step
        return proposal

    def _safeguarded_newton(self, s: float, g: float, h: float) -> float:
        """Newton's step when it lands inside the bracket and shrinks fast enough; else the
        unevaluated bound on the downhill side (the optimum may lie beyond it), else the
        bracket's midpoint."""
        if h > 0.0:
            newton = s - g / h
            fast = abs(2.0 * g) <= abs(self.step_before_last * h)
            if self.a < newton < self.b and fast:
                self.last_newton = newton - s
                return newton
        self.last_newton = None
        if g > 0.0 and not self.a_seen:
            return self.a
        if g < 0.0 and not self.b_seen:
            return self.b
        return 0.5 * (self.a + self.b)

    def _flat_point(self, s: float, point: NLLDerivatives) -> float | TemperatureFit:
        """Zero derivative and curvature at s: every row is constant or (numerically) certain
        of its label. Certain rows stay certain at lower T and constant rows never change, so
        the NLL is minimal on all of [lo, s]. If it is flat at the upper bound too it is flat
        everywhere (T = 1, ``flat``); otherwise it rises above s and the fit is the lower
        bound, where the NLL equals its value at s. One evaluation at the upper bound tells."""
        if s == self.hi:
            return self._flat_fit(point)
        self.flat_below = point
        return self.hi

    def _lower_bound_of_flat(self) -> TemperatureFit:
        point = self.flat_below
        return TemperatureFit(
            temperature=self.bounds[0], log_temperature=self.lo,
            nll=point.nll_sum / point.count, nll_at_one=self.nll_at_one, d1=0.0,
            count=point.count, evaluations=self.evaluations, at_bound="lower", flat=False,
            bounds=self.bounds)

    def _flat_fit(self, point: NLLDerivatives) -> TemperatureFit:
        s = min(max(0.0, self.lo), self.hi)  # T = 1 unless the bounds exclude it
        return TemperatureFit(
            temperature=math.exp(s), log_temperature=s, nll=point.nll_sum / point.count,
            nll_at_one=point.nll_sum / point.count, d1=0.0, count=point.count,
            evaluations=self.evaluations, at_bound=None, flat=True, bounds=self.bounds)


def minimize_temperature(
    objective: Callable[[float], NLLDerivatives],
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
    *,
    max_iterations: int = MAX_ITERATIONS,
) -> TemperatureFit:
    """Drive `temperature_search` with ``objective(s) -> summed NLLDerivatives at s``."""
    search = temperature_search(bounds, max_iterations=max_iterations)
    s = next(search)
    while True:
        try:
            s = search.send(objective(s))
        except StopIteration as done:
            return done.value


# ---- centralised use -------------------------------------------------------------------------
def fit_temperature(
    scores: Any,
    labels: Any,
    *,
    from_logits: bool,
    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
) -> TemperatureFit:
    """Fit T by minimising the NLL of ``softmax(log-scores / T)`` on held-out data.

    Args:
        scores: (N, K) held-out logits (``from_logits=True``) or probabilities (False), a
            torch tensor (any device) or numpy array.
        labels: (N,) integer class indices.
        bounds: search range of T.

    Warns:
        TemperatureAtBoundWarning: the optimum lies at or beyond a bound (separable data).
    """
    matrix, label_index = log_scores(scores, labels, from_logits=from_logits)
    fit = minimize_temperature(
        lambda s: nll_derivatives_of_log_scores(matrix, label_index, s), bounds)
    if fit.at_bound is not None:
        warnings.warn(bound_message(fit), TemperatureAtBoundWarning, stacklevel=2)
    return fit


def bound_message(fit: TemperatureFit) -> str:
    """What a fit at a bound means and what to do about it."""
    why = ("the held-out data are perfectly separated by the scores, so the NLL keeps falling "
           "as T -> 0" if fit.at_bound == "lower" else
           "the scores rank the labels no better than chance, so the NLL keeps falling as "
           "T -> infinity (towards the uniform prediction)")
    return (f"the fitted temperature {fit.temperature:g} is at the {fit.at_bound} bound of "
            f"{fit.bounds}: {why}; use more (or harder) held-out data, check the scores, or "
            "widen `bounds`")


def apply_temperature(scores: Any, temperature: float, *, from_logits: bool) -> Tensor:
    """Temperature-scaled probabilities (N, K) float64: ``softmax(log-scores / T)``.

    For probabilities this is ``p^(1/T)`` renormalised (with ``log max(p, 1e-12)``); T = 1
    returns the inputs (up to that floor and rounding).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
            or not (0.0 < float(temperature) < math.inf):
        raise InvalidInputError(f"temperature must be a finite number > 0, got {temperature!r}")
    matrix = score_matrix(scores, "logits" if from_logits else "probs")
    # the same checks as every metric (finite logits; probabilities >= 0 with rows summing to
    # 1); the labels are placeholders, nothing here depends on them
    placeholder = torch.zeros(matrix.shape[0], dtype=torch.int64, device=matrix.device)
    matrix, _ = log_scores(matrix, placeholder, from_logits=from_logits)
    return torch.softmax(matrix / float(temperature), dim=1)


@dataclass(frozen=True)
class TemperatureReport:
    """Metrics before and after temperature scaling on one data set.

    Attributes:
        temperature: the T applied.
        before: `calibration.evaluate` of the scores as given (accuracy, ece, mce,
            brier, nll, count).
        after: the same for the temperature-scaled probabilities.
        fit: the fit T came from, when one was given.
    """

    temperature: float
    before: dict[str, float]
    after: dict[str, float]
    fit: TemperatureFit | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature,
                "fit": None if self.fit is None else self.fit.to_dict(),
                "before": dict(self.before), "after": dict(self.after)}


def temperature_report(
    fit: TemperatureFit | float,
    scores: Any,
    labels: Any,
    *,
    from_logits: bool,
    n_bins: int = 15,
) -> TemperatureReport:
    """Before/after ECE, NLL, Brier (and accuracy, which T does not change) of ``scores``.

    ``fit`` is a `TemperatureFit` (typically from held-out data, while ``scores`` (N, K)
    and ``labels`` (N,) are test data) or a bare temperature.
    """
    temperature = fit.temperature if isinstance(fit, TemperatureFit) else fit
    scaled = apply_temperature(scores, temperature, from_logits=from_logits)
    before = evaluate(scores, labels, n_bins=n_bins, from_logits=from_logits)
    after = evaluate(scaled, labels, n_bins=n_bins)
    return TemperatureReport(float(temperature), before, after,
                             fit if isinstance(fit, TemperatureFit) else None)


__all__ = [
    "MAX_ITERATIONS",
    "TEMPERATURE_BOUNDS",
    "NLLDerivatives",
    "TemperatureAtBoundWarning",
    "TemperatureFit",
    "TemperatureReport",
    "apply_temperature",
    "fit_temperature",
    "minimize_temperature",
    "nll_derivatives",
    "temperature_report",
    "temperature_search",
]
