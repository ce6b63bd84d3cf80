"""Mean-field variational inference of a linear head with pyro-ppl ("mfvi" in the factory).

Model (a `pyro.nn.PyroModule`): ``W ~ N(μ₀, I/λ)`` over the ``(C, m + 1)`` head (bias in
column 0) and ``y_n ~ Categorical(softmax(W [1, x_n]))`` (or ``Normal(W [1, x_n], σ²)`` with
``likelihood="gaussian"``, ``C = 1``) inside ``pyro.plate("data", size=N, subsample=idx)``, so a
minibatch's log likelihood is scaled by ``N / len(idx)`` and the ELBO is unbiased.

Guide: ``AutoNormal`` (default) or ``AutoDiagonalNormal``, both a diagonal Gaussian, trained with
``Trace_ELBO`` used as a module and a torch Adam optimiser (exponentially decayed learning rate).
Both start at the prior mean (on a fresh tensor: see `init_to_prior_mean_copy`).
The fitted guide is exported as a diagonal `GaussianPosterior`
(mean = guide loc, variance = guide scale²); nothing of pyro survives the fit.

Isolation: pyro keeps parameters in a process-global store keyed by site name, so two heads
fitted in one process (simulated clients) would share ``AutoNormal.locs.weight``. Each fit runs
with ``pyro.settings.context(module_local_params=True)`` (parameters live in the guide module)
*and* inside ``pyro.get_param_store().scope()`` (a private, empty store that is restored after),
and the torch RNG is forked and seeded, so a fit neither reads nor writes global state.
"""

from __future__ import annotations

import contextlib
import math

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Trace_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.infer.autoguide.initialization import init_to_mean
from pyro.nn import PyroModule, PyroSample
from torch import Tensor

from inference.borrowed_evidence import laplace_evidence_prior_precision
from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import GaussianPosterior, GaussianTerm
from inference.hyperparameters import DEFAULT_BOUNDS, HyperparameterChoice, check_bounds
from inference.linear_model import log_likelihood, training_tensors
from inference.options import CovarianceStructure, GuideKind, Likelihood, VariationalPriorMethod


