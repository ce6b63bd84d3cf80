"""The prior precision of a full-covariance Laplace head by its evidence, in a handful of mode
refits: safeguarded Newton on the exact derivative of the refitted Laplace evidence.

What is maximised. The Laplace log evidence of a head with prior ``N(μ₀, I/λ)``, evaluated at
that prior's own mode ``W(λ)`` (the criterion of ``prior_precision="marglik"``; see
[`inference.laplace_head.fit_laplace_head`][inference.laplace_head.fit_laplace_head]):

    E(λ) = log p(y | W) − λ/2 ‖W − μ₀‖² + d/2 log λ − ½ log|λI + H(W)|,     W = W(λ).

Its derivative. ``W`` is a stationary point of the first two terms, so they contribute only
their explicit dependence on ``λ``; the log determinant depends on ``λ`` also through the mode,
``W' = dW/dλ = −Σ (W − μ₀)`` with ``Σ = (λI + H)⁻¹``:

    dE/dλ = ½ [ d/λ − ‖W − μ₀‖² − tr Σ − tr(Σ DH[W']) ].

For a softmax likelihood ``H(W) = Σ_n B_n ⊗ x_n x_nᵀ`` with ``B_n = diag p_n − p_n p_nᵀ``, and
``tr(Σ DH[v]) = Σ_n ⟨dB_n, S_n⟩`` where ``S_n`` is point ``n``'s ``C × C`` logit covariance
under ``Σ``, ``dp_n = B_n u_n`` with ``u_n = V x_n`` the logit change, and ``dB_n = diag dp_n −
dp_n p_nᵀ − p_n dp_nᵀ``: ``O(N C² (m + 1)²)`` once ``Σ`` is known. A Gaussian likelihood has a
constant ``H`` and no third term. (Dropping it gives MacKay's fixed point ``λ = γ / ‖W − μ₀‖²``,
which is near but not at the maximiser; keeping it makes the search land on the same ``λ`` as a
fine search of ``E``, which the tests check.)

The default search (`EvidenceSearch.search_secant`, issue 41): the secant method on a
residual whose root is the slope's (a softmax head's: MacKay's update of ``t = log λ`` minus
``t``, close to linear in ``t``; a Gaussian likelihood's: the exact slope); bracketed, Brent's
inverse quadratic step; a softmax head's search returns the last refitted point once the step
to its next proposal is below `LAMBDA_RTOL` (relative), a Gaussian likelihood's refits at
the proposal once that proposal's error is estimated below `EXACT_LAMBDA_RTOL`. At the S1 size
it takes 3-4 refits (4-5 on the slope's secant with a last refit at the proposal), against
10-12 refits and 33-44 Newton iterations of the search below, which remains its fallback. A softmax
head's refits find the mode by matrix-free Newton-CG (`newton_cg`: curvature-vector
products, a Kronecker preconditioner), and one exact Newton step then confirms it with the
factorisation the evidence needs: one factorisation and one curvature per refit (6 and 6 at the
S1 size, against 16 of each), the same λ to ~1e-8. A Gaussian likelihood's refits take chord
steps on the previous refit's ``Σ`` (``O(d²)`` each; ``EvidenceSearch._chord``) instead.

The former search (`EvidenceSearch.search`). Newton steps in ``t = log λ`` use the exact
first derivative and the second
derivative of the fixed-curvature evidence, ``½[−d/λ² + 2 (W − μ₀)ᵀ Σ (W − μ₀) + tr Σ²]``
(the third-order terms dropped: they are small, and only the speed of convergence depends on
them, not where it ends). The steps are safeguarded by the bracket in which the derivative
changes sign (bisection when a step leaves it), and the search ends at a bound when the
derivative there points out of the interval. Each step refits the mode by Newton, warm-started
from the first-order prediction ``W + W' Δλ``; at the S1 size (250 rows, 1,010 parameters)
the whole search takes 4-6 refits of one or two Newton iterations each, against the ~20 refits
of the grid-and-Brent search it replaces (`inference.hyperparameters.search_log_space`
remains the search of the diagonal and low-rank structures, and the fallback here).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.errors import NumericalError
from inference.gaussian import solve_with_factor
from inference.head_objective import (
    laplace_precision,
    logit_covariance,
    negative_log_posterior,
)
from inference.hyperparameters import LOG_XATOL, HyperparameterChoice
from inference.options import Likelihood

#: Newton steps in ``log λ`` at most before the search gives up (the caller falls back to the
#: grid-and-Brent search).
MAX_STEPS = 40
#: Half the squared Newton decrement of the mode at which it counts as found, nats (as
#: `inference.laplace_head.find_mode`).
MODE_TOL = 1e-12
#: The evidence gain (nats) a further step may promise at most when the search ends: well
#: below what any use of λ resolves, and 10x below the tests' 1e-9 nats.
GAIN_TOL = 1e-10
#: Secant steps shorter than this (in ``log λ``) are taken whatever MacKay's update says: near
#: the maximiser the secant converges superlinearly and MacKay's update only linearly (by a
#: factor ~0.4 a step where the evidence is flat, e.g. a Gaussian likelihood with λ ≈ 18).
SECANT_FREE = 0.1
#: The largest step in ``log λ`` (e-folds) of one iteration of the search.
MAX_STEP = 2.0
#: Half the squared Newton decrement below which Newton takes full steps (nats; the quadratic
#: regime).
NEAR_MODE = 1e-4
#: A softmax head's `EvidenceSearch.search_secant` returns its last refitted point once the
#: step to its next proposal, which estimates that point's error (the secant converges
#: superlinearly), is below this (relative in λ); failing that, once the next proposal's own
#: error is estimated below it (the step, or bracketed the gap between the secant's root and
#: the inverse quadratic interpolant's), it refits there and returns that. The λ returned is
#: within ~1e-2 of the maximiser (S1's ten heads: 0-0.6% from the former search's ~1e-3;
#: the 250-3,000-row bench heads 0.04-0.05%), without the last refit and with the point's
#: inverse and logit covariances handed on to the KL-optimal Gaussian (issue 41: S1's ten heads
#: 4.15 -> 3.72 CPU-s). A full 1e-2 off loses ½ |d²E/d(log λ)²| · 1e-4 ≤ 1e-3 nats of evidence
#: (|d²E/d(log λ)²| ≈ 2 at S1's heads' maximisers, up to ~20 at the bench heads': the
#: evidence's own width in log λ, 1/sqrt|d²E/d(log λ)²|, is 0.2-0.7) and moves the held-out
#: NLL of the default head by < 0.05% (bench heads: ≤ 2e-5 relative, measured).
LAMBDA_RTOL = 1e-2
#: The same for a Gaussian likelihood, whose evidence is exact and refits cheap (no curvature
#: changes with the mode): the maximiser of the closed-form evidence to ~1e-6 in log λ.
EXACT_LAMBDA_RTOL = 1e-3
#: Mode refits at most of `EvidenceSearch.search_secant`.
MAX_REFITS = 12
#: Half the squared Newton decrement (nats) of a Gaussian likelihood's refits in
#: `EvidenceSearch.search_secant` while its steps are long (it tightens with the step, to
#: `MODE_TOL` at the point it returns; a softmax head's refits all reach `MODE_TOL`).
LOOSE_MODE_TOL = 1e-3
#: The first step of `EvidenceSearch.search_secant` (uphill), e-folds of λ.
FIRST_STEP = 1.0
#: Chord steps at most before each refit's Newton steps (`EvidenceSearch._chord`), and
#: the factor by which each must shrink the predicted gain of the next to go on.
CHORD_STEPS, CHORD_RATE = 10, 0.3
#: Newton-CG (`newton_cg`): conjugate-gradient iterations at most per
#: Newton step, and the floor of the solves' relative residual (the forcing term is
#: ``min(0.5, sqrt(decrement))`` above it: superlinear convergence, and a decrement estimate
#: accurate to that relative error where the search tests it against the tolerance).
CG_MAX_ITER, CG_RTOL_FLOOR = 500, 1e-10


@dataclass
class _Point:
    """The mode at one ``λ`` with what the derivative needs."""

    log_precision: float
    mode: Tensor          # (d,), the mode W(λ)
    covariance: Tensor    # (d, d), Σ = (λI + H)⁻¹ at the mode (its factor if no slope)
    evidence: float       # E(λ), nats
    slope: float          # dE/dt, t = log λ
    mackay: float         # log of MacKay's fixed-point update of λ from this point
    logit_covariance: Tensor | None = None  # (N, C, C) under Σ (softmax, with a slope)


@dataclass
class LastPrecision:
    """The precision ``λI + H`` of the last refit, at its last Newton iterate (one step of
    half-squared decrement ≤ the refit's tolerance from the mode), and its lower Cholesky
    factor: a start for the KL-optimal Gaussian at the chosen ``λ`` that costs no further
    curvature or factorisation (issue 41)."""

    prior_precision: float
    precision: Tensor
    chol: Tensor
    # where the search ended on a point with a slope: its Σ = (λI + H)⁻¹ and every training
    # point's logit covariance under it, (N, C, C): the KL-optimal Gaussian's first precision
    # then costs no inverse and no logit covariances either
    covariance: Tensor | None = None
    logit_covariance: Tensor | None = None


class EvidenceSearch:
    """Maximise the refitted Laplace evidence of a full-covariance head over ``log λ``.

    Args:
        inputs: bias-augmented float64 features ``(N, m + 1)``.
        targets: int64 labels ``(N,)`` (or float64 reals, gaussian).
        num_classes: ``C``.
        prior_mean: ``μ₀``, a number or a flat ``(d,)`` float64 tensor.
        likelihood / noise_std: the observation model.
        max_iter: Newton iterations at most of one mode refit.
    """

    def __init__(self, inputs: Tensor, targets: Tensor, num_classes: int,
                 prior_mean: float | Tensor, likelihood: Likelihood, noise_std: float,
                 max_iter: int) -> None:
        self.inputs, self.targets, self.num_classes = inputs, targets, num_classes
        self.prior_mean, self.likelihood, self.noise_std = prior_mean, likelihood, noise_std
        self.max_iter = max_iter
        self.last_precision: LastPrecision | None = None
        self.dim = num_classes * inputs.shape[1]
        if likelihood is Likelihood.SOFTMAX:
            # what Newton-CG's Kronecker preconditioner needs of the data: XᵀX's eigenpairs
            self._gram = torch.linalg.eigh(inputs.T @ inputs)
            self._one_hot = torch.nn.functional.one_hot(targets, num_classes).to(torch.float64)

    # -- the objective and its derivatives ----------------------------------------------------

    def _objective(self, theta: Tensor, prior_precision: float) -> Tensor:
        return negative_log_posterior(theta, self.inputs, self.targets, self.num_classes,
                                      prior_precision, self.prior_mean, self.likelihood,
                                      self.noise_std)

    def _newton(self, theta: Tensor, prior_precision: float
                ) -> tuple[Tensor, Tensor, float, Tensor]:
        """At ``theta``: the Newton step, ``chol(λI + H(theta))``, half the squared Newton
        decrement (nats) and the precision ``λI + H(theta)`` itself."""
        theta_req = theta.detach().requires_grad_(True)
        value = self._objective(theta_req, prior_precision)
        (grad,) = torch.autograd.grad(value, theta_req)
        precision, chol = laplace_precision(theta, self.inputs, self.num_classes,
                                            prior_precision, self.likelihood, self.noise_std)
        step = solve_with_factor(chol, -grad[:, None])[:, 0]
        return step, chol, float(-(grad @ step)) / 2, precision

    def _damped(self, theta: Tensor, step: Tensor, decrement: float,
                prior_precision: float) -> Tensor:
        """``theta + t step`` with Armijo backtracking (``t`` halved from 1)."""
        t = 1.0
        with torch.no_grad():
            value = self._objective(theta, prior_precision)
            while (self._objective(theta + t * step, prior_precision)
                   > value - 0.5 * t * decrement and t > 1e-10):
                t *= 0.5
        return theta + t * step

    def _point(self, log_precision: float, mode: Tensor, chol: Tensor,
               slope: bool = True) -> _Point:
        """Evidence and slope at ``mode`` (the curvature ``chol`` taken one Newton step
        before it, within the mode tolerance at convergence); ``slope=False``: the evidence
        alone (no covariance; slope and MacKay's update NaN)."""
        lam = math.exp(log_precision)
        centred = mode - self.prior_mean
        sq_norm = float(centred @ centred)
        d = self.dim
        log_det = 2.0 * float(torch.log(chol.diagonal()).sum())
        with torch.no_grad():
            log_lik = -float(self._objective(mode, lam)) + 0.5 * lam * sq_norm
        evidence = log_lik - 0.5 * lam * sq_norm + 0.5 * d * math.log(lam) - 0.5 * log_det
        if not slope:
            return _Point(log_precision, mode, chol, evidence, math.nan, math.nan)
        covariance = torch.cholesky_inverse(chol)
        direction = -(covariance @ centred)  # W' = dW/dλ
        third, logit_cov = self._third_order(mode, covariance, direction)
        trace = float(covariance.diagonal().sum())
        slope_lam = 0.5 * (d / lam - sq_norm - trace - third)
        # the λ at which the slope would vanish with γ = d − λ tr Σ − λ T held: MacKay's update
        effective = d - lam * trace - lam * third
        mackay = (math.log(max(effective, 1e-12 * d) / sq_norm) if sq_norm > 0
                  else log_precision + MAX_STEP)
        return _Point(log_precision, mode, covariance, evidence, lam * slope_lam, mackay,
                      logit_cov)

    def _third_order(self, mode: Tensor, covariance: Tensor, direction: Tensor
                     ) -> tuple[float, Tensor | None]:
        """``tr(Σ DH[v])`` for ``v = direction`` (0 for a Gaussian likelihood), and the logit
        covariances ``(N, C, C)`` under ``Σ`` it took (None for a Gaussian likelihood)."""
        if self.likelihood is Likelihood.GAUSSIAN:
            return 0.0, None
        c, width = self.num_classes, self.inputs.shape[1]
        x = self.inputs
        probs = torch.softmax(x @ mode.reshape(c, width).T, dim=-1)  # (N, C)
        change = x @ direction.reshape(c, width).T  # u_n, (N, C)
        dp = probs * (change - (probs * change).sum(-1, keepdim=True))  # B_n u_n
        logit_cov = logit_covariance(covariance, x, c)  # S_n[c, k] = x_nᵀ Σ_ck x_n, (N, C, C)
        diagonal = (dp * logit_cov.diagonal(dim1=1, dim2=2)).sum()
        cross = (dp * torch.einsum("nck,nk->nc", logit_cov, probs)).sum()
        return float(diagonal - 2.0 * cross), logit_cov

    # -- the search ---------------------------------------------------------------------------

    def search(self, bounds: tuple[float, float], start: Tensor,
               initial: float = 1.0) -> tuple[HyperparameterChoice, Tensor]:
        """The maximiser of ``E`` over ``log λ`` in ``bounds``, and the mode there.

        At each ``λ`` the mode is refitted by Newton, warm-started from the first-order
        prediction ``W + W' Δλ``, to `MODE_TOL` (the tolerance of
        `find_mode`): a slope from a looser mode can have the
        wrong sign near the maximiser, and a wrong sign shuts the bracket on the wrong side.

        Raises:
            NumericalError: no convergence in `MAX_STEPS` steps (the caller then falls
            back to the grid-and-Brent search).
        """
        lo, hi = math.log(bounds[0]), math.log(bounds[1])
        t = min(max(math.log(initial), lo), hi)
        left, right = lo, hi        # the bracket of the maximiser
        left_seen = right_seen = False  # whether an end is an evaluated point
        theta = start.clone()
        history: list[tuple[float, float]] = []
        previous = None
        for _ in range(MAX_STEPS):
            lam = math.exp(t)
            mode, _, chol = self._mode(theta, lam)
            point = self._point(t, mode, chol)
            history.append((lam, point.evidence))
            if point.slope > 0:
                left, left_seen = t, True
            else:
                right, right_seen = t, True
            at_bound = self._at_bound(point, lo, hi)
            proposal = t if at_bound is not None else self._proposal(
                point, previous, left, right, left_seen, right_seen)
            if (at_bound is not None or abs(proposal - t) <= 0.1 * LOG_XATOL
                    or right - left <= 0.1 * LOG_XATOL
                    or (abs(proposal - t) <= 10 * LOG_XATOL
                        and self._converged(point, previous))):
                return self._choice(point, bounds, at_bound, history), mode
            previous = point
            theta = mode
            if abs(proposal - t) < 1.0:  # first-order prediction of the mode at the new λ
                theta = mode - point.covariance @ (mode - self.prior_mean) * (
                    math.exp(proposal) - lam)
            t = proposal
        raise NumericalError(f"the evidence search did not converge in {MAX_STEPS} steps.")

    def _chord(self, theta: Tensor, prior_precision: float, tol: float,
               covariance: Tensor) -> Tensor:
        """Up to `CHORD_STEPS` chord steps ``−Σ_prev g`` from ``theta``, with the
        inverse curvature ``Σ_prev`` of the previous refit (``O(d²)`` each, against a
        factorisation and a curvature, ``O(d³ + N C² (m + 1)²)``, for a Newton step); each
        must lower the objective, and they stop once the step's predicted gain is below ``tol``
        or shrinks by less than `CHORD_RATE` (``Σ_prev`` too far from the curvature at
        the new ``λ``). Newton then confirms the mode with the exact curvature, whose factor the
        evidence needs anyway: the refit ends at the same mode (to its tolerance) with or
        without them. (S1-sized heads: 15 Newton iterations in the search instead of 20; the
        chord does not help the first refit after a long step in ``λ``, and gives up at once.)"""
        value, gain, previous = None, math.inf, theta
        for _ in range(CHORD_STEPS):
            theta_req = theta.detach().requires_grad_(True)
            current = self._objective(theta_req, prior_precision)
            (grad,) = torch.autograd.grad(current, theta_req)
            current_value = float(current.detach())
            if value is not None and not current_value < value:
                return previous  # the last step did not descend: undo it
            step = -(covariance @ grad)
            predicted = float(-(grad @ step)) / 2
            if predicted <= tol or predicted > CHORD_RATE * gain:
                return theta
            value, gain, previous = current_value, predicted, theta
            theta = theta + step.detach()
        return theta

    def _mode(self, theta: Tensor, prior_precision: float, tol: float = MODE_TOL,
              covariance: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Newton from ``theta`` until half the squared decrement is ≤ ``tol``:
        ``(mode, last iterate, chol(λI + H(last iterate)))``. The mode is the last iterate plus
        its Newton step (as `find_mode` returns it); the
        evidence and slope are taken at the last iterate, whose factor is at hand and which is
        within that one negligible step of the mode. ``covariance``: the previous refit's
        ``Σ``, for chord steps before Newton (`_chord`)."""
        if self.likelihood is Likelihood.SOFTMAX:
            # matrix-free Newton-CG to well inside MODE_TOL (issue 41): the exact Newton step
            # below then confirms the mode at its first iteration, with the one factorisation
            # the evidence needs anyway. (The evidence's slope is taken at the last iterate: a
            # mode just inside a loose ``tol`` moved the search's end by ~1e-3 in log λ.)
            theta, _ = newton_cg(lambda v: self._objective(v, prior_precision), self.inputs,
                                 self._one_hot, prior_precision, self.prior_mean, theta,
                                 MODE_TOL, self.max_iter, self._gram, covariance)
        elif covariance is not None:
            theta = self._chord(theta, prior_precision, MODE_TOL, covariance)
        for _ in range(self.max_iter):
            step, chol, decrement, precision = self._newton(theta, prior_precision)
            if decrement <= tol:
                self.last_precision = LastPrecision(prior_precision, precision, chol)
                return theta + step, theta, chol
            theta = (theta + step if decrement <= NEAR_MODE
                     else self._damped(theta, step, 2 * decrement, prior_precision))
        raise NumericalError(
            f"Newton did not converge in {self.max_iter} iterations at prior precision "
            f"{prior_precision:.4g}; raise max_iter, or narrow prior_precision_bounds.")

    # -- the secant search (the default) ------------------------------------------------------

    def search_secant(self, bounds: tuple[float, float], start: Tensor, initial: float = 1.0,
                      rtol: float | None = None, max_refits: int = MAX_REFITS,
                      ) -> tuple[HyperparameterChoice, Tensor]:
        """The maximiser of ``E`` over ``log λ`` in ``bounds``, and the mode there, by the
        secant method on a residual whose root is that of the exact slope of the refitted
        evidence.

        The slope ``dE/d(log λ) = ½ (γ − λ ‖W − μ₀‖²)`` (third-order term included in ``γ``,
        `_point`) bends on a softmax head; ``r = log(γ / ‖W − μ₀‖²) − log λ``, MacKay's
        update minus ``log λ``, has the slope's sign and is close to linear in ``log λ``
        (S1's heads), so the secant of ``r`` through the last two refitted points lands within
        ~1% of the root: 3-4 refits, against 10-12 for `search`, whose steps are
        held to twice MacKay's (which converges linearly). A Gaussian likelihood's residual
        is the slope itself. The first step is
        `FIRST_STEP` e-folds uphill; a secant step that leaves the bracket of the root
        is replaced by bisection, or by the unvisited bound it points past. Each refit is
        Newton warm-started from the first-order prediction ``W − Σ (W − μ₀) Δλ``. Once
        three points bracket the root, the step goes to the root of their residuals' inverse
        quadratic interpolant (Brent's step) where it lies inside the bracket. A softmax
        head's search ends at the last refitted point once the step to the next proposal is
        below ``rtol`` (relative; see `LAMBDA_RTOL`); otherwise, once the next proposal's
        error is estimated below ``rtol``, it returns that proposal's ``λ`` and the mode there
        (one more refit, no slope). A softmax head's refits all reach `MODE_TOL`; a Gaussian
        likelihood's stop at a looser mode while the steps are long (`LOOSE_MODE_TOL`,
        tightening as the steps shrink): the slope there only has to point the next step; the
        mode returned is to `MODE_TOL`.

        (Why not one eigendecomposition and the evidence at fixed curvature, ``O(d)`` per
        ``λ``: on S1-sized heads the third-order term, how the curvature moves with the mode,
        is 35 nats of the slope's 36 at ``λ = 1`` and puts the fixed-curvature maximiser near
        ``λ = 90`` against the refitted evidence's 8.5; a fixed-curvature surrogate cannot
        find this criterion's maximiser. An eigendecomposition of ``d = 1,010`` also costs
        0.17 s on one thread, 14 Cholesky factorisations.)

        Raises:
            NumericalError: no convergence in ``max_refits`` refits (the caller then falls
            back to `search`).
        """
        lo, hi = math.log(bounds[0]), math.log(bounds[1])
        if rtol is None:
            rtol = LAMBDA_RTOL if self.likelihood is Likelihood.SOFTMAX else EXACT_LAMBDA_RTOL
        tol = math.log1p(rtol)
        t = min(max(math.log(initial), lo), hi)
        left, right = lo, hi
        left_seen = right_seen = False
        theta = start.clone()
        history: list[tuple[float, float]] = []
        # (log λ, r) of every refit with a slope: a softmax head's r is MacKay's update of
        # log λ minus log λ (see below); a Gaussian likelihood's the slope itself, whose
        # secant lands on its exact evidence's maximiser to ~1e-6 in log λ
        softmax = self.likelihood is Likelihood.SOFTMAX
        residuals: list[tuple[float, float]] = []
        previous: _Point | None = None
        # a softmax head's refits go to MODE_TOL (Newton-CG does anyway, and a loose mode's
        # slope can have the wrong sign near the maximiser, which shuts the bracket on the
        # wrong side); a Gaussian likelihood's stop at a looser one while the steps are long
        loose = MODE_TOL if softmax else LOOSE_MODE_TOL
        for _ in range(max_refits):
            lam = math.exp(t)
            mode, _, chol = self._mode(theta, lam, loose,
                                       None if previous is None else previous.covariance)
            point = self._point(t, mode, chol)
            history.append((lam, point.evidence))
            residuals.append((t, point.mackay - t if softmax else point.slope))
            at_bound = self._at_bound(point, lo, hi)
            if at_bound is not None:
                return self._choice(point, bounds, at_bound, history), mode
            if point.slope > 0:
                left, left_seen = t, True
            else:
                right, right_seen = t, True
            step = math.copysign(FIRST_STEP, point.slope)
            if previous is not None:
                # the secant of the residual r = log(γ / ‖W − μ₀‖²) − log λ, whose root is the
                # slope's (slope = ½ (γ − λ ‖W − μ₀‖²): the same sign). On S1's heads r is
                # linear in log λ to a few percent where the slope bends (dr/dt −0.54 to −0.48
                # over λ = 3-15, the slope's derivative −1.2 to −3.2): from λ = 3 and 8.2 the
                # secant of r lands within 0.3-1.2% of the maximiser, the slope's within 4-8%
                (t0, r0), (t1, r1) = residuals[-2:]
                curvature = (r1 - r0) / (t1 - t0)
                step = (-r1 / curvature if curvature < 0
                        else math.copysign(MAX_STEP, point.slope))
            proposal = t + min(max(step, -MAX_STEP), MAX_STEP)
            secant = proposal if left < proposal < right else None
            if secant is None:  # the safeguard of the bracket
                if proposal >= right and not right_seen:
                    proposal = right
                elif proposal <= left and not left_seen:
                    proposal = left
                else:
                    proposal = 0.5 * (left + right)
            if softmax and abs(proposal - t) <= tol:
                # this point is within tol of the root (the secant converges superlinearly:
                # the step to its next proposal estimates this point's error), and its mode
                # is to MODE_TOL: it is the answer, with no refit more (issue 41)
                self.last_precision = dataclasses.replace(
                    self.last_precision, covariance=point.covariance,
                    logit_covariance=point.logit_covariance)
                return self._choice(point, bounds, None, history), mode
            # how far the proposal may be from the root: the step ...
            error = abs(proposal - t)
            if left_seen and right_seen and len(residuals) >= 3:
                # ... or, bracketed, the root of the residual's interpolant through the last
                # three points (Brent's inverse quadratic step) inside the bracket, whose
                # distance from the secant's root estimates the secant's error: the
                # interpolant's own is smaller; without a secant root in the bracket, the
                # interpolant's own step
                quadratic = _inverse_quadratic_root(residuals[-3:])
                if quadratic is not None and left < quadratic < right:
                    error = (min(error, abs(quadratic - secant)) if secant is not None
                             else abs(quadratic - t))
                    proposal = quadratic
            theta = mode - point.covariance @ (mode - self.prior_mean) * (
                math.exp(proposal) - lam)
            if error <= tol:
                # the last proposal is within tol of the root: the mode there, to MODE_TOL,
                # without a slope
                mode, _, chol = self._mode(theta, math.exp(proposal),
                                           covariance=point.covariance)
                point = self._point(proposal, mode, chol, slope=False)
                history.append((math.exp(proposal), point.evidence))
                return self._choice(point, bounds, None, history), mode
            # the mode's accuracy follows the step: a slope error of ~sqrt(tol) nats matters
            # only once the step is as small
            if not softmax:
                loose = min(LOOSE_MODE_TOL, max(MODE_TOL, 1e-4 * (proposal - t) ** 4))
            previous, t = point, proposal
        raise NumericalError(
            f"the secant evidence search did not converge in {max_refits} refits.")

    @staticmethod
    def _proposal(point: _Point, previous: _Point | None, left: float, right: float,
                  left_seen: bool, right_seen: bool) -> float:
        """The next ``log λ``. Until the maximiser is bracketed by evaluated points: the secant
        of the slope, at most twice as far as MacKay's update or `SECANT_FREE` (the
        secant overshoots where the slope bends, MacKay's update alone converges only
        linearly), or MacKay's update while there is one point.
        Bracketed: the secant, kept inside the bracket (bisection otherwise). At most
        `MAX_STEP` either way; an unvisited bound is tried before stepping past it."""
        t = point.log_precision
        secant = None
        if previous is not None and previous.log_precision != t:
            curvature = (point.slope - previous.slope) / (t - previous.log_precision)
            if curvature < 0:
                secant = t - point.slope / curvature
        if left_seen and right_seen:
            proposal = secant if secant is not None else 0.5 * (left + right)
        else:
            proposal = point.mackay
            if secant is not None:  # the secant, at most twice MacKay's step
                reach = max(2.0 * abs(point.mackay - t), SECANT_FREE)
                proposal = min(max(secant, t - reach), t + reach)
        proposal = min(max(proposal, t - MAX_STEP), t + MAX_STEP)
        if left < proposal < right:
            return proposal
        if proposal >= right and not right_seen:
            return right
        if proposal <= left and not left_seen:
            return left
        return 0.5 * (left + right)

    @staticmethod
    def _converged(point: _Point, previous: _Point | None) -> bool:
        """Whether a full step from ``point`` could raise the evidence by at most
        `GAIN_TOL` (by the slope's secant): the slope's own error (the curvature is
        taken one tiny Newton step from the mode) is about that size. The search ends on it
        only with a step of at most 1e-5 in ``log λ`` too: a flat evidence (small curvature)
        promises little gain from steps that still move λ visibly."""
        if previous is None or previous.log_precision == point.log_precision:
            return False
        curvature = (point.slope - previous.slope) / (
            point.log_precision - previous.log_precision)
        return curvature < 0 and point.slope**2 <= 2.0 * -curvature * GAIN_TOL

    @staticmethod
    def _at_bound(point: _Point, lo: float, hi: float) -> str | None:
        if point.log_precision <= lo and point.slope <= 0:
            return "lower"
        if point.log_precision >= hi and point.slope >= 0:
            return "upper"
        return None

    @staticmethod
    def _choice(point: _Point, bounds: tuple[float, float], at_bound: str | None,
                history: list[tuple[float, float]]) -> HyperparameterChoice:
        value = (bounds[0] if at_bound == "lower" else bounds[1] if at_bound == "upper"
                 else math.exp(point.log_precision))
        return HyperparameterChoice(
            name="prior_precision", method="marglik", value=value,
            criterion_name="log_evidence", criterion=point.evidence, maximised=True,
            bounds=(float(bounds[0]), float(bounds[1])), at_bound=at_bound,
            evaluations=len(history), grid=tuple(sorted(history)))


def _inverse_quadratic_root(points: list[tuple[float, float]]) -> float | None:
    """Where the quadratic in the slope through three ``(log λ, slope)`` points, ``log λ`` as a
    function of the slope, puts the slope's zero (Brent's inverse quadratic interpolation);
    ``None`` if two slopes coincide."""
    (a, fa), (b, fb), (c, fc) = points
    if fa in (fb, fc) or fb == fc:
        return None
    return (a * fb * fc / ((fa - fb) * (fa - fc)) + b * fa * fc / ((fb - fa) * (fb - fc))
            + c * fa * fb / ((fc - fa) * (fc - fb)))


def newton_cg(objective, inputs: Tensor, one_hot: Tensor, prior_precision: float,
              prior_mean: float | Tensor, theta: Tensor, tol: float, max_iter: int,
              gram: tuple[Tensor, Tensor] | None = None, covariance: Tensor | None = None,
              ) -> tuple[Tensor, bool]:
    """The mode of a softmax head's log posterior by damped Newton with each step solved by
    preconditioned conjugate gradients, matrix-free (issue 41).

    From ``theta`` (flat ``(d,)``), until half the squared Newton decrement (estimated from a
    tight solve) is at most ``tol / 2`` nats; that last step is taken and ``(point, True)``
    returned, or ``(last point, False)`` after ``max_iter`` steps (the caller's exact Newton
    goes on from there). ``objective(theta)`` is the negative log posterior of ``inputs (N, m +
    1)``, ``one_hot`` labels ``(N, C)`` float64 and the prior ``N(μ₀, I/λ)``; ``gram``: the
    eigenpairs of ``XᵀX`` when the caller has them; ``covariance``: an SPD ``(d, d)``
    approximation of the inverse curvature (the evidence search's previous refit's ``Σ``) to
    precondition with instead of the Kronecker form below (a refit's solves then take a few
    iterations instead of tens, for an ``O(d²)`` product each).

    A curvature-vector product ``(λI + H) v = λ v + Σ_n x_n (B_n V x_n)ᵀ`` costs ``O(N C (m +
    1))``, against ``O(N C² (m + 1)²)`` for the curvature and ``O(C³ (m + 1)³)`` for its
    factorisation. Preconditioner: ``λI + B̄ ⊗ XᵀX`` with ``B̄ = mean_n B_n`` at the current
    point, inverted through the eigenpairs of ``B̄`` (``C × C``) and of ``XᵀX``; it is the
    exact curvature where every point has the same probabilities (a cold start from a constant
    head). S1-sized heads (250 rows, 1,010 parameters): the cold mode at λ = 3 in 10 Newton
    steps of 30-100 iterations, ~0.1 s, against 8 factorisations and curvatures, ~0.25 s.
    The line search is `find_mode`'s (Armijo, ``t`` halved)."""
    c = one_hot.shape[1]
    width = inputs.shape[1]
    x, lam = inputs, prior_precision
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(theta).all())):
        # non-finite rows or start: hand back unconverged, so the caller's factorising Newton
        # reports it with its own error (eigh would raise torch's, CG read a zero step as done)
        return theta, False
    gram_values, gram_vectors = gram if gram is not None else torch.linalg.eigh(x.T @ x)
    forcing = 0.5  # the relative residual of the next solve
    for _ in range(max_iter):
        probs = torch.softmax(x @ theta.reshape(c, width).T, dim=-1)  # (N, C)
        grad = ((probs - one_hot).T @ x).reshape(-1) + lam * (theta - prior_mean)
        if not bool(torch.isfinite(grad).all()):  # overflow on the way: the same hand-back
            return theta, False
        # B̄ ⊗ XᵀX with B̄ = mean_n B_n, i.e. Σ_n B̄ ⊗ x_n x_nᵀ
        mean_block = torch.diag(probs.mean(0)) - probs.T @ probs / len(probs)
        block_values, block_vectors = torch.linalg.eigh(mean_block)
        denominator = lam + block_values[:, None].clamp_min(0.0) * gram_values[None, :]

        def precondition(vector: Tensor, bv=block_vectors, den=denominator) -> Tensor:
            if covariance is not None:
                return covariance @ vector
            rotated = bv.T @ vector.reshape(c, width) @ gram_vectors
            return (bv @ (rotated / den) @ gram_vectors.T).reshape(-1)

        def curvature_times(vector: Tensor, p=probs) -> Tensor:
            change = x @ vector.reshape(c, width).T  # (N, C)
            weighted = p * (change - (p * change).sum(-1, keepdim=True))  # B_n u_n
            return (weighted.T @ x).reshape(-1) + lam * vector

        step, squared = _preconditioned_cg(curvature_times, precondition, -grad, forcing)
        # a solve that broke down (rounding at curvatures ~1e76 from overflowing rows) returns
        # a short or zero step whose decrement reads as converged: check its residual (one
        # more product) and hand back unconverged, for the factorising Newton to judge
        missed = float((curvature_times(step) + grad).norm())
        if not missed <= 10 * max(forcing, CG_RTOL_FLOOR) * float(grad.norm()):
            return theta, False
        decrement = squared / 2
        # the estimate is trusted once the solve was tight (a loose one underestimates)
        if decrement <= tol / 2 and forcing <= 1e-3:
            return theta + step, True
        forcing = max(CG_RTOL_FLOOR, min(0.5, math.sqrt(decrement)))
        if decrement > NEAR_MODE:  # Armijo backtracking, t halved from 1
            t = 1.0
            with torch.no_grad():
                value = objective(theta)
                while objective(theta + t * step) > value - 0.5 * t * squared and t > 1e-10:
                    t *= 0.5
            step = t * step
        theta = theta + step
    return theta, False


def _preconditioned_cg(matvec, precondition, rhs: Tensor, rtol: float
                       ) -> tuple[Tensor, float]:
    """``A⁻¹ rhs`` by preconditioned conjugate gradients from 0 (``A`` symmetric positive
    definite), to a relative residual ``rtol`` or `CG_MAX_ITER` iterations, and
    ``rhsᵀ x`` of the solution ``x`` (the squared Newton decrement when ``rhs = −g``). Every
    iterate from 0 is a descent direction for the objective whose gradient is ``−rhs``."""
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    preconditioned = precondition(residual)
    direction = preconditioned.clone()
    rz = float(residual @ preconditioned)
    threshold = rtol * float(rhs.norm())
    for _ in range(CG_MAX_ITER):
        product = matvec(direction)
        curvature = float(direction @ product)
        if not curvature > 0:  # rounding at a vanishing residual: keep what is solved
            break
        alpha = rz / curvature
        solution.add_(direction, alpha=alpha)
        residual.sub_(product, alpha=alpha)
        if float(residual.norm()) <= threshold:
            break
        preconditioned = precondition(residual)
        rz_next = float(residual @ preconditioned)
        direction = preconditioned.add_(direction, alpha=rz_next / rz)
        rz = rz_next
    return solution, float(rhs @ solution)


__all__ = ["LAMBDA_RTOL", "MAX_REFITS", "MAX_STEPS", "EvidenceSearch", "newton_cg"]
