"""Stochastic-gradient Langevin dynamics (Welling & Teh, 2011) over a linear head ("sgld").

Step convention (Welling-Teh), for a step size ``ε``::

    θ ← θ + (ε / 2) · ĝ(θ) + ξ,   ξ ~ N(0, ε I)
    ĝ(θ) = ∇ log p(θ) + (N / n) Σ_{i ∈ batch} ∇ log p(y_i | θ)        (unbiased for ∇ log p(θ|D))

(``posteriors`` writes the same chain as ``θ + ε' ∇ + N(0, 2ε')`` with ``ε' = ε/2``.) For a
Gaussian target of precision Λ the chain is stable for ``ε < 4 / λ_max(Λ)``; its stationary
variance is inflated by about ``1 / (1 − ε λ / 4)`` per eigen-direction, so ``ε`` is chosen small
relative to ``1 / λ_max`` (the default is ``0.1 / L`` with ``L`` an upper bound of λ_max).

Minibatch gradient noise inflates it further: ``ĝ`` has variance ``≈ λ_lik (N / n − 1)`` per
eigen-direction near the posterior (sampling without replacement, ``λ_lik`` the likelihood's
curvature), which adds about ``ε λ_lik (N / n − 1) / 4`` relative variance (7.5 % for
``ε λ = 0.1`` and ``N / n = 4``), so small batches want a smaller ``ε``.

Constant preconditioning (``"laplace"``, the default for heads of up to
`LAPLACE_PRECONDITIONER_MAX_PARAMETERS` parameters): ``θ ← θ + (ε / 2) P ĝ + N(0, ε P)``
with ``P = (λI + H(W*))⁻¹`` the Laplace covariance at the mode ``W*`` (the chains' start) —
Langevin dynamics in the coordinates ``P^{-1/2} θ``, exact for a constant ``P`` (no Γ term). The
plain chain's step is set by the stiffest direction (on network features, whose mean is far from
0, ``λ_max(H)`` exceeds the prior's λ by 10⁵-10⁶, so ``ε = 0.1 / L`` explores the weak
directions ~10⁻⁴ of their posterior variance in the default 3,000 steps); under ``P`` a Gaussian
posterior becomes ``N(0, I)``, and ``ε`` is a fraction of the posterior's own scale: the default
0.05 gives an autocorrelation time of ~``2 / ε = 40`` steps, a stationary variance inflated by
``1 / (1 − ε / 4)`` ≈ 1.3 % (plus ≈ ``ε (N / n − 1) / 4`` of minibatch noise). Where the posterior
is narrower than the Laplace Gaussian the effective step is larger, so ``ε`` stays small.

Preconditioning (``"rmsprop"``, pSGLD of Li et al. 2016): ``V ← α V + (1 − α) ḡ²`` with ``ḡ``
the per-datum mean likelihood gradient (``V`` starts at the first ``ḡ²``), ``G = 1 / (δ + √V)``,
and ``θ ← θ + (ε / 2) G ĝ + N(0, ε G)``. The Γ correction term is omitted, as in the paper; by
default ``G`` is frozen at the end of burn-in, so the sampling phase is a constant-preconditioner
Langevin discretisation, for which Γ is exactly zero.

A run keeps ``num_samples`` states after ``burn_in`` steps, one every ``thinning`` steps.
A state that becomes non-finite or leaves ``|θ| ≤ divergence_threshold`` raises
[`NumericalError`][inference.errors.NumericalError].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.borrowed_evidence import laplace_evidence_prior_precision
from inference.ensemble import EnsemblePosterior
from inference.errors import InvalidInputError, NumericalError
from inference.head_objective import laplace_precision
from inference.hyperparameters import DEFAULT_BOUNDS
from inference.laplace_head import find_mode
from inference.linear_model import training_tensors
from inference.options import Likelihood, Preconditioner, PriorPrecisionMethod

#: ``grad_fn(params, minibatch_index) -> (ĝ, ḡ)``: the stochastic gradient of the log posterior
#: and the per-datum mean likelihood gradient (for the RMSprop preconditioner), for ``params``
#: of shape ``(K, d)`` (K chains), both ``(K, d)``.
GradientFn = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class SGLDState:
    """State of K chains: parameters ``(K, d)``, the RMSprop average (or None), the step count."""

    params: Tensor
    square_avg: Tensor | None
    step: int


#: Largest head (``C (m + 1)`` parameters) whose default preconditioner is ``"laplace"`` (a
#: ``d × d`` covariance and its Cholesky factor); larger heads default to ``"none"``.
LAPLACE_PRECONDITIONER_MAX_PARAMETERS = 3000
#: Default step of the ``"laplace"`` preconditioner (in units of the Laplace covariance).
LAPLACE_STEP_SIZE = 0.05


@dataclass(frozen=True)
class SGLDConfig:
    """Sampler settings (see the module docstring for the update they define).

    ``covariance_factor`` is a factor ``L (d, d)`` of the constant preconditioner ``P = L Lᵀ``
    of ``"laplace"``; ``precision_cholesky`` instead is the lower Cholesky factor ``R (d, d)``
    of ``P⁻¹ = R Rᵀ`` (``L = R⁻ᵀ``), applied by two triangular solves a step, which read half
    of the matrix each where ``L`` is read whole (1.8x faster at d = 1,010, FedPop's head).
    ``"laplace"`` needs one of them (``precision_cholesky`` wins); others ignore both.
    """

    step_size: float
    num_samples: int = 200
    burn_in: int = 1000
    thinning: int = 10
    preconditioner: Preconditioner = Preconditioner.NONE
    rmsprop_alpha: float = 0.99
    rmsprop_delta: float = 1e-5
    freeze_preconditioner: bool = True
    divergence_threshold: float = 1e4
    covariance_factor: Tensor | None = None
    precision_cholesky: Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "preconditioner",
                           Preconditioner.parse(self.preconditioner, "preconditioner"))
        if (self.preconditioner is Preconditioner.LAPLACE and self.covariance_factor is None
                and self.precision_cholesky is None):
            raise InvalidInputError(
                "the 'laplace' preconditioner needs covariance_factor (a factor of the Laplace "
                "covariance) or precision_cholesky (the Cholesky factor of its precision, "
                "laplace_precision_cholesky); fit_sgld_head computes it.")
        if not self.step_size > 0:
            raise InvalidInputError(f"step_size must be positive; got {self.step_size}.")
        if self.num_samples < 1 or self.burn_in < 0 or self.thinning < 1:
            raise InvalidInputError(
                "need num_samples ≥ 1, burn_in ≥ 0 and thinning ≥ 1; got "
                f"{self.num_samples}, {self.burn_in} and {self.thinning}."
            )
        valid = (0 <= self.rmsprop_alpha < 1 and self.rmsprop_delta >= 0
                 and self.divergence_threshold > 0)
        if not valid:
            raise InvalidInputError(
                "need 0 ≤ rmsprop_alpha < 1, rmsprop_delta ≥ 0 and divergence_threshold > 0; "
                f"got {self.rmsprop_alpha}, {self.rmsprop_delta} and {self.divergence_threshold}."
            )


def sgld_update(
    state: SGLDState, grad: Tensor, mean_grad: Tensor, config: SGLDConfig,
    generator: torch.Generator | None, adapt: bool = True,
) -> SGLDState:
    """One Welling-Teh step (plain, Laplace- or RMSprop-preconditioned); returns the new state.

    ``grad`` is ``ĝ`` and ``mean_grad`` the per-datum mean likelihood gradient ``ḡ``, both
    ``(K, d)`` like ``state.params``; ``adapt=False`` keeps the RMSprop average ``V`` fixed.
    """
    params = state.params
    noise = torch.randn(params.shape, dtype=params.dtype, device=params.device,
                        generator=generator)
    eps = config.step_size
    if config.preconditioner is Preconditioner.NONE:
        new = params + 0.5 * eps * grad + eps**0.5 * noise
        return SGLDState(new, None, state.step + 1)
    if config.preconditioner is Preconditioner.LAPLACE:  # P ĝ and N(0, ε P) with P = L Lᵀ
        # (ε/2 ĝ L + √ε ξ) Lᵀ: two passes over the (d, d) factor a step, not three (with d ~
        # 1,000 the factor outgrows the caches and each pass is a read of it from memory)
        chol = config.precision_cholesky
        if chol is not None:  # L = R⁻ᵀ: ĝ L = (R⁻¹ ĝᵀ)ᵀ and u Lᵀ = (R⁻ᵀ uᵀ)ᵀ
            drift = torch.linalg.solve_triangular(chol, grad.T, upper=False).T
            move = (0.5 * eps * drift + eps**0.5 * noise).T
            return SGLDState(params + torch.linalg.solve_triangular(chol.T, move, upper=True).T,
                             None, state.step + 1)
        factor = config.covariance_factor
        new = params + (0.5 * eps * (grad @ factor) + eps**0.5 * noise) @ factor.T
        return SGLDState(new, None, state.step + 1)
    square_avg = state.square_avg
    if square_avg is None:
        square_avg = mean_grad**2
    elif adapt:
        square_avg = config.rmsprop_alpha * square_avg + (1 - config.rmsprop_alpha) * mean_grad**2
    precond = 1.0 / (config.rmsprop_delta + square_avg.sqrt())
    new = params + 0.5 * eps * precond * grad + (eps * precond).sqrt() * noise
    return SGLDState(new, square_avg, state.step + 1)


def run_sgld(
    grad_fn: GradientFn,
    init: Tensor,
    config: SGLDConfig,
    num_data: int,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Run K chains in lockstep from ``init (K, d)``; returns kept states ``(K, num_samples, d)``.

    Each step draws one minibatch of ``batch_size`` of the ``num_data`` rows (uniformly, without
    replacement) shared by the K chains; the Langevin noise is independent per chain.
    ``generator`` drives both (it must live on ``init``'s device).

    Raises:
        NumericalError: a state became non-finite or exceeded ``config.divergence_threshold``.
    """
    state = SGLDState(init.clone(), None, 0)
    total = config.burn_in + config.num_samples * config.thinning
    kept = []
    for t in range(total):
        if batch_size >= num_data:
            index = torch.arange(num_data, device=init.device)
        else:
            index = torch.randperm(num_data, generator=generator,
                                   device=generator.device if generator else init.device)
            index = index[:batch_size].to(init.device)
        grad, mean_grad = grad_fn(state.params, index)
        adapt = not (config.freeze_preconditioner and t >= config.burn_in)
        state = sgld_update(state, grad, mean_grad, config, generator, adapt)
        if not torch.isfinite(state.params).all() or (
            state.params.abs().max() > config.divergence_threshold
        ):
            raise NumericalError(
                f"SGLD diverged at step {t} (step_size {config.step_size:.3g}): |θ| exceeded "
                f"{config.divergence_threshold:g} or became non-finite. Lower the step size."
            )
        if t >= config.burn_in and (t - config.burn_in + 1) % config.thinning == 0:
            kept.append(state.params)
    return torch.stack(kept, dim=1)


def linear_head_gradients(
    params: Tensor, inputs: Tensor, targets: Tensor, num_outputs: int, likelihood: Likelihood,
    noise_std: float,
) -> Tensor:
    """``∇_W Σ_i log p(y_i | W, x_i)`` in closed form for K heads ``params (K, C (m + 1))``.

    Softmax: ``(onehot(y) − p)ᵀ X``; Gaussian: ``((y − f) / σ²)ᵀ X``. Returns ``(K, C (m + 1))``.
    """
    weight = params.reshape(params.shape[0], num_outputs, inputs.shape[1])
    logits = torch.einsum("bp,kcp->kbc", inputs, weight)
    if likelihood is Likelihood.SOFTMAX:
        onehot = torch.nn.functional.one_hot(targets, num_outputs).to(params.dtype)
        residual = onehot - torch.softmax(logits, dim=-1)
    else:
        residual = (targets[:, None] - logits) / noise_std**2
    return torch.einsum("kbc,bp->kcp", residual, inputs).reshape(params.shape)


def curvature_bound(inputs: Tensor, prior_precision: float, likelihood: Likelihood,
                    noise_std: float) -> float:
    """An upper bound ``L`` of λ_max of the negative log posterior's Hessian.

    Softmax: ``diag(p) − p pᵀ ⪯ I / 2``, so ``L = λ + λ_max(XᵀX) / 2``; Gaussian:
    ``L = λ + λ_max(XᵀX) / σ²``. ``inputs`` are bias-augmented ``(N, m + 1)``.
    """
    top = float(torch.linalg.eigvalsh(inputs.T @ inputs)[-1])
    scale = 0.5 if likelihood is Likelihood.SOFTMAX else 1.0 / noise_std**2
    return prior_precision + scale * top


def fit_sgld_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_precision: float | PriorPrecisionMethod | str = PriorPrecisionMethod.MARGLIK,
    prior_mean: float = 0.0,
    step_size: float | None = None,
    num_samples: int = 200,
    burn_in: int = 1000,
    thinning: int = 10,
    num_chains: int = 1,
    batch_size: int | None = 256,
    preconditioner: Preconditioner | str | None = None,
    init: str = "map",
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    divergence_threshold: float = 1e4,
    seed: int = 0,
    prior_precision_bounds: tuple[float, float] = DEFAULT_BOUNDS,
) -> EnsemblePosterior:
    """Sample a linear head's posterior with SGLD; returns the kept draws as an ensemble.

    Args:
        features: ``(N, m)`` features from a fixed body.
        labels: ``(N,)`` labels in ``[0, num_classes)`` (real targets if gaussian).
        num_classes: ``C`` (1 for ``likelihood="gaussian"``).
        prior_precision: ``λ > 0`` of the prior ``N(prior_mean, I/λ)``, or ``"marglik"`` (the
            default): the λ maximising the Laplace evidence of the same model within
            ``prior_precision_bounds`` (`inference.borrowed_evidence`; a sampler's draws
            do not give the evidence).
        step_size: ``ε`` of the Welling-Teh update; default `LAPLACE_STEP_SIZE` with the
            Laplace preconditioner, ``0.1 / L`` (`curvature_bound`) without, ``1e-3``
            with RMSprop.
        num_samples: states kept per chain.
        burn_in: steps discarded first.
        thinning: keep one state in ``thinning``.
        num_chains: chains run in lockstep (vectorised); the ensemble holds
            ``num_chains · num_samples`` draws, chain by chain.
        batch_size: minibatch size ``n ≥ 1`` (``None``: full batch); gradients are scaled by
            N/n.
        preconditioner: ``"laplace"`` (constant, the Laplace covariance at the mode),
            ``"none"`` or ``"rmsprop"`` (pSGLD); default ``"laplace"`` up to
            `LAPLACE_PRECONDITIONER_MAX_PARAMETERS` parameters, ``"none"`` above.
        init: ``"map"`` (start at the mode, found in float64) or ``"prior_mean"``.
        likelihood: ``"softmax"`` (classification) or ``"gaussian"`` (regression).
        noise_std: observation noise ``σ > 0`` of the Gaussian likelihood.
        divergence_threshold: ``|θ|`` beyond which the run is declared diverged.
        seed: seeds the chain's generator (global RNG untouched).
        prior_precision_bounds: ``(lower, upper)`` interval of a chosen λ (default 1e-4, 1e4).

    Returns:
        A float64 `EnsemblePosterior` of ``(num_chains · num_samples, C, m + 1)`` draws
        on the features' device, ``n_data = N``. Its attribute ``prior_selection`` is the
        `HyperparameterChoice` of a chosen λ (value, log
        evidence, whether it hit a bound), or ``None`` for a given number.

    Raises:
        InvalidInputError: bad features, labels or options. NumericalError: divergence.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    if init not in ("map", "prior_mean"):
        raise InvalidInputError(f"init must be 'map' or 'prior_mean'; got {init!r}.")
    choose = _chooses_prior_precision(prior_precision)
    if num_chains < 1 or (batch_size is not None and batch_size < 1):
        raise InvalidInputError(
            f"need num_chains ≥ 1 and batch_size ≥ 1 (or None); got {num_chains} and {batch_size}."
        )
    inputs, targets = training_tensors(features, labels, num_classes, likelihood, noise_std,
                                       torch.float64)
    num_data, width = inputs.shape
    shape = (num_classes, width)
    preconditioner = _resolve_preconditioner(preconditioner, num_classes * width)
    choice = None
    if choose:
        choice = laplace_evidence_prior_precision(
            features, labels, num_classes, prior_mean=prior_mean, likelihood=likelihood,
            noise_std=noise_std, bounds=prior_precision_bounds)
        prior_precision = choice.value
    mode, chol = None, None
    if init == "map" or preconditioner is Preconditioner.LAPLACE:
        mode = find_mode(inputs, targets, num_classes, prior_precision, prior_mean, likelihood,
                         noise_std)
    if preconditioner is Preconditioner.LAPLACE:
        chol = laplace_precision_cholesky(mode, inputs, num_classes, prior_precision,
                                          likelihood, noise_std)
    config = SGLDConfig(
        _default_step_size(step_size, preconditioner, inputs, prior_precision, likelihood,
                           noise_std),
        num_samples, burn_in, thinning, preconditioner,
        divergence_threshold=divergence_threshold, precision_cholesky=chol)
    batch = num_data if batch_size is None else min(int(batch_size), num_data)

    def grad_fn(params: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        lik_grad = linear_head_gradients(params, inputs[index], targets[index], num_classes,
                                         likelihood, noise_std)
        prior_grad = -prior_precision * (params - prior_mean)
        return prior_grad + (num_data / index.shape[0]) * lik_grad, lik_grad / index.shape[0]

    generator = torch.Generator(device=features.device).manual_seed(seed)
    if init == "map":
        start = mode
    else:
        start = torch.full((num_classes * width,), float(prior_mean), dtype=torch.float64,
                           device=features.device)
    draws = run_sgld(grad_fn, start.expand(num_chains, -1), config, num_data, batch, generator)
    posterior = EnsemblePosterior(draws.reshape(-1, *shape), n_data=num_data)
    posterior.prior_selection = choice
    return posterior


def laplace_covariance_factor(mode: Tensor, inputs: Tensor, num_outputs: int,
                              prior_precision: float, likelihood: Likelihood,
                              noise_std: float) -> Tensor:
    """A factor ``F (d, d)`` with ``F Fᵀ = (λI + H(W*))⁻¹``, the Laplace covariance at the flat
    float64 ``mode (d,)`` for bias-augmented ``inputs (N, m + 1)``: ``F = R⁻ᵀ`` for the
    Cholesky factor ``R`` of the precision (jittered if needed; `laplace_precision_cholesky`).
    """
    chol = laplace_precision_cholesky(mode, inputs, num_outputs, prior_precision, likelihood,
                                      noise_std)
    eye = torch.eye(mode.shape[0], dtype=mode.dtype, device=mode.device)
    return torch.linalg.solve_triangular(chol, eye, upper=False).T


def laplace_precision_cholesky(mode: Tensor, inputs: Tensor, num_outputs: int,
                               prior_precision: float, likelihood: Likelihood,
                               noise_std: float) -> Tensor:
    """The lower Cholesky factor ``R (d, d)`` of the Laplace precision ``λI + H(W*)`` at the flat
    float64 ``mode (d,)`` for bias-augmented ``inputs (N, m + 1)`` (jittered if needed): what
    `SGLDConfig`'s ``precision_cholesky`` takes."""
    # no symmetrising passes on a softmax curvature (two transposed ones cost more than the
    # factorisation's own arithmetic at d = 1,010; FedPop factorises it every client round,
    # issue 41): the same factor bit for bit
    return laplace_precision(mode, inputs, num_outputs, prior_precision, likelihood,
                             noise_std)[1]


