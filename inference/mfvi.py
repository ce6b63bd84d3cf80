"""Mean-field variational inference of a linear head with pyro-ppl ("mfvi" in the factory).

Model (a :class:`pyro.nn.PyroModule`): ``W ~ N(μ₀, I/λ)`` over the ``(C, m + 1)`` head (bias in
column 0) and ``y_n ~ Categorical(softmax(W [1, x_n]))`` (or ``Normal(W [1, x_n], σ²)`` with
``likelihood="gaussian"``, ``C = 1``) inside ``pyro.plate("data", size=N, subsample=idx)``, so a
minibatch's log likelihood is scaled by ``N / len(idx)`` and the ELBO is unbiased.

Guide: ``AutoNormal`` (default) or ``AutoDiagonalNormal``, both a diagonal Gaussian, trained with
``Trace_ELBO`` used as a module and a torch Adam optimiser (exponentially decayed learning rate).
Both start at the prior mean (on a fresh tensor: see :func:`init_to_prior_mean_copy`).
The fitted guide is exported as a diagonal :class:`~inference.gaussian.GaussianPosterior`
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

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import GaussianPosterior, GaussianTerm
from inference.linear_model import training_tensors
from inference.options import GuideKind, Likelihood


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
        self.register_buffer("prior_loc", torch.full(shape, float(prior_mean), dtype=dtype))
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


def _check_prior_untouched(model: BayesianLinearHead, loc: Tensor, scale: Tensor) -> None:
    """Raise :class:`NumericalError` if fitting changed the model's prior buffers (the aliasing
    fixed by :func:`init_to_prior_mean_copy`, or any future pyro behaviour like it)."""
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


def fit_mfvi_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior_precision: float = 1.0,
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
) -> GaussianPosterior:
    """Fit a mean-field Gaussian posterior over a linear head with pyro SVI.

    Args:
        features: ``(N, m)`` features from a fixed body.
        labels: ``(N,)`` labels in ``[0, num_classes)`` (real targets if gaussian).
        num_classes: ``C`` (1 for ``likelihood="gaussian"``).
        prior_precision: ``λ`` of the prior ``N(prior_mean, I/λ)``.
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

    Returns:
        A float64 diagonal :class:`GaussianPosterior` on the features' device (``n_data = N``).

    Raises:
        InvalidInputError: bad features, labels or options.
        NumericalError: the ELBO became NaN or infinite.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    guide_kind = GuideKind.parse(guide, "guide")
    valid = (prior_precision > 0 and num_steps >= 1 and lr > 0 and 0 < final_lr_fraction <= 1
             and (batch_size is None or batch_size >= 1) and num_particles >= 1
             and init_scale > 0)
    if not valid:
        raise InvalidInputError(
            "need prior_precision > 0, num_steps ≥ 1, lr > 0, 0 < final_lr_fraction ≤ 1, "
            "batch_size ≥ 1 (or None), num_particles ≥ 1 and init_scale > 0; got "
            f"prior_precision={prior_precision}, num_steps={num_steps}, lr={lr}, "
            f"final_lr_fraction={final_lr_fraction}, batch_size={batch_size}, "
            f"num_particles={num_particles}, init_scale={init_scale}."
        )
    device = features.device
    inputs, targets = training_tensors(features, labels, num_classes, likelihood, noise_std,
                                       torch.float32)
    num_data = inputs.shape[0]
    batch = num_data if batch_size is None else min(int(batch_size), num_data)
    shape = (num_classes, inputs.shape[1])

    with isolated_pyro_state(seed, device):
        model = BayesianLinearHead(shape[1], num_classes, prior_precision, prior_mean,
                                   likelihood, noise_std).to(device)
        guide_cls = AutoNormal if guide_kind is GuideKind.AUTO_NORMAL else AutoDiagonalNormal
        prior_loc, prior_scale = model.prior_loc.clone(), model.prior_scale.clone()
        auto_guide = guide_cls(model, init_loc_fn=init_to_prior_mean_copy,
                               init_scale=init_scale)
        elbo = Trace_ELBO(num_particles=num_particles, vectorize_particles=num_particles > 1,
                          max_plate_nesting=1)
        loss_fn = elbo(model, auto_guide)

        def minibatch() -> tuple[Tensor, Tensor, int, Tensor]:
            if batch == num_data:
                index = torch.arange(num_data, device=device)
            else:
                index = torch.randperm(num_data, device=device)[:batch]
            return inputs[index], targets[index], num_data, index

        loss_fn(*minibatch())  # dry run: autoguide parameters are created lazily
        optimiser = torch.optim.Adam(loss_fn.parameters(), lr=lr)
        decay = final_lr_fraction ** (1.0 / num_steps)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimiser, gamma=decay)
        for step in range(num_steps):
            loss = loss_fn(*minibatch())
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
        _check_prior_untouched(model, prior_loc, prior_scale)
        loc, scale = _guide_moments(auto_guide, guide_kind, shape)

    loc, scale = loc.to(torch.float64), scale.to(torch.float64)
    prior = GaussianTerm.isotropic(loc.numel(), prior_precision, prior_mean, device=device)
    return GaussianPosterior.from_mean_and_precision(loc, (1.0 / scale**2).reshape(-1), prior,
                                                     n_data=num_data)
