"""The KL-optimal Gaussian over a softmax head, started from its Laplace approximation.

Why. The Laplace approximation ``N(W*, (λI + H(W*))⁻¹)`` takes the curvature at the mode. On
features a network was trained to separate, almost every training point is classified with
``p ≈ 1`` at the mode, its curvature ``diag(p) − p pᵀ`` is ≈ 0, and the Gaussian is as wide as
the prior in most directions — wide enough to put mass on heads that misclassify training
points the likelihood rules out. Its predictive is then far *under*-confident although the
posterior itself is not: on the digits MLP of issue 12 (prior precision by evidence, 0.58) the
Laplace predictive has ECE 0.22 and NLL 0.33 where Hamiltonian Monte Carlo on the same
posterior gives 0.014 and 0.078.

What. The Gaussian ``q = N(μ, Λ⁻¹)`` that minimises ``KL(q ‖ p(W | data))`` (equivalently
maximises the ELBO) satisfies (Opper & Archambeau, 2009)

    Λ = λ I + E_q[H(W)],          E_q[∇ log p(y | W)] = λ (μ − μ₀),

the curvature averaged over ``q`` instead of taken at the mode (``q`` must avoid the regions
the likelihood rules out, so it is narrow where they begin). For a softmax likelihood the ELBO is
concave in ``(μ, chol Λ⁻¹)`` (Challis & Barber, 2013), so the fixed point is unique. It is found
by damped natural-gradient (variational online Newton) steps from the Laplace posterior:

    Λ ← (1 − ρ) Λ + ρ (λ I + E_q[H]),      μ ← μ + ρ Λ⁻¹ (E_q[∇ log p(y | W)] − λ (μ − μ₀)).

A full ``Λ`` is fitted by blocks (issue 41): after every precision step the mean is
re-optimised under that precision (`_full_gaussian`), which moves no factorisation — with
``Λ`` fixed, each point's logit covariance and its draws' noise are fixed, and a mean step costs
one pass over the draws and one triangular solve, against two ``d × d`` factorisations and the
logit covariances for a precision step. The damped joint steps above took 9 precision
evaluations on a 250-row head of ReLU features and 20-22 on S1's clients (whose separable
features made every other step overshoot); by blocks they take 3 and 3-7, to a higher ELBO.
A diagonal (mean-field) ``Λ`` keeps ``diag E_q[H]``, but its mean step uses the full
``λI + E_q[H]`` (matrix-free conjugate gradients): the ELBO's curvature in ``μ`` is that
whatever ``Λ``'s structure, and ``diag`` alone made the step crawl on non-negative inputs
(`_mean_newton_direction`). The fixed point is the same.

The expectations are over each training point's logits ``f_n ~ N(M_n, V_n)`` (``M_n = W x_n``,
``V_n`` the ``C × C`` logit covariance under ``q``), estimated with ``num_draws`` standard-normal
draws per point that are fixed for the whole run (common random numbers: the iteration is a
deterministic map with a fixed point, and the result is reproducible from ``seed``).

The result is a `GaussianPosterior` with the same prior and the
likelihood term ``(E_q[H], Λ μ − λ μ₀)``: the same natural-parameter algebra as the Laplace one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from inference.curvature import expected_head_curvature, expected_softmax_hessian
from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import cholesky_with_jitter
from inference.head_objective import logit_covariance

#: Draws per training point for the expectations (their Monte-Carlo error averages over points).
DEFAULT_NUM_DRAWS = 64
#: The largest step ``ρ`` (the fixed-point map overshoots at 1: on S1-sized heads, 250 rows of
#: 100 ReLU features, ρ = 1 alternates accepted and rejected steps for 12-13 evaluations; 0.5
#: took 10-12 and 0.7 8-9 to the same tolerances, ELBO within 0.01 nats; issue 41).
DEFAULT_DAMPING = 0.7
#: ELBO evaluations at most. The digits sweep of tests/inference/test_laplace_head_scales.py
#: (4 input scales x 50-1,200 points x both structures) converges in at most ~90.
DEFAULT_ELBO_MAX_ITER = 300


def variational_gaussian(
    mode: Tensor,
    laplace_precision: Tensor,
    inputs: Tensor,
    labels: Tensor,
    num_classes: int,
    prior_precision: float,
    prior_mean: float,
    diagonal: bool = False,
    num_draws: int = DEFAULT_NUM_DRAWS,
    damping: float = DEFAULT_DAMPING,
    elbo_max_iter: int = DEFAULT_ELBO_MAX_ITER,
    tol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    start_factor: Tensor | None = None,
    start_covariance: Tensor | None = None,
    start_logit_covariance: Tensor | None = None,
    return_factor: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """Mean and expected likelihood curvature of the KL-optimal Gaussian (module docstring).

    Each step is accepted only if the ELBO (estimated with the same fixed draws) does not drop;
    otherwise ``ρ`` is halved and the step retried, and an accepted step lets ``ρ`` grow back
    towards ``damping`` (the plain fixed-point map can overshoot where wide Gaussians make
    ``E_q[H]`` small).

    Args:
        mode: the MAP, flat float64 ``(d,)`` with ``d = C (m + 1)``, the start of ``μ``.
        laplace_precision: the Laplace precision at the mode, ``(d, d)`` (or ``(d,)`` with
            ``diagonal``), the start of ``Λ``.
        inputs: bias-augmented float64 features ``(N, m + 1)``.
        labels: int64 ``(N,)``.
        num_classes: ``C``.
        prior_precision: ``λ`` of the prior.
        prior_mean: ``μ₀`` of the prior (a number, or a flat ``(d,)`` tensor).
        diagonal: fit a diagonal-precision Gaussian (mean field; ``Λ = λ + diag E_q[H]``); its
            mean steps still use the full ``λI + E_q[H]`` (`_mean_newton_direction`).
        num_draws: logit draws per training point.
        damping: the largest ``ρ ∈ (0, 1]``.
        elbo_max_iter: ELBO evaluations at most of a new precision (``fit_laplace_head``'s
            option of that name reaches it); a full fit's mean steps between them are bounded
            by `MEAN_MAX_STEPS` each.
        tol: stop when half the mean's squared Newton decrement, ``gᵀ Λ⁻¹ g / 2`` (diagonal:
            ``gᵀ (λI + E_q[H])⁻¹ g / 2``; nats: the ELBO's predicted gain of a full step), is at
            most ``tol`` and the precision has converged (``rtol``); or when no step of
            ``ρ`` down to `FLOOR_RHO` raises the ELBO while that gain is below 1 nat (the
            Monte-Carlo floor of the fixed draws: the expectations carry an error of order
            ``1 / sqrt(num_draws)`` per point); a full fit also stops, with that gain at most
            ``tol``, once its precision steps' extrapolated remaining gain is at most ``tol``
            (`remaining_gain`). Default (``None``): `default_tolerances`.
        rtol: the precision has converged when the next one differs from the current by at
            most ``rtol`` (largest entry change over largest entry). Default: as ``tol``.
        seed: seed of the fixed draws.
        start_factor: the lower Cholesky factor of ``laplace_precision`` (full fits), when the
            caller has it (the Laplace posterior caches it for its evidence): the first ELBO
            evaluation then factorises nothing. ``laplace_precision`` must then be exactly
            symmetric, as the factor was computed from it.
        start_covariance: with ``start_factor``, its ``cholesky_inverse`` ``Σ (d, d)`` where
            the caller has it (the evidence search's last slope), and
        start_logit_covariance: every training point's logit covariance under that ``Σ``,
            ``(N, C, C)`` (`inference.curvature.logit_covariance`): the first ELBO
            evaluation then takes no inverse and no logit covariances either. Each must be what
            this function would compute from ``start_factor`` (the result is then the same).
        return_factor: also return ``(Λ, chol(Λ), Λ⁻¹)`` of the Gaussian found (full fits;
            None for a diagonal one), ``Λ`` formed as ``λI + expected_curvature`` is in
            `inference.gaussian.GaussianPosterior`'s total precision, bit for bit: a posterior
            built from the result can take them instead of factorising again
            (`inference.laplace_head.gaussian_head_posterior`).

    Returns:
        ``(mean (d,), expected_curvature)``: the likelihood precision of the variational
        posterior, float64 ``(d, d)`` (or ``(d,)`` diagonal): ``E_q[H]`` at the fit (diagonal),
        or the data part ``Λ − λI`` of the Gaussian found, ``E_q[H]`` to ``rtol`` (full).
        With ``return_factor``, a third element: ``(Λ, chol(Λ), Λ⁻¹)``, each ``(d, d)``
        float64 (full), or None (diagonal).

    Raises:
        InvalidInputError: bad options.
        NumericalError: no convergence in ``elbo_max_iter`` evaluations.
    """
    if not 0 < damping <= 1:
        raise InvalidInputError(f"damping must lie in (0, 1]; got {damping}.")
    if num_draws < 1 or elbo_max_iter < 1:
        raise InvalidInputError("num_draws and elbo_max_iter must be at least 1.")
    default_tol, default_rtol = default_tolerances(inputs.shape[0], num_draws)
    tol = default_tol if tol is None else tol
    rtol = default_rtol if rtol is None else rtol
    problem = _Problem(inputs, labels, num_classes, prior_precision, prior_mean, diagonal,
                       num_draws, seed)
    if not diagonal:
        start = laplace_precision.clone() if start_factor is not None else 0.5 * (
            laplace_precision + laplace_precision.T)
        first = problem.fix_precision(start, start_factor, start_covariance,
                                      start_logit_covariance)
        mean, data, fixed = _full_gaussian(problem, mode.clone(), first, damping,
                                           elbo_max_iter, tol, rtol)
        if return_factor:
            return mean, data, (fixed.precision, fixed.chol, fixed.covariance)
        return mean, data
    # a diagonal (mean-field) precision: the joint damped steps of the module docstring
    state = problem.evaluate(mode.clone(), laplace_precision.clone())
    rho = damping
    for _ in range(elbo_max_iter):
        if state.decrement / 2 <= tol and state.change <= rtol:
            return (state.mean, state.curvature, None) if return_factor else (
                state.mean, state.curvature)
        candidate = problem.evaluate(*state.step(rho))
        if candidate.elbo >= state.elbo:
            state, rho = candidate, min(damping, 2 * rho)
        elif state.decrement / 2 <= 1.0 and rho <= FLOOR_RHO:
            # no ascent left that the draws can resolve
            return (state.mean, state.curvature, None) if return_factor else (
                state.mean, state.curvature)
        elif rho > 1 / 1024:
            rho /= 2
        else:
            break
    raise _not_converged(elbo_max_iter, state.decrement, state.change)


def _not_converged(elbo_max_iter: int, decrement: float, change: float) -> NumericalError:
    return NumericalError(
        f"the variational Gaussian did not converge in {elbo_max_iter} ELBO evaluations "
        f"(natural-gradient decrement {decrement:.2e} nats, relative precision change "
        f"{change:.2e}); raise elbo_max_iter (an option of fit_head('laplace', ...) and "
        "fit_laplace_head) or pass approximation='laplace'.")


#: Newton steps at most of the mean under one precision (`_full_gaussian`).
MEAN_MAX_STEPS = 100
#: Relative residual of the conjugate gradients of a full fit's mean Newton step: an inexact
#: Newton direction (forcing term 0.1: the mean's steps still converge, linearly at worst, and
#: the ELBO's line search accepts or shortens each). Against 1e-3 it took S1's ten heads from
#: 6.3 to 5.4 CPU-s (11.3 to 4.2 preconditioned products a step, 173 and 165 steps) with the
#: bench heads' held-out NLL equal to 2e-4 relative.
MEAN_CG_RTOL = 1e-1
#: The mean's stopping threshold under one precision, as a share of ``tol``: the outer loop
#: then never waits on the mean, and the ELBOs it compares are each at their precision's best
#: mean to well within the draws' resolution.
MEAN_TOL_SHARE = 0.1


class _Precision:
    """What a full precision ``Λ`` fixes: its factor and inverse ``Σ``, the draws' logit noise
    ``chol(V_n) z`` stored ``(S, C, N)`` (classes in the middle: a log-softmax over a middle
    axis of 10 runs ~6x faster than over a last axis of 10), and the KL's terms in ``Λ``."""

    def __init__(self, precision: Tensor, chol: Tensor, covariance: Tensor, noise: Tensor,
                 kl_part: float) -> None:
        self.precision, self.chol, self.covariance = precision, chol, covariance
        self.noise, self.kl_part = noise, kl_part


class _Mean:
    """One mean ``μ`` under a `_Precision`: the ELBO, its gradient ``g`` and the draws'
    probabilities ``(S, N, C)``; `_Problem.newton` adds the Newton step and the squared
    decrement."""

    def __init__(self, mean: Tensor, elbo: float, gradient: Tensor, probs: Tensor) -> None:
        self.mean, self.elbo, self.gradient, self.probs = mean, elbo, gradient, probs
        self.step: Tensor | None = None
        self.decrement = math.inf


def _full_gaussian(problem: _Problem, mean: Tensor, fixed: _Precision, damping: float,
                   elbo_max_iter: int, tol: float, rtol: float
                   ) -> tuple[Tensor, Tensor, _Precision]:
    """`variational_gaussian` for a full precision, by blocks: the precision steps
    ``Λ ← (1 − ρ) Λ + ρ (λI + E_q[H])`` (accepted if the ELBO at the new precision's best mean
    does not drop, ``ρ`` halved otherwise, as in the joint iteration), and after each the mean
    re-optimised by Newton steps under that precision (`_Problem.best_mean`). Stops on
    the same rules: the mean's Newton step gains ≤ ``tol`` and the precision's next step is ≤
    ``rtol``; or the draws' floor; or (`remaining_gain`) once what the precision steps left
    could still gain, extrapolated from the last two accepted steps' gains, is ≤ ``tol``.

    Returns ``(μ, K, fixed)`` of the Gaussian found, ``Λ = λI + K``: the mean is optimal for
    that precision, and its data part ``K`` is ``E_q[H]`` to ``rtol`` where the precision's
    test ends the fit (the other
    two rules end it with the remaining ELBO gain, not the precision's distance to its
    target, below what the draws resolve). (Returning the next target
    ``E_q[H]`` instead paired the mean with a precision it is not optimal for; where the draws'
    floor ends a wide fit early — digits standardized, 400-1,200 points — the mean's gain
    under fresh draws was then 2-3x the Monte-Carlo share the tests allow.)"""
    lam = problem.prior_precision
    state = problem.best_mean(problem.at_mean(mean, fixed), fixed, MEAN_TOL_SHARE * tol)
    rho, evaluations = damping, 0
    gains: list[float] = []  # the ELBO gains of the accepted steps since the last rejection
    # the data part K of the current precision: the steps mix data parts, and each precision
    # is λI + K formed as the returned posterior forms its total (`_with_prior`), so that its
    # factor is that posterior's too, bit for bit
    data = _data_part(fixed.precision, lam)
    while True:
        if state.decrement / 2 <= tol and remaining_gain(gains) <= tol:
            return state.mean, data, fixed
        target = expected_head_curvature(state.probs, problem.inputs)  # E_q[H]
        change = _max_abs(target - data) / _max_abs(fixed.precision)
        if state.decrement / 2 <= tol and change <= rtol:
            return state.mean, data, fixed
        while True:  # one precision step, ρ halved until the ELBO does not drop
            if evaluations >= elbo_max_iter:
                raise _not_converged(elbo_max_iter, state.decrement, change)
            evaluations += 1
            # exactly symmetric: a mix of the symmetrised start and curvatures assembled from
            # mirrored blocks (the same arithmetic on both triangles)
            step_data = torch.lerp(data, target, rho)
            step = _with_prior(step_data, lam)
            candidate_fixed = problem.fix_precision(
                step, cholesky_with_jitter(step, symmetric=True))
            candidate = problem.best_mean(problem.at_mean(state.mean, candidate_fixed),
                                          candidate_fixed, MEAN_TOL_SHARE * tol)
            if candidate.elbo >= state.elbo:
                gains.append(candidate.elbo - state.elbo)
                fixed, data, state = candidate_fixed, step_data, candidate
                rho = min(damping, 2 * rho)
                break
            gains.clear()  # a shorter step follows: the geometric model starts again
            # No ascent left that the draws resolve (the fixed draws' ELBO and their E_q[H]
            # are two estimators whose optima differ by the Monte-Carlo error): a step as
            # short as the floor's, or a rejected one whose ELBO moved by at most ``tol``
            # (the mean's own resolution; without it S1's heads spent up to 10 evaluations
            # halving ρ from 0.7 to the floor, 3-16 precision evaluations against 3-7). It
            # ends wide fits whose precision the draws cannot resolve (digits standardized,
            # 400-1,200 points: 0.5-0.8 off the fixed point where two fresh draw sets differ
            # by 0.4-0.7; tests/inference/test_laplace_head_scales.py).
            if state.decrement / 2 <= 1.0 and (rho <= FLOOR_RHO
                                               or state.elbo - candidate.elbo <= tol):
                return state.mean, data, fixed
            if rho < FLOOR_RHO:
                raise _not_converged(elbo_max_iter, state.decrement, change)
            rho /= 2


def remaining_gain(gains: list[float]) -> float:
    """What further precision steps could still add to the ELBO (nats), extrapolated from the
    gains of the last two accepted steps, ``g₋₂`` and ``g₋₁``: ``g₋₁ r / (1 − r)`` with ``r =
    g₋₁ / g₋₂``, the tail of a geometric series; ``inf`` without two gains or where they do not
    shrink.

    Why. The damped fixed-point steps converge linearly (each leaves about ``1 − ρ`` of the
    precision's distance to its target, and the ELBO's gap shrinks by about the square of that),
    so the gains form a geometric series once the steps are regular. On S1's ten client heads
    the second step gained 0.08-0.2 of the first (1.9 then 0.16 nats, 1.1 then 0.14): what
    was left was a few hundredths of a nat, under the fit's ``tol`` (0.125 nats at 250 rows),
    and the one or two precision evaluations that followed (a factorisation, an inverse and the
    logit covariances each) either gained that little or were rejected by the draws' floor.
    Only steps of one run of acceptances count: a rejection halves ``ρ`` and restarts the
    series (the caller clears ``gains``)."""
    if len(gains) < 2 or not 0 < gains[-1] < gains[-2]:
        return math.inf
    ratio = gains[-1] / gains[-2]
    return gains[-1] * ratio / (1 - ratio)


def _data_part(precision: Tensor, prior_precision: float) -> Tensor:
    """``Λ − λI`` (a new tensor)."""
    data = precision.clone()
    data.diagonal().sub_(prior_precision)
    return data


def _with_prior(data: Tensor, prior_precision: float) -> Tensor:
    """``λI + K`` (a new tensor) as `inference.gaussian.GaussianPosterior` forms the total
    precision of its prior ``λI`` and a dense likelihood term ``K``: ``λ + K_ii`` on the
    diagonal, ``K`` elsewhere, the same floating-point sums (whereas ``(Λ − λ) + λ`` may differ
    from ``Λ_ii`` in its last bit)."""
    precision = data.clone()
    precision.diagonal().add_(prior_precision)
    return precision


#: The step at which a rejected step ends the fit when the predicted gain is below 1 nat (the
#: draws' Monte-Carlo floor). 1/16 saved S1 heads up to 6 evaluations but ended a wide
#: posterior (digits standardized, 400 points, full) with its precision still moving by 33%
#: (tests/inference/test_laplace_head_scales.py): kept at 1/1024.
FLOOR_RHO = 1 / 1024
#: The ELBO's predicted gain per training point (nats) and the precision's relative change at
#: which a fit with the default 64 draws stops (`default_tolerances`).
GAIN_PER_POINT, PRECISION_RTOL = 5e-4, 3e-2


def default_tolerances(num_points: int, num_draws: int) -> tuple[float, float]:
    """``(tol, rtol)`` of `variational_gaussian` for ``num_points`` training points and
    ``num_draws`` draws a point: ``tol = max(1e-3, 5e-4 N · 64 / S)`` nats and ``rtol =
    max(1e-2, 0.03 · 64 / S)``.

    Why. Beyond the Monte-Carlo error of the fixed draws, more iterations move the Gaussian
    along directions the draws cannot resolve: with 64 draws the iteration converges linearly
    (ELBO gain ×0.8 a step). On S1-sized features (250 rows of 100 ReLU features of a trained
    MLP, 10 classes) the former fixed tolerances (1e-3 nats, 1e-2) took 42 evaluations and
    these 17, held-out NLL 0.1815 against 0.1797 (the same fixed point to ±1%; its NLL
    wanders by about that much along the last steps, both ways). The tolerances shrink with
    the draws' variance (1/S), down to the fixed 1e-3 nats and 1e-2 of a fit with many draws,
    whose fixed point is checked by quadrature (tests/inference/test_variational_gaussian.py);
    tests/inference/test_laplace_head_scales.py checks the defaults against fresh draws.
    """
    scale = DEFAULT_NUM_DRAWS / max(int(num_draws), 1)
    return (max(1e-3, GAIN_PER_POINT * num_points * scale),
            max(1e-2, PRECISION_RTOL * scale))


class _State:
    """One ``(μ, Λ)`` of a diagonal fit with its ELBO, natural gradient, fixed-point target
    and the mean's Newton direction ``(λI + E_q[H])⁻¹ g`` with the *full* expected curvature
    (`_mean_newton_direction`)."""

    def __init__(self, mean: Tensor, precision: Tensor, elbo: float, gradient: Tensor,
                 curvature: Tensor, target: Tensor, newton: Tensor) -> None:
        self.mean, self.precision, self.elbo = mean, precision, elbo
        self.gradient, self.curvature, self.target = gradient, curvature, target
        self.newton = newton
        self.change = _max_abs(target - precision) / _max_abs(precision)
        self.decrement = float(self.gradient @ newton)

    def step(self, rho: float) -> tuple[Tensor, Tensor]:
        """``(μ + ρ (λI + E_q[H])⁻¹ g, (1 − ρ) Λ + ρ target)``."""
        return self.mean + rho * self.newton, (1 - rho) * self.precision + rho * self.target


def _max_abs(matrix: Tensor) -> float:
    """``max |a_ij|`` in one pass without a temporary (``abs().max()`` allocates ``d²``)."""
    low, high = torch.aminmax(matrix)
    return max(-float(low), float(high))


class _Problem:
    """The data, the prior and the fixed draws; `evaluate` gives a `_State`."""

    def __init__(self, inputs: Tensor, labels: Tensor, num_classes: int, prior_precision: float,
                 prior_mean: float, diagonal: bool, num_draws: int, seed: int) -> None:
        generator = torch.Generator(device=inputs.device).manual_seed(int(seed))
        self.draws = torch.randn(num_draws, inputs.shape[0], num_classes, generator=generator,
                                 dtype=torch.float64, device=inputs.device)
        self.inputs, self.labels, self.num_classes = inputs, labels, num_classes
        self.one_hot = torch.nn.functional.one_hot(labels, num_classes).to(torch.float64)
        self.prior_precision, self.prior_mean, self.diagonal = (prior_precision, prior_mean,
                                                                diagonal)

    def fix_precision(self, precision: Tensor, chol: Tensor | None,
                      covariance: Tensor | None = None,
                      logit_covariance: Tensor | None = None) -> _Precision:
        """Factor ``Λ`` (unless ``chol`` is given), and fix what it determines: each point's
        logit covariance ``V_n`` and the draws' noise ``chol(V_n) z``, and the KL's terms in
        ``Λ``. ``covariance`` and ``logit_covariance``, with ``chol``: its inverse and the
        ``V_n``, where the caller has them."""
        if chol is None:
            chol = cholesky_with_jitter(precision)
        if covariance is None:
            covariance, logit_covariance = torch.cholesky_inverse(chol), None
        d, lam = precision.shape[0], self.prior_precision
        log_det = float(2 * torch.log(chol.diagonal()).sum())
        # KL(N(μ, Λ⁻¹) ‖ N(μ₀, I/λ)) = ½ (λ tr Λ⁻¹ − d − d log λ + log|Λ|) + ½ λ |μ − μ₀|²
        kl_part = 0.5 * (lam * float(covariance.trace()) - d - d * math.log(lam) + log_det)
        factor = _logit_covariance_factor(covariance, self.inputs, self.num_classes,
                                          logit_covariance)
        noise = torch.einsum("nck,snk->scn", factor, self.draws)
        return _Precision(precision, chol, covariance, noise, kl_part)

    def at_mean(self, mean: Tensor, fixed: _Precision) -> _Mean:
        """The ELBO and its mean gradient at ``mean`` under the fixed precision."""
        width = self.inputs.shape[1]
        logit_mean = mean.reshape(self.num_classes, width) @ self.inputs.T  # (C, N)
        log_probs = torch.log_softmax(logit_mean + fixed.noise, dim=1).transpose(1, 2)
        probs = log_probs.exp()  # (S, N, C), a view of (S, C, N) memory
        draws = log_probs.shape[0]
        expected_log_lik = float(log_probs.gather(
            -1, self.labels.expand(draws, -1)[..., None]).sum() / draws)
        centred = mean - self.prior_mean
        kl = fixed.kl_part + 0.5 * self.prior_precision * float(centred @ centred)
        gradient = ((self.one_hot - probs.mean(0)).T @ self.inputs).reshape(-1)
        gradient = gradient - self.prior_precision * centred
        return _Mean(mean, expected_log_lik - kl, gradient, probs)

    def newton(self, state: _Mean, fixed: _Precision) -> _Mean:
        """Give ``state`` its Newton step ``(λI + E_q[H])⁻¹ g`` — the fixed draws' ELBO's own
        Hessian in ``μ`` — by conjugate gradients preconditioned with ``Σ = Λ⁻¹``
        (`_mean_newton_direction`), and the squared decrement ``gᵀ step``.

        Why not the plain ``Λ⁻¹ g``. Where ``Λ`` is still far from ``λI + E_q[H]`` (a wide
        posterior's first precision steps: digits standardized, 400 points, λ = 0.64, the two
        100% apart) the mean crept, 95-273 steps under one precision; near the fixed point the
        two agree and the conjugate gradients take a few iterations.
        """
        state.step = _mean_newton_direction(
            state.probs, self.inputs, self.prior_precision, state.gradient,
            lambda vector: fixed.covariance @ vector, rtol=MEAN_CG_RTOL)
        state.decrement = float(state.gradient @ state.step)
        return state

    def best_mean(self, state: _Mean, fixed: _Precision, tol: float) -> _Mean:
        """Newton steps ``μ + t step`` (`newton`; ``t`` halved from 1 until the ELBO
        does not drop) from ``state`` until half the squared decrement is ≤ ``tol`` nats, or
        no step of ``t ≥`` `FLOOR_RHO` raises the ELBO (the draws' floor), or after
        `MEAN_MAX_STEPS`. With ``Λ`` fixed the ELBO is concave in ``μ`` (log-softmax of
        logits affine in ``μ``, the same draws), so the steps only climb."""
        state = self.newton(state, fixed)
        for _ in range(MEAN_MAX_STEPS):
            if state.decrement / 2 <= tol:
                break
            t = 1.0
            candidate = self.at_mean(state.mean + state.step, fixed)
            while candidate.elbo < state.elbo and t > FLOOR_RHO:
                t /= 2
                candidate = self.at_mean(state.mean + t * state.step, fixed)
            if candidate.elbo < state.elbo:
                break
            state = self.newton(candidate, fixed)
        return state

    def evaluate(self, mean: Tensor, precision: Tensor) -> _State:
        """The state of a diagonal fit at ``(mean, precision (d,))``."""
        lam = self.prior_precision
        covariance = 1.0 / precision
        log_det, trace = float(torch.log(precision).sum()), float(covariance.sum())
        log_probs = _diagonal_draw_log_probabilities(mean, covariance, self.inputs,
                                                     self.num_classes, self.draws)
        probs = log_probs.exp()
        expected_log_lik = float(log_probs.gather(
            -1, self.labels.expand(log_probs.shape[0], -1)[..., None]).sum() / len(probs))
        d = mean.shape[0]
        # KL(N(μ, Λ⁻¹) ‖ N(μ₀, I/λ)) = ½ (λ tr Λ⁻¹ + λ |μ − μ₀|² − d − d log λ + log|Λ|)
        kl = 0.5 * (lam * trace + lam * float(((mean - self.prior_mean) ** 2).sum()) - d
                    - d * math.log(lam) + log_det)
        gradient = ((self.one_hot - probs.mean(0)).T @ self.inputs).reshape(-1)
        gradient = gradient - lam * (mean - self.prior_mean)
        curvature = expected_head_curvature(probs, self.inputs, diagonal=True)
        target = curvature + lam
        newton = _mean_newton_direction(probs, self.inputs, lam, gradient,
                                        lambda residual: residual / target)
        return _State(mean, precision, expected_log_lik - kl, gradient, curvature, target,
                      newton)


def _logit_covariance_factor(covariance: Tensor, inputs: Tensor, num_classes: int,
                             logit_cov: Tensor | None = None) -> Tensor:
    """Lower Cholesky factors ``(N, C, C)`` of every point's logit covariance under a full
    head covariance (``logit_cov``, where the caller has it; a relative 1e-12 jitter: a
    point's covariance is singular where its features vanish)."""
    if logit_cov is None:
        logit_cov = logit_covariance(covariance, inputs, num_classes)
    jitter = 1e-12 * logit_cov.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)
    eye = torch.eye(num_classes, dtype=torch.float64, device=inputs.device)
    return torch.linalg.cholesky(logit_cov + jitter[:, None, None] * eye)