def _resolve_preconditioner(value: Preconditioner | str | None, dim: int) -> Preconditioner:
    """The preconditioner asked for, or the default for a head of ``dim`` parameters."""
    if value is None:
        return (Preconditioner.LAPLACE if dim <= LAPLACE_PRECONDITIONER_MAX_PARAMETERS
                else Preconditioner.NONE)
    return Preconditioner.parse(value, "preconditioner")


def _default_step_size(step_size: float | None, preconditioner: Preconditioner, inputs: Tensor,
                       prior_precision: float, likelihood: Likelihood, noise_std: float
                       ) -> float:
    """``step_size``, or the documented default of ``preconditioner``."""
    if step_size is not None:
        return step_size
    if preconditioner is Preconditioner.LAPLACE:
        return LAPLACE_STEP_SIZE
    if preconditioner is Preconditioner.NONE:
        return 0.1 / curvature_bound(inputs, prior_precision, likelihood, noise_std)
    return 1e-3


def _chooses_prior_precision(value: object) -> bool:
    """True for ``"marglik"``, False for a valid positive number; else InvalidInputError."""
    if isinstance(value, str):
        method = PriorPrecisionMethod.parse(value, "prior_precision")
        if method is not PriorPrecisionMethod.MARGLIK:
            raise InvalidInputError(
                f"SGLD chooses its prior precision by 'marglik' only; got {value!r}. A "
                "held-out grid would rerun the chains at every λ: pass a number found that way.")
        return True
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise InvalidInputError(
            f"prior_precision must be a finite number > 0 or 'marglik'; got {value!r}.")
    return False