class BayesianLinearHead(PyroModule):
    """pyro model of a linear head with an isotropic Gaussian prior on ``W (C, m + 1)``.

    The prior's location and scale are buffers (of ``dtype``, float32 by default), so
    ``.to(device)`` moves them (pyro's "zero buffer" idiom); ``forward`` takes bias-augmented
    inputs ``(B, m + 1)`` of the same dtype.
    """

    def __init__(self, num_inputs: int, num_outputs: int, prior_precision: float,
                 prior_mean: float, likelihood: Likelihood, noise_std: float,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (num_outputs, num_inputs)
        self.prior_mean = float(prior_mean)
        self.register_buffer("prior_loc", torch.full(shape, self.prior_mean, dtype=dtype))
        self.register_buffer("prior_scale",
                             torch.full(shape, 1.0 / math.sqrt(prior_precision), dtype=dtype))
        self.likelihood = likelihood
        self.noise_std = float(noise_std)
        self.weight = PyroSample(lambda self: dist.Normal(self.prior_loc, self.prior_scale)
                                 .to_event(2))

    def forward(self, inputs: Tensor, targets: Tensor, num_data: int, subsample: Tensor) -> Tensor:
        """Observe a minibatch: ``inputs (B, m + 1)`` and ``targets (B,)`` are rows ``subsample
        (B,)`` of a data set of ``num_data`` rows (the plate scales their log likelihood by
        ``num_data / B``). Returns the logits ``(B, C)`` (``(P, B, C)`` with vectorised
        particles)."""
        weight = self.weight
        if weight.ndim == 4:  # vectorised ELBO particles: (P, 1, C, m + 1), particle dim at -2
            weight = weight.squeeze(-3)
        logits = inputs @ weight.transpose(-1, -2)  # (B, C), or (P, B, C) with particles
        with pyro.plate("data", size=num_data, subsample=subsample, dim=-1):
            if self.likelihood is Likelihood.SOFTMAX:
                pyro.sample("obs", dist.Categorical(logits=logits), obs=targets)
            else:
                pyro.sample("obs", dist.Normal(logits[..., 0], self.noise_std), obs=targets)
        return logits


@contextlib.contextmanager
def isolated_pyro_state(seed: int, device: torch.device):
    """Module-local pyro parameters, a private param store and a forked torch RNG (CPU and, for a
    CUDA ``device``, that device) seeded with ``seed``; everything is restored on exit."""
    devices = []
    if device.type == "cuda":  # fork_rng takes device indices
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with (
        pyro.settings.context(module_local_params=True),
        pyro.get_param_store().scope(),
        torch.random.fork_rng(devices=devices),
    ):
        torch.manual_seed(seed)
        yield


def init_to_prior_mean_copy(site: dict) -> Tensor:
    """``init_to_mean`` on a fresh tensor: the guide must never own the model's prior buffer.

    pyro's ``init_to_mean`` returns ``site["fn"].mean.detach()``, which for a ``Normal`` is the
    model's ``prior_loc`` buffer itself (``detach`` shares storage); ``AutoNormal`` wraps that
    value in its ``locs`` parameter unchanged, so every optimiser step moved the prior mean with
    the fitted mean and the prior stopped pulling the means towards it (``AutoDiagonalNormal``
    concatenates its sites into a new tensor and escaped). Cloning breaks the alias.
    """
    value = init_to_mean(site).clone()
    value._pyro_custom_init = False  # as init_to_mean marks it (read by pyro's reparam handlers)
    return value


def _check_prior_untouched(model: BayesianLinearHead, precision: float) -> None:
    """Raise `NumericalError` unless the model's prior buffers still hold the prior of
    ``precision`` and the model's mean: a guide parameter that aliases a buffer (the bug fixed
    by `init_to_prior_mean_copy`, or any future pyro behaviour like it) moves them."""
    loc = torch.full_like(model.prior_loc, model.prior_mean)
    scale = torch.full_like(model.prior_scale, 1.0 / math.sqrt(precision))
    if not (torch.equal(model.prior_loc, loc) and torch.equal(model.prior_scale, scale)):
        raise NumericalError(
            "the MFVI prior's buffers changed during the fit: a guide parameter aliases the "
            "model's prior (a pyro initialisation returned the buffer itself); this is a bug in "
            "inference.mfvi, please report it with the pyro version."
        )


def _guide_moments(guide, guide_kind: GuideKind, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The guide's (loc, scale) over W, through pyro's constrained accessors."""
    if guide_kind is GuideKind.AUTO_NORMAL:
        return guide.locs.weight.detach(), guide.scales.weight.detach()
    return guide.loc.detach().reshape(shape), guide.scale.detach().reshape(shape)


def elbo_optimal_precision(loc: Tensor, scale: Tensor, prior_mean: float) -> float:
    """The prior precision maximising the ELBO for a fixed diagonal guide ``N(loc, scale²)``.

    The ELBO depends on λ only through ``E_q log N(w; μ₀, I/λ) = (d/2) log λ − (λ/2)
    E_q‖w − μ₀‖² + const``, maximised at ``λ* = d / Σᵢ ((locᵢ − μ₀)² + scaleᵢ²)`` (the M-step
    of variational EM). ``loc`` and ``scale`` have any shape with ``d`` entries.
    """
    spread = ((loc.double() - prior_mean) ** 2 + scale.double() ** 2).sum()
    return float(loc.numel() / spread)


def evidence_lower_bound(
    posterior: GaussianPosterior,
    features: Tensor,
    labels: Tensor,
    *,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    num_samples: int = 256,
    seed: int = 0,
) -> tuple[float, float]:
    """The ELBO (nats) of a diagonal Gaussian posterior over a ``(C, m + 1)`` head, with its
    Monte-Carlo standard error.

    ``ELBO = E_q[log p(y | W, X)] − KL(q ‖ p)``: the KL from ``q`` to the posterior's own
    (diagonal) prior in closed form, the expected log likelihood averaged over ``num_samples``
    draws of ``q`` (seeded; float64). ``features (N, m)`` and ``labels (N,)`` are the training
    data the posterior was fitted to.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    if posterior.structure is not CovarianceStructure.DIAG or len(posterior.shape) != 2:
        raise InvalidInputError(
            "evidence_lower_bound needs a diagonal posterior over a (C, m + 1) head; got "
            f"structure {posterior.structure} and shape {posterior.shape}.")
    inputs, targets = training_tensors(features, labels, posterior.shape[0], likelihood,
                                       noise_std, torch.float64)
    inputs, targets = inputs.to(posterior.device), targets.to(posterior.device)
    loc = posterior.mean.to(torch.float64)
    scale = posterior.marginal_variance().to(torch.float64).sqrt()
    generator = torch.Generator(device=posterior.device).manual_seed(seed)
    draws = loc + scale * torch.randn((num_samples, *loc.shape), generator=generator,
                                      dtype=torch.float64, device=posterior.device)
    log_lik = log_likelihood(draws, inputs, targets, likelihood, noise_std)  # (S,)
    prior_precision = posterior.prior.diag.to(torch.float64).reshape(loc.shape)
    prior_mean = posterior.prior.shift.to(torch.float64).reshape(loc.shape) / prior_precision
    # KL(N(m, s²) ‖ N(μ₀, 1/λ)) = ½ (λ s² + λ (m − μ₀)² − 1 − log(λ s²)), per coordinate
    ratio = prior_precision * scale**2
    kl = 0.5 * (ratio + prior_precision * (loc - prior_mean) ** 2 - 1 - torch.log(ratio)).sum()
    value = float(log_lik.mean() - kl)
    return value, float(log_lik.std() / num_samples**0.5) if num_samples > 1 else math.inf


def _prior_precision_method(value: object) -> VariationalPriorMethod | None:
    """The selection method named by ``value``, or ``None`` for a valid positive number."""
    if isinstance(value, str):
        return VariationalPriorMethod.parse(value, "prior_precision")
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise InvalidInputError(
            f"prior_precision must be a finite number > 0, 'elbo' or 'marglik'; got "
            f"prior_precision={value!r}.")
    return None


def fit_mfvi_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_precision: float | VariationalPriorMethod | str = VariationalPriorMethod.MARGLIK,
    prior_mean: float = 0.0,
    guide: GuideKind | str = GuideKind.AUTO_NORMAL,
    num_steps: int = 2000,
    lr: float = 0.02,
    final_lr_fraction: float = 0.05,
    batch_size: int | None = 256,
    num_particles: int = 1,
    init_scale: float = 0.05,
    likelihood: Likelihood | str = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
    seed: int = 0,
    prior_precision_bounds: tuple[float, float] = DEFAULT_BOUNDS,
    empirical_bayes_warmup: float = 0.1,
) -> GaussianPosterior:
    """Fit a mean-field Gaussian posterior over a linear head with pyro SVI.

    The prior precision ``λ`` is a number or chosen from the training data:

    * ``"marglik"`` (the default): the λ maximising the Laplace evidence of the same model
      (`inference.borrowed_evidence`), then an ordinary fit at that λ.
    * ``"elbo"``: empirical Bayes on the ELBO (variational EM). After the first
      ``empirical_bayes_warmup`` fraction of the steps at λ = 1 (clipped to the bounds), every
      SVI step is followed by the ELBO's exact maximiser in λ for the current guide,
      `elbo_optimal_precision`, clipped to ``prior_precision_bounds``; guide and λ
      converge together to a joint maximum of the ELBO. Not the default: the ELBO's gap to
      the evidence grows with the posterior's correlations, which a weaker prior lets grow, so
      its maximiser leans to strong priors (on the digits bench λ ≈ 7-22, depending on
      ``num_steps`` as EM crawls where the ELBO is flat in λ, against the evidence's 0.58),
      where the mean-field predictive is under-confident.

    Args:
        features: ``(N, m)`` features from a fixed body.
        labels: ``(N,)`` labels in ``[0, num_classes)`` (real targets if gaussian).
        num_classes: ``C`` (1 for ``likelihood="gaussian"``).
        prior_precision: ``λ > 0`` of the prior ``N(prior_mean, I/λ)`` (standard deviation
            ``1/√λ``), or ``"elbo"`` / ``"marglik"`` (see above).
        guide: ``"auto_normal"`` or ``"auto_diagonal_normal"``.
        num_steps: SVI steps; ``lr`` is Adam's initial learning rate, decayed exponentially to
            ``lr · final_lr_fraction`` at the last step.
        batch_size: minibatch size ``≥ 1`` (``None``: full batch); the plate rescales by
            ``N / batch``.
        num_particles: ELBO Monte-Carlo particles per step, ``≥ 1`` (vectorised when > 1).
        init_scale: initial guide standard deviation, ``> 0``.
        likelihood: ``"softmax"`` (classification) or ``"gaussian"`` (regression).
        noise_std: observation noise ``σ > 0`` of the Gaussian likelihood.
        seed: seeds the fit (the caller's RNG state is untouched).
        prior_precision_bounds: ``(lower, upper)`` interval of a chosen λ (default 1e-4, 1e4).
        empirical_bayes_warmup: the fraction of the steps before ``"elbo"`` starts updating λ,
            in ``[0, 1)``.

    Returns:
        A float64 diagonal `GaussianPosterior` on the features' device (``n_data = N``).
        Its attribute ``prior_selection`` is the
        `HyperparameterChoice` of a chosen λ (its value, the
        criterion there — the ELBO estimate of `evidence_lower_bound`, or the Laplace log
        evidence — and whether it hit a bound), or ``None`` for a given number.

    Raises:
        InvalidInputError: bad features, labels or options.
        NumericalError: the ELBO became NaN or infinite.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    guide_kind = GuideKind.parse(guide, "guide")
    method = _prior_precision_method(prior_precision)
    bounds = check_bounds(prior_precision_bounds, "prior_precision_bounds")
    valid = (num_steps >= 1 and lr > 0 and 0 < final_lr_fraction <= 1
             and (batch_size is None or batch_size >= 1) and num_particles >= 1
             and init_scale > 0 and 0 <= empirical_bayes_warmup < 1)
    if not valid:
        raise InvalidInputError(
            "need num_steps ≥ 1, lr > 0, 0 < final_lr_fraction ≤ 1, batch_size ≥ 1 (or None), "
            "num_particles ≥ 1, init_scale > 0 and 0 ≤ empirical_bayes_warmup < 1; got "
            f"num_steps={num_steps}, lr={lr}, final_lr_fraction={final_lr_fraction}, "
            f"batch_size={batch_size}, num_particles={num_particles}, init_scale={init_scale}, "
            f"empirical_bayes_warmup={empirical_bayes_warmup}."
        )
    inputs, targets = training_tensors(features, labels, num_classes, likelihood, noise_std,
                                       torch.float32)
    choice = None
    if method is VariationalPriorMethod.MARGLIK:
        choice = laplace_evidence_prior_precision(
            features, labels, num_classes, prior_mean=prior_mean, likelihood=likelihood,
            noise_std=noise_std, bounds=bounds)
        precision = choice.value
    elif method is VariationalPriorMethod.ELBO:
        precision = min(max(1.0, bounds[0]), bounds[1])
    else:
        precision = float(prior_precision)
    svi = _SVIRun(inputs, targets, num_classes, prior_mean, likelihood, noise_std, guide_kind,
                  init_scale, num_particles, batch_size)
    update_from = (round(empirical_bayes_warmup * num_steps)
                   if method is VariationalPriorMethod.ELBO else None)
    loc, scale, precision = svi.fit(precision, num_steps, lr, final_lr_fraction, seed,
                                    update_from, bounds)
    prior = GaussianTerm.isotropic(loc.numel(), precision, prior_mean, device=loc.device)
    posterior = GaussianPosterior.from_mean_and_precision(
        loc, (1.0 / scale**2).reshape(-1), prior, n_data=inputs.shape[0])
    if method is VariationalPriorMethod.ELBO:
        choice = _elbo_choice(posterior, precision, bounds, features, labels, likelihood,
                              noise_std, num_steps - update_from, seed)
    posterior.prior_selection = choice
    return posterior


def _elbo_choice(posterior: GaussianPosterior, precision: float, bounds: tuple[float, float],
                 features: Tensor, labels: Tensor, likelihood: Likelihood, noise_std: float,
                 updates: int, seed: int) -> HyperparameterChoice:
    """The record of an empirical-Bayes λ: its value, the ELBO there, whether it is clipped."""
    value, _ = evidence_lower_bound(posterior, features, labels, likelihood=likelihood,
                                    noise_std=noise_std, seed=seed)
    at_bound = "lower" if precision <= bounds[0] else "upper" if precision >= bounds[1] else None
    return HyperparameterChoice(
        name="prior_precision", method=VariationalPriorMethod.ELBO.value, value=precision,
        criterion_name="elbo", criterion=value, maximised=True, bounds=bounds,
        at_bound=at_bound, evaluations=updates, grid=())


class _SVIRun:
    """The training set and settings of one MFVI fit; `fit` runs SVI at a prior
    precision (optionally learnt), in a private pyro state."""

    def __init__(self, inputs: Tensor, targets: Tensor, num_classes: int, prior_mean: float,
                 likelihood: Likelihood, noise_std: float, guide_kind: GuideKind,
                 init_scale: float, num_particles: int, batch_size: int | None) -> None:
        self.inputs, self.targets, self.num_classes = inputs, targets, num_classes
        self.prior_mean, self.likelihood, self.noise_std = prior_mean, likelihood, noise_std
        self.guide_kind, self.init_scale, self.num_particles = guide_kind, init_scale, num_particles
        num_data = inputs.shape[0]
        self.batch = num_data if batch_size is None else min(int(batch_size), num_data)
        self.shape = (num_classes, inputs.shape[1])

    def minibatch(self) -> tuple[Tensor, Tensor, int, Tensor]:
        """Rows drawn without replacement from the (seeded) torch RNG, the model's arguments."""
        num_data, device = self.inputs.shape[0], self.inputs.device
        if self.batch == num_data:
            index = torch.arange(num_data, device=device)
        else:
            index = torch.randperm(num_data, device=device)[:self.batch]
        return self.inputs[index], self.targets[index], num_data, index

    def fit(self, precision: float, num_steps: int, lr: float, final_lr_fraction: float,
            seed: int, update_from: int | None, bounds: tuple[float, float],
            ) -> tuple[Tensor, Tensor, float]:
        """SVI from the prior mean; from step ``update_from`` on (``None``: never) λ follows
        `elbo_optimal_precision` of the guide, clipped to ``bounds``. Returns the guide's
        float64 ``(loc, scale)``, each ``(C, m + 1)``, and the final λ."""
        device = self.inputs.device
        with isolated_pyro_state(seed, device):
            model = BayesianLinearHead(self.shape[1], self.num_classes, precision,
                                       self.prior_mean, self.likelihood, self.noise_std
                                       ).to(device)
            guide_cls = (AutoNormal if self.guide_kind is GuideKind.AUTO_NORMAL
                         else AutoDiagonalNormal)
            auto_guide = guide_cls(model, init_loc_fn=init_to_prior_mean_copy,
                                   init_scale=self.init_scale)
            elbo = Trace_ELBO(num_particles=self.num_particles,
                              vectorize_particles=self.num_particles > 1, max_plate_nesting=1)
            loss_fn = elbo(model, auto_guide)
            loss_fn(*self.minibatch())  # dry run: autoguide parameters are created lazily
            optimiser = torch.optim.Adam(loss_fn.parameters(), lr=lr)
            scheduler = torch.optim.lr_scheduler.ExponentialLR(
                optimiser, gamma=final_lr_fraction ** (1.0 / num_steps))
            for step in range(num_steps):
                loss = loss_fn(*self.minibatch())
                if not torch.isfinite(loss):
                    raise NumericalError(
                        f"the ELBO became {float(loss.detach())} at SVI step {step} (lr "
                        f"{scheduler.get_last_lr()[0]:.3g}); lower lr or init_scale, scale the "
                        "features, or raise the prior precision."
                    )
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                scheduler.step()
                if update_from is not None and step >= update_from:
                    loc, scale = _guide_moments(auto_guide, self.guide_kind, self.shape)
                    optimum = elbo_optimal_precision(loc, scale, self.prior_mean)
                    precision = min(max(optimum, bounds[0]), bounds[1])
                    model.prior_scale.fill_(1.0 / math.sqrt(precision))  # the intended change
            _check_prior_untouched(model, precision)
            loc, scale = _guide_moments(auto_guide, self.guide_kind, self.shape)
        return loc.to(torch.float64), scale.to(torch.float64), precision