def _diagonal_draw_log_probabilities(mean: Tensor, variance: Tensor, inputs: Tensor,
                                     num_classes: int, draws: Tensor) -> Tensor:
    """``log_softmax`` of every point's logit draws under a diagonal head covariance
    ``variance (d,)``: independent logits, ``V_n = diag(Σ_p x_np² σ²_cp)``; ``(S, N, C)``."""
    width = inputs.shape[1]
    logit_mean = inputs @ mean.reshape(num_classes, width).T  # (N, C)
    logit_variance = inputs**2 @ variance.reshape(num_classes, width).T
    return torch.log_softmax(logit_mean + logit_variance.sqrt() * draws, dim=-1)


#: Preconditioned conjugate gradients of the diagonal fit's mean step: relative residual and
#: iterations at most (the direction is a descent direction at any iteration; the ELBO test
#: accepts or shrinks it).
CG_RTOL, CG_MAX_ITER = 1e-8, 500


def _mean_newton_direction(probs: Tensor, inputs: Tensor, prior_precision: float,
                           gradient: Tensor, precondition: Callable[[Tensor], Tensor],
                           rtol: float | None = None) -> Tensor:
    """``(λI + E_q[H])⁻¹ g`` by preconditioned conjugate gradients, matrix-free: ``E_q[H] v =
    Σ_n (E[diag p − p pᵀ]_n V x_n) x_nᵀ`` costs ``O(N C (m + 1))`` a product, so a diagonal
    fit never forms a ``(d, d)`` matrix. ``precondition`` maps a residual to its
    preconditioned vector: the diagonal fit's Jacobi ``r / (λ + diag E_q[H])``, the full fit's
    ``Σ r``; ``rtol`` (default `CG_RTOL`) the relative residual it stops at.

    Why the full curvature. The ELBO's Hessian in the mean is ``−(λI + E_q[H])`` whatever
    ``Λ``'s structure; a mean-field ``Λ`` keeps only its diagonal. Non-negative, uncentred
    features (pixels, ReLU activations) make the bias and feature columns strongly collinear:
    on digits pixels / 16 (400 points) ``D^{-1/2} (λI + H) D^{-1/2}`` has eigenvalues 0.06 to
    29, so the step ``ρ Λ⁻¹ g`` overshoots unless ``ρ < 2/29`` and then creeps along the
    0.06 directions (the ELBO still rising after 300 evaluations); the Newton direction takes
    every direction at its own curvature.
    """
    num_classes, width = probs.shape[-1], inputs.shape[1]
    block = expected_softmax_hessian(probs)  # (N, C, C)

    def hessian_times(vector: Tensor) -> Tensor:
        logits = inputs @ vector.reshape(num_classes, width).T  # (N, C)
        weighted = torch.einsum("nck,nk->nc", block, logits)
        return (weighted.T @ inputs).reshape(-1) + prior_precision * vector

    solution = torch.zeros_like(gradient)
    residual = gradient.clone()
    preconditioned = precondition(residual)
    direction = preconditioned.clone()
    rz = float(residual @ preconditioned)
    threshold = (CG_RTOL if rtol is None else rtol) * float(gradient.norm())
    for _ in range(CG_MAX_ITER):
        if float(residual.norm()) <= threshold:
            break
        product = hessian_times(direction)
        curvature = float(direction @ product)
        if not curvature > 0:  # rounding at a vanishing residual: keep what is solved
            break
        alpha = rz / curvature
        solution = solution + alpha * direction
        residual = residual - alpha * product
        preconditioned = precondition(residual)
        rz_next = float(residual @ preconditioned)
        direction = preconditioned + (rz_next / rz) * direction
        rz = rz_next
    return solution
