"""Laplace approximation of a linear head on fixed features ("laplace" in the factory), and the
KL-optimal Gaussian started from it (the default; see `fit_laplace_head`).

Model: ``W ~ N(μ₀, I/λ)`` over the ``(C, m + 1)`` head (bias in column 0) and
``y ~ Categorical(softmax(W [1, x]))`` (or ``Normal(W [1, x], σ²)`` with ``likelihood="gaussian"``,
``C = 1``). The mode ``W*`` of the log posterior is found in float64 by damped Newton (exact
Hessian) or L-BFGS; the posterior is ``N(W*, (λI + H)⁻¹)`` with ``H`` the exact Hessian of the
negative log likelihood at ``W*``:

    H = Σ_n (diag(p_n) − p_n p_nᵀ) ⊗ x_n x_nᵀ      (softmax; the GGN and the Hessian coincide)

stored full, diagonal (``diag(H)``) or low rank (top ``rank`` eigenpairs of ``H`` plus the
diagonal remainder, so ``diag(H)`` is kept exactly). The returned `GaussianPosterior`'s
likelihood term is ``(H, H W* + λ(W* − μ₀))``: prior + likelihood reproduces the local Laplace
posterior, and K clients combine by adding their terms. By default the fitter goes on from this
Laplace posterior to the KL-optimal Gaussian (`inference.variational_gaussian`), whose
likelihood term is ``(E_q[H], E_q[H] μ + λ(μ − μ₀))``, the same algebra.

The prior precision ``λ`` is by default the maximiser of the Laplace log evidence over ``log λ``
(``prior_precision="marglik"``, refitting the mode at every ``λ``), or the validation-NLL grid
point (``"validation"``), or a given number; `inference.hyperparameters` does the search
and the fitted posterior's ``prior_selection`` records the outcome.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import (
    FullPrecision,
    GaussianPosterior,
    GaussianTerm,
    cholesky_with_jitter,
    solve_with_factor,
)
from inference.head_objective import (
    likelihood_hessian,
    likelihood_hessian_diagonal,
    negative_log_posterior,
)
from inference.hyperparameters import (
    DEFAULT_BOUNDS,
    Criterion,
    HyperparameterChoice,
    check_bounds,
    search_log_space,
)
from inference.laplace_marglik import EvidenceSearch, LastPrecision, newton_cg
from inference.linear_model import log_likelihood, training_tensors
from inference.options import (
    CovarianceStructure,
    GaussianApproximation,
    Likelihood,
    MapSolver,
    PredictiveMethod,
    PriorPrecisionMethod,
)
from inference.variational_gaussian import (
    DEFAULT_ELBO_MAX_ITER,
    DEFAULT_NUM_DRAWS,
    variational_gaussian,
)

#: The prior precision at which the ``"marglik"`` search starts (clamped to the bounds). Only the
#: work depends on it, not the maximiser: heads on network features have their evidence's
#: maximiser at λ ≈ 1-10 (S1: 5.5-9.3), and starting at 3 rather than at 1 (the middle of the
#: default bounds) saved 5-9 of 22-28 Newton iterations (the cold mode at 1 takes 9; issue 41).
SEARCH_START = 3.0
#: Above this many parameters a Gaussian likelihood's default solver is L-BFGS (its Newton
#: factorises a d×d matrix per step). A softmax head's Newton is matrix-free (`newton_cg`) and
#: its default at every size: above this size L-BFGS's default took 6x longer to the same mode
#: (4,010 parameters, 1,500 rows of ReLU features) and, on the 5,130-parameter head of 3,000
#: MNIST rows of bench/laplace_head_speed.py at λ = 1, stopped at a gradient of 1.1e-5 after
#: 500 iterations, short of its 1e-10 test (issue 41).
NEWTON_MAX_PARAMETERS = 3000


def _newton(objective, hessian_fn, start: Tensor, prior_precision: float, max_iter: int,
            tol: float) -> Tensor:
    """Damped Newton with Armijo backtracking on a strictly convex objective.

    Stops when half the squared Newton decrement, ``gᵀ (λI + H)⁻¹ g / 2``, is at most ``tol``
    (nats: the predicted distance to the minimum's value).
    """
    theta = start.clone()
    decrement = float("nan")
    for _ in range(max_iter):
        theta_req = theta.detach().requires_grad_(True)
        value = objective(theta_req)
        (grad,) = torch.autograd.grad(value, theta_req)
        precision = hessian_fn(theta) + prior_precision * torch.eye(
            theta.shape[0], dtype=theta.dtype, device=theta.device)
        step = solve_with_factor(cholesky_with_jitter(precision), -grad[:, None])[:, 0]
        decrement = float(-(grad @ step))  # Newton decrement², ≥ 0
        if decrement / 2 <= tol:  # in the quadratic regime: one last full step
            return theta + step
        t = 1.0
        with torch.no_grad():
            while objective(theta + t * step) > value - 0.25 * t * decrement and t > 1e-10:
                t *= 0.5
        theta = theta + t * step
    raise NumericalError(
        f"Newton did not converge in {max_iter} iterations (last Newton decrement "
        f"{decrement:.3e}); raise max_iter, or pass a larger prior_precision (a number, or "
        "prior_precision_bounds with a larger lower end)."
    )


def _lbfgs(objective, start: Tensor, max_iter: int, tol: float) -> Tensor:
    """L-BFGS (strong Wolfe) from ``start``; raises unless the gradient max-norm ends ≤ 1e-6."""
    theta = start.clone().requires_grad_(True)
    optimiser = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, history_size=50,
                                  tolerance_grad=tol, tolerance_change=1e-15,
                                  line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimiser.zero_grad()
        value = objective(theta)
        value.backward()
        return value

    optimiser.step(closure)
    grad_norm = float(theta.grad.abs().max())
    if not grad_norm <= max(tol * 1e3, 1e-6):
        raise NumericalError(
            f"L-BFGS stopped with gradient max-norm {grad_norm:.3e} after {max_iter} "
            "iterations; raise max_iter or use solver='newton'."
        )
    return theta.detach()


def find_mode(
    inputs: Tensor, targets: Tensor, num_outputs: int, prior_precision: float,
    prior_mean: float | Tensor = 0.0, likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0, solver: MapSolver | str | None = None, max_iter: int = 100,
    tol: float = 1e-12,
    start: Tensor | None = None,
) -> Tensor:
    """Mode of the log posterior as a flat float64 ``(C (m + 1),)`` vector.

    ``inputs`` are bias-augmented features ``(N, m + 1)`` (float64), ``targets`` int64 labels
    ``(N,)`` (or float64 reals, gaussian). ``solver`` defaults to Newton (a Gaussian
    likelihood's up to `NEWTON_MAX_PARAMETERS` parameters, L-BFGS above); a softmax head's
    Newton solves its steps matrix-free (`newton_cg`, no factorisation), and
    factorises only if that has not converged in ``max_iter`` steps. ``max_iter`` bounds Newton's
    iterations (L-BFGS gets at least 500 function evaluations); ``tol`` is Newton's stopping
    threshold on half the squared Newton decrement, in nats. ``start`` (a flat ``(d,)`` vector,
    default every weight at ``prior_mean``) is where the solver starts: the objective is
    strictly convex, so the start changes the iterations, not the mode.

    Raises:
        NumericalError: the solver did not converge.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    if max_iter < 1:
        raise InvalidInputError(f"max_iter must be at least 1; got {max_iter}.")
    d = num_outputs * inputs.shape[1]
    matrix_free = likelihood is Likelihood.SOFTMAX
    solver = MapSolver.parse(
        solver or ("newton" if matrix_free or d <= NEWTON_MAX_PARAMETERS else "lbfgs"),
        "solver")
    if start is None and isinstance(prior_mean, Tensor):
        start = prior_mean.to(device=inputs.device, dtype=torch.float64).reshape(-1).clone()
    elif start is None:
        start = torch.full((d,), float(prior_mean), dtype=torch.float64, device=inputs.device)

    def objective(theta: Tensor) -> Tensor:
        return negative_log_posterior(theta, inputs, targets, num_outputs, prior_precision,
                                      prior_mean, likelihood, noise_std)

    if solver is MapSolver.NEWTON and likelihood is Likelihood.SOFTMAX:
        # matrix-free Newton-CG, the same stopping rule (issue 41); the factorising Newton
        # below only if it has not converged in max_iter steps
        one_hot = torch.nn.functional.one_hot(targets, num_outputs).to(torch.float64)
        start, converged = newton_cg(objective, inputs, one_hot, prior_precision, prior_mean,
                                     start, tol, max_iter)
        if converged:
            return start
    if solver is MapSolver.NEWTON:
        def hessian_fn(theta: Tensor) -> Tensor:
            return likelihood_hessian(theta, inputs, num_outputs, likelihood, noise_std)

        return _newton(objective, hessian_fn, start, prior_precision, max_iter, tol)
    return _lbfgs(objective, start, max(max_iter, 500), 1e-10)


def fit_laplace_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_precision: float | PriorPrecisionMethod | str = PriorPrecisionMethod.MARGLIK,
    prior_mean: float | Tensor = 0.0,
    structure: CovarianceStructure | str = CovarianceStructure.FULL,
    rank: int = 20,
    solver: MapSolver | str | None = None,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    max_iter: int = 100,
    prior_precision_bounds: tuple[float, float] = DEFAULT_BOUNDS,
    validation_data: tuple[Tensor, Tensor] | None = None,
    validation_method: PredictiveMethod | str = PredictiveMethod.CENTRED_PROBIT,
    approximation: GaussianApproximation | str = GaussianApproximation.VARIATIONAL,
    num_draws: int = DEFAULT_NUM_DRAWS,
    elbo_max_iter: int = DEFAULT_ELBO_MAX_ITER,
    seed: int = 0,
) -> GaussianPosterior:
    """Gaussian posterior of a linear head on fixed features: Laplace, or (the default) the
    KL-optimal Gaussian started from it.

    The Gaussian (``approximation``). ``"laplace"`` is ``N(W*, (λI + H(W*))⁻¹)``, laplace-torch's
    approximation. ``"variational"`` (default) is the Gaussian closest to the posterior in
    ``KL(q ‖ p)``, ``Λ = λI + E_q[H]`` (`inference.variational_gaussian`), found from the
    Laplace one. They differ where the network's features separate the training set: the
    curvature at the mode then vanishes for almost every point, and the Laplace Gaussian is as
    wide as the prior, putting mass on heads the data rule out; its predictive is far less
    confident than the posterior's. On the digits MLP of issue 12 (three seeds, ``λ`` by
    evidence) the Laplace predictive has ECE 0.44-0.50 where the variational one has 0.02 and
    Hamiltonian Monte Carlo on the same posterior 0.014 (``bench/heads_calibration.py``).

    The prior precision ``λ`` is a number, or chosen from the data (the default, ``"marglik"``):

    * ``"marglik"`` maximises the Laplace log evidence (`log_marginal_likelihood`) over
      ``log λ`` in ``prior_precision_bounds``: with a full covariance, the secant method on
      a residual with the root of the evidence's exact slope, from ``λ = 3``
      (``EvidenceSearch.search_secant`` in `inference.laplace_marglik`: 3-4 refits on S1's
      heads, to ~1e-2 relative in ``λ``, ``LAMBDA_RTOL``); with a
      diagonal or low-rank one, a grid of one point a decade, then bounded Brent to 1e-6 in
      ``log λ`` (`inference.hyperparameters`). The mode is **refitted** at every
      ``λ`` (each evaluation is the Laplace evidence of the model with that prior, at that
      prior's mode), not held at one MAP as laplace-torch's ``optimize_prior_precision`` holds
      the network's: a head's MAP is cheap to refit, and the evidence formula evaluated away
      from the mode is not the Laplace approximation of anything. At the mode's own ``λ`` the
      two agree (the tests check the value against laplace-torch's).
      The evidence is the Laplace one whichever ``approximation`` is returned (the
      variational Gaussian is then fitted at the chosen ``λ``).
    * ``"validation"`` takes the ``λ`` of a log grid (5 points a decade over the bounds) whose
      posterior (of the requested ``approximation``) has the lowest NLL on ``validation_data``
      with ``validation_method`` (laplace-torch's ``gridsearch``).

    Args:
        features: ``(N, m)`` features from a fixed body (any float dtype, any device).
        labels: ``(N,)`` integer labels in ``[0, num_classes)`` (real targets if gaussian).
        num_classes: ``C`` (use 1 for ``likelihood="gaussian"``).
        prior_precision: ``λ > 0`` of the isotropic prior ``N(prior_mean, I/λ)``, or
            ``"marglik"`` / ``"validation"`` (see above).
        prior_mean: ``μ₀``, the prior mean: one number for every weight, or a tensor of the
            head's shape ``(C, m + 1)`` (bias column first, or flat ``(C (m + 1),)``), e.g. a
            federation's global head as the prior of a client's own.
        structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (top-``rank`` eigenpairs + diagonal);
            the evidence maximised is that of this structure's own precision.
        rank: ``r ≥ 1`` of the low-rank structure (capped at ``d = C (m + 1)``).
        solver: ``"newton"`` or ``"lbfgs"`` for the mode (default: Newton; a Gaussian
            likelihood's L-BFGS above `NEWTON_MAX_PARAMETERS`, see `find_mode`).
        likelihood: ``"softmax"`` (classification) or ``"gaussian"`` (regression).
        noise_std: observation noise ``σ > 0`` of the Gaussian likelihood.
        max_iter: Newton iterations at most of every mode (see `find_mode`).
        prior_precision_bounds: ``(lower, upper)`` search interval of ``λ`` (default 1e-4, 1e4).
        validation_data: ``(features (V, m), labels (V,))`` held out from training, for
            ``prior_precision="validation"``.
        validation_method: the predictive whose validation NLL is minimised.
        approximation: ``"variational"`` (default) or ``"laplace"`` (see above); a Gaussian
            likelihood makes both the exact posterior, and ``"laplace"`` is returned.
        num_draws: logit draws per training point of ``"variational"`` (the result is
            deterministic given them and ``seed``).
        elbo_max_iter: ELBO evaluations at most of ``"variational"``
            (`variational_gaussian`).
        seed: the seed of those draws.

    Returns:
        A float64 `GaussianPosterior` over the ``(C, m + 1)`` head, on the features'
        device, with ``n_data = N``. Its attribute ``prior_selection`` is the
        `HyperparameterChoice` (the chosen ``λ``, the
        criterion there, and whether it hit a bound), or ``None`` for a given number; it is a
        record of the fit, not part of the posterior's state (``to`` and ``state_dict`` drop it).

    Raises:
        InvalidInputError: bad features, labels or options. NumericalError: no convergence.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    structure = CovarianceStructure.parse(structure, "structure")
    if structure is CovarianceStructure.LOWRANK and rank < 1:
        raise InvalidInputError(f"rank must be at least 1 for a low-rank structure; got {rank}.")
    method = _prior_precision_method(prior_precision)
    inputs, targets = training_tensors(features, labels, num_classes, likelihood, noise_std,
                                       torch.float64)
    prior_mean = _prior_mean(prior_mean, num_classes * inputs.shape[1], inputs.device)
    approximation = GaussianApproximation.parse(approximation, "approximation")
    if likelihood is Likelihood.GAUSSIAN:  # the Laplace posterior is exact
        approximation = GaussianApproximation.LAPLACE
    fit = _LaplaceFit(inputs, targets, num_classes, prior_mean, structure, rank, solver,
                      likelihood, noise_std, max_iter)
    if int(elbo_max_iter) < 1:
        raise InvalidInputError(f"elbo_max_iter must be at least 1; got {elbo_max_iter}.")
    fit.approximation, fit.num_draws, fit.seed = approximation, num_draws, seed
    fit.elbo_max_iter = int(elbo_max_iter)
    choice: HyperparameterChoice | None = None
    if method is None:
        value = float(prior_precision)
    else:
        if method is PriorPrecisionMethod.MARGLIK:
            choice = fit.newton_evidence_search(prior_precision_bounds)
            criterion = Criterion(fit.log_evidence, "log_evidence", method.value, maximise=True)
        else:
            criterion = Criterion(fit.validation_nll(validation_data, PredictiveMethod.parse(
                validation_method, "validation_method")), "validation_nll", method.value,
                maximise=False)
        if choice is None:
            choice = search_log_space(criterion, "prior_precision", prior_precision_bounds,
                                      points_per_decade=_GRID_DENSITY[method],
                                      refine=method is PriorPrecisionMethod.MARGLIK)
        value = choice.value
    posterior = fit.final(value)
    if (choice is not None and choice.method == "marglik" and choice.at_bound is None
            and fit.last_laplace is not None):
        # The Newton search's last evidence is at an iterate one tiny step from the mode:
        # report the returned Laplace posterior's own (what log_marginal_likelihood computes).
        # A KL-optimal Gaussian started from that iterate's precision keeps the search's.
        choice = dataclasses.replace(choice, criterion=_log_evidence(
            fit.last_laplace, inputs, targets, likelihood, noise_std))
    posterior.prior_selection = choice
    return posterior


#: Coarse-grid points per decade: marglik refines by Brent, validation keeps the grid.
_GRID_DENSITY = {PriorPrecisionMethod.MARGLIK: 1, PriorPrecisionMethod.VALIDATION: 5}


def _prior_mean(value: float | Tensor, dim: int, device: torch.device) -> float | Tensor:
    """A number as it is; a tensor as a flat float64 ``(dim,)`` on ``device`` (it must hold
    ``dim`` finite values)."""
    if not isinstance(value, Tensor):
        return value
    if value.numel() != dim or not value.is_floating_point():
        raise InvalidInputError(
            f"a tensor prior_mean must hold one float per head weight, {dim} (shape (C, m + 1), "
            f"bias column first); got shape {tuple(value.shape)} of {value.dtype}.")
    flat = value.detach().to(device=device, dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise InvalidInputError("prior_mean contains NaN or inf.")
    return flat


def _prior_precision_method(value: object) -> PriorPrecisionMethod | None:
    """The selection method named by ``value``, or ``None`` for a valid positive number."""
    if isinstance(value, str):
        return PriorPrecisionMethod.parse(value, "prior_precision")
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise InvalidInputError(
            f"prior_precision must be a finite number > 0, 'marglik' or 'validation'; got "
            f"{value!r}.")
    return None


class _LaplaceFit:
    """The training set and options of one `fit_laplace_head` call: posteriors at any
    prior precision (each mode warm-started from the last one found) and the criteria the
    prior precision is chosen by."""

    def __init__(self, inputs: Tensor, targets: Tensor, num_classes: int,
                 prior_mean: float | Tensor,
                 structure: CovarianceStructure, rank: int, solver: MapSolver | str | None,
                 likelihood: Likelihood, noise_std: float, max_iter: int) -> None:
        self.inputs, self.targets, self.num_classes = inputs, targets, num_classes
        self.prior_mean, self.structure, self.rank = prior_mean, structure, rank
        self.solver, self.likelihood, self.noise_std = solver, likelihood, noise_std
        self.max_iter = max_iter
        self.approximation = GaussianApproximation.LAPLACE
        self.num_draws, self.seed = DEFAULT_NUM_DRAWS, 0
        self.elbo_max_iter = DEFAULT_ELBO_MAX_ITER
        self._last_mode: Tensor | None = None
        self._searched: tuple[float, Tensor] | None = None  # (λ, mode) of the evidence search
        self._search_precision: LastPrecision | None = None  # its last refit's λI + H
        self.last_laplace: GaussianPosterior | None = None

    def posterior(self, prior_precision: float) -> GaussianPosterior:
        """The Laplace posterior at ``prior_precision`` (mode refitted, unless the evidence
        search found it at this very ``λ``)."""
        if self._searched is not None and self._searched[0] == prior_precision:
            mode = self._searched[1]
        else:
            mode = find_mode(self.inputs, self.targets, self.num_classes, prior_precision,
                             self.prior_mean, self.likelihood, self.noise_std, self.solver,
                             self.max_iter, start=self._last_mode)
        self._last_mode = mode
        return laplace_posterior(mode, self.inputs, self.num_classes, prior_precision,
                                 self.prior_mean, self.structure, self.rank, self.likelihood,
                                 self.noise_std)

    def newton_evidence_search(self, bounds: tuple[float, float]) -> HyperparameterChoice | None:
        """The ``"marglik"`` choice by `EvidenceSearch` (its
        secant search, a handful of mode refits; its former Newton search if that does not
        converge), where it applies: a full covariance and Newton modes. ``None`` elsewhere,
        or if neither converges: the caller then runs the grid-and-Brent search, which
        maximises the same function."""
        d = self.num_classes * self.inputs.shape[1]
        # A full covariance factorises a (d, d) precision at every λ anyway, so Newton's own
        # factorisations cost nothing more at any d: the default solver is Newton here (at
        # d = 5,130 L-BFGS's refits also stopped short of its 1e-6 gradient test).
        solver = MapSolver.parse(self.solver or "newton", "solver")
        if self.structure is not CovarianceStructure.FULL or solver is not MapSolver.NEWTON:
            return None
        lower, upper = check_bounds(bounds, "prior_precision_bounds")
        search = EvidenceSearch(self.inputs, self.targets, self.num_classes, self.prior_mean,
                                self.likelihood, self.noise_std, self.max_iter)
        start = (self.prior_mean.clone() if isinstance(self.prior_mean, Tensor) else
                 torch.full((d,), float(self.prior_mean), dtype=torch.float64,
                            device=self.inputs.device))
        initial = min(max(SEARCH_START, lower), upper)
        try:
            choice, mode = search.search_secant((lower, upper), start, initial)
        except NumericalError:
            try:
                choice, mode = search.search((lower, upper), start, initial)
            except NumericalError:
                return None
        self._last_mode = mode
        self._searched = (choice.value, mode)
        self._search_precision = search.last_precision
        return choice

    def final(self, prior_precision: float) -> GaussianPosterior:
        """The posterior of the requested approximation at ``prior_precision``."""
        searched = self._search_precision
        if (self.approximation is GaussianApproximation.VARIATIONAL and searched is not None
                and self._searched is not None and self._searched[0] == prior_precision
                and searched.prior_precision == prior_precision):
            # the evidence search's last refit has the Laplace precision at (one Newton step of
            # ≤ 1e-12 nats from) this mode already: the KL-optimal Gaussian starts from it,
            # without a curvature and a factorisation more (issue 41)
            self.last_laplace = None
            return self.variational(self._searched[1], searched.precision, searched.chol,
                                    prior_precision, self.num_draws, self.seed,
                                    searched.covariance, searched.logit_covariance)
        laplace = self.posterior(prior_precision)
        self.last_laplace = laplace
        if self.approximation is GaussianApproximation.LAPLACE:
            return laplace
        diagonal = self.structure is CovarianceStructure.DIAG
        start = (laplace.natural.precision_diagonal() if diagonal
                 else laplace.natural.precision_matrix())
        precision = laplace.natural.precision
        # the factor the Laplace posterior caches (its evidence reuses it): one fewer (d, d)
        # factorisation (issue 41)
        factor = precision.cholesky() if isinstance(precision, FullPrecision) else None
        return self.variational(laplace.flat_mean.to(torch.float64), start, factor,
                                prior_precision, self.num_draws, self.seed)

    def variational(self, mode: Tensor, start: Tensor, factor: Tensor | None,
                    prior_precision: float, num_draws: int, seed: int,
                    covariance: Tensor | None = None,
                    logit_covariance: Tensor | None = None) -> GaussianPosterior:
        """The KL-optimal Gaussian at ``prior_precision``, started from the Laplace one:
        ``mode``, its precision ``start`` (``(d, d)``, or ``(d,)`` for a diagonal structure)
        and, for a full one, its lower Cholesky factor ``factor``, its inverse ``covariance``
        and the training points' logit covariances under it (each None where not at hand)."""
        diagonal = self.structure is CovarianceStructure.DIAG
        mean, curvature, factored = variational_gaussian(
            mode, start, self.inputs, self.targets,
            self.num_classes, prior_precision, self.prior_mean, diagonal=diagonal,
            num_draws=num_draws, elbo_max_iter=self.elbo_max_iter, seed=seed,
            start_factor=factor, start_covariance=covariance,
            start_logit_covariance=logit_covariance, return_factor=True)
        return gaussian_head_posterior(mean, curvature, self.inputs.shape, self.num_classes,
                                       prior_precision, self.prior_mean, self.structure,
                                       self.rank, factored)

    def log_evidence(self, prior_precision: float) -> float:
        """Laplace log evidence at ``prior_precision`` (nats)."""
        return _log_evidence(self.posterior(prior_precision), self.inputs, self.targets,
                             self.likelihood, self.noise_std)

    def validation_nll(self, validation_data: tuple[Tensor, Tensor] | None,
                       method: PredictiveMethod):
        """``λ -> mean validation NLL`` (nats) of the posterior's ``method`` predictive."""
        if validation_data is None:
            raise InvalidInputError(
                "prior_precision='validation' needs validation_data=(features, labels) held "
                "out from training; or use prior_precision='marglik' (training data only).")
        try:
            val_features, val_targets = validation_data
        except (TypeError, ValueError):
            raise InvalidInputError(
                "validation_data must be a pair (features (V, m), labels (V,)).") from None
        from inference.inputs import as_features, as_labels, as_targets

        val_features = as_features(val_features, self.inputs.shape[1] - 1,
                                   "validation features")
        rows, device = val_features.shape[0], val_features.device
        val_targets = (as_targets(val_targets, rows, device=device)
                       if self.likelihood is Likelihood.GAUSSIAN else
                       as_labels(val_targets, rows, self.num_classes, device=device,
                                 name="validation labels"))
        val_inputs, val_targets = training_tensors(
            val_features, val_targets, self.num_classes, self.likelihood, self.noise_std,
            torch.float64)
        val_inputs = val_inputs.to(self.inputs.device)
        val_targets = val_targets.to(self.inputs.device)
        generator = torch.Generator(device=self.inputs.device)

        def criterion(prior_precision: float) -> float:
            posterior = self.final(prior_precision)
            generator.manual_seed(0)  # MC predictive: the same draws' noise at every λ
            return _predictive_nll(posterior, val_inputs[:, 1:], val_targets, method,
                                   self.likelihood, self.noise_std, generator)

        return criterion


def _predictive_nll(posterior: GaussianPosterior, features: Tensor, targets: Tensor,
                    method: PredictiveMethod, likelihood: Likelihood, noise_std: float,
                    generator: torch.Generator) -> float:
    """Mean NLL (nats) of held-out ``targets`` under the posterior predictive."""
    if likelihood is Likelihood.GAUSSIAN:  # exact: N(f̄, v + σ²)
        mean, variance = posterior.logit_moments(features)
        predictive = torch.distributions.Normal(mean[:, 0], (variance[:, 0] + noise_std**2)
                                                .sqrt())
        return float(-predictive.log_prob(targets).mean())
    probs = posterior.predict_proba(features, method=method, generator=generator)
    picked = probs.gather(1, targets[:, None])[:, 0]
    return float(-torch.log(picked.clamp_min(torch.finfo(probs.dtype).tiny)).mean())


def laplace_posterior(
    mode: Tensor, inputs: Tensor, num_classes: int, prior_precision: float,
    prior_mean: float | Tensor, structure: CovarianceStructure, rank: int,
    likelihood: Likelihood, noise_std: float,
) -> GaussianPosterior:
    """The Laplace posterior ``N(W*, (λI + H)⁻¹)`` at a flat float64 ``mode`` for bias-augmented
    ``inputs (N, m + 1)``, with the likelihood term ``(H, H W* + λ(W* − μ₀))`` in ``structure``
    (``H`` exact, its diagonal, or its top-``rank`` eigenpairs plus the diagonal remainder)."""
    if structure is CovarianceStructure.DIAG:
        curvature = likelihood_hessian_diagonal(mode, inputs, num_classes, likelihood, noise_std)
    else:
        curvature = likelihood_hessian(mode, inputs, num_classes, likelihood, noise_std)
    return gaussian_head_posterior(mode, curvature, inputs.shape, num_classes, prior_precision,
                                   prior_mean, structure, rank)


def gaussian_head_posterior(
    mean: Tensor, curvature: Tensor, input_shape: tuple[int, int], num_classes: int,
    prior_precision: float, prior_mean: float | Tensor, structure: CovarianceStructure,
    rank: int, factored: tuple[Tensor, Tensor, Tensor] | None = None,
) -> GaussianPosterior:
    """``N(mean, (λI + K)⁻¹)`` over a ``(C, m + 1)`` head with the likelihood term
    ``(K, K mean + λ(mean − μ₀))`` in ``structure``: ``K`` is a ``(d, d)`` curvature (the
    Hessian at the mode, or its expectation) kept dense or cut to its top-``rank`` eigenpairs
    plus the diagonal remainder, or its ``(d,)`` diagonal for ``"diag"``. ``factored``: ``(Λ,
    chol(Λ), Λ⁻¹)`` the fit computed for its precision (`variational_gaussian`'s
    ``return_factor``); a full posterior whose total precision equals ``Λ`` bit for bit takes
    them (`FullPrecision.adopt_factor`: its first prediction then factorises nothing)."""
    shape = (num_classes, input_shape[1])
    d = mean.shape[0]
    prior = GaussianTerm.isotropic(d, prior_precision, prior_mean, device=mean.device)
    prior_shift = prior_precision * (mean - prior_mean)
    if structure is CovarianceStructure.DIAG:
        lik = GaussianTerm(structure, curvature * mean + prior_shift, diag=curvature)
    elif structure is CovarianceStructure.FULL:
        lik = GaussianTerm(structure, curvature @ mean + prior_shift,
                           dense=0.5 * (curvature + curvature.T))
    else:
        eigenvalues, eigenvectors = torch.linalg.eigh(curvature)
        keep = min(int(rank), d)
        factor = eigenvectors[:, d - keep:] * eigenvalues[d - keep:].clamp_min(0.0).sqrt()
        remainder = (curvature.diagonal() - (factor**2).sum(1)).clamp_min(0.0)
        # The low-rank term's shift is Λ_lr mean + λ(mean − μ₀) so that its mean is still mean.
        low_rank = GaussianTerm(structure, torch.zeros_like(mean), diag=remainder, factor=factor)
        lik = GaussianTerm(structure, low_rank.matvec(mean) + prior_shift, diag=remainder,
                           factor=factor)
    posterior = GaussianPosterior(prior, lik, shape, n_data=input_shape[0])
    if factored is not None and structure is CovarianceStructure.FULL:
        precision, chol, covariance = factored
        total = posterior.natural.precision
        if isinstance(total, FullPrecision) and torch.equal(total.dense, precision):
            total.adopt_factor(chol, covariance)
    return posterior


def log_marginal_likelihood(
    posterior: GaussianPosterior,
    features: Tensor,
    labels: Tensor,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
) -> float:
    """Laplace approximation of the log evidence ``log p(y | X, λ)``, in nats.

    ``log p(y|W*) + log p(W*) + (d/2) log 2π − ½ log|Λ|`` for a posterior from
    `fit_laplace_head` with ``approximation="laplace"`` on the same data (its mean is the
    mode ``W*``, its precision ``Λ``; a diag or low-rank posterior uses its own ``Λ``). Exact
    for the Gaussian likelihood.
    This is what ``prior_precision="marglik"`` maximises; laplace-torch's
    ``log_marginal_likelihood`` gives the same value for the same head at its mode.

    Args:
        posterior: a Laplace posterior over a ``(C, m + 1)`` head with a diagonal prior.
        features: ``(N, m)`` training features; ``labels``: ``(N,)`` (same device as features).
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    prior = posterior.prior
    if prior.structure is not CovarianceStructure.DIAG or len(posterior.shape) != 2:
        raise InvalidInputError(
            "log_marginal_likelihood needs a posterior over a (C, m + 1) head with a diagonal "
            f"prior; got shape {posterior.shape} and a {prior.structure} prior."
        )
    inputs, targets = training_tensors(features, labels, posterior.shape[0], likelihood,
                                       noise_std, torch.float64)
    return _log_evidence(posterior, inputs.to(posterior.device), targets.to(posterior.device),
                         likelihood, noise_std)


def _log_evidence(posterior: GaussianPosterior, inputs: Tensor, targets: Tensor,
                  likelihood: Likelihood, noise_std: float) -> float:
    """`log_marginal_likelihood` for bias-augmented float64 ``inputs`` on the device."""
    mode = posterior.mean.to(torch.float64)
    log_lik = log_likelihood(mode, inputs, targets, likelihood, noise_std)
    prior_diag = posterior.prior.diag.to(torch.float64)
    prior_mean = posterior.prior.shift.to(torch.float64) / prior_diag
    flat = mode.reshape(-1)
    d = flat.shape[0]
    log_prior = 0.5 * (torch.log(prior_diag).sum() - d * math.log(2 * math.pi)
                       - (prior_diag * (flat - prior_mean) ** 2).sum())
    log_det = posterior.log_det_precision()
    return float(log_lik + log_prior + 0.5 * d * math.log(2 * math.pi) - 0.5 * log_det)
