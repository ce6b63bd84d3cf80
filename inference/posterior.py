"""The posterior protocol every head in [`inference`][inference] satisfies.

A posterior is a distribution over head (or subnetwork) parameters. Whatever the method
(conjugate, Laplace, subnet Laplace, MFVI, SGLD), it offers the same small surface, so the
federation layer and users can swap methods by one string:

``mean``
    The posterior mean (or MAP, where that is what the method has), a tensor.
``sample(n, generator=None)``
    ``n`` parameter draws stacked on a new leading axis: shape ``(n, *mean.shape)``.
``predict_proba(inputs, method=...)``
    Predictive class probabilities, shape ``(B, C)``, rows summing to one.
``to(device)``
    A copy on ``device`` (nothing is moved in place).
``state_dict()`` / ``from_state_dict(state)``
    Tensors only (no pickle): what `inference.posterior_file.save_posterior` writes with
    safetensors, with a digest, and `load_posterior` reads back
    and validates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError


@runtime_checkable
class Posterior(Protocol):
    """Structural type of every posterior object (see the module docstring).

    ``sample(n)`` always returns ``(n, *mean.shape)``, but what a draw *is* depends on the
    ``kind`` (each class's docstring says it too):

    - ``"conjugate"``, ``"noisy_conjugate"`` (`inference.ConjugatePosterior`, FedLog's
      heads), ``"gaussian"`` (a Laplace or variational Gaussian head): head weights
      ``(n, C, m + 1)``, the bias in column 0, in the space of the head's (scaled) features; a
      Gaussian over another ``shape`` draws in that shape.
    - ``"ensemble"``: members of the stored set, drawn uniformly with replacement, in the
      members' own space (for a head: ``(n, C, m + 1)``).
    - ``"body"`` (`inference.body_posterior.BodyPosterior`): the draws of its head
      posterior (one of the above) behind a fixed body; the body's weights are not drawn, and
      ``predict_proba`` takes the body's *inputs*.
    - ``"subnet_laplace"``: the whole flat parameter vector ``(n, P)`` of the network; the
      subnet's entries from their joint Gaussian, every other entry exactly at the MAP.
    - ``"diagonal_laplace"``: ``(n, P)``, every entry from its own Gaussian (factorised).
    - ``"network_gaussian"``: ``(n, P)``, the whole flat network from
      ``N(mean, diag(variance) + Dᵀ D)`` (pFedBayes, FedPA).

    Flat vectors ``(n, P)`` lay out the network's (trainable) parameters in registration
    order (`inference.network_gaussian.parameter_layout`).
    """

    kind: ClassVar[str]

    @property
    def mean(self) -> Tensor: ...

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor: ...

    def predict_proba(self, inputs: Tensor, method: Any = None) -> Tensor: ...

    def to(self, device: torch.device | str) -> Posterior: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> Posterior: ...


# -- helpers shared by the implementations ------------------------------------------------------


def check_num_draws(n: int) -> int:
    """``n`` as an int if it is a positive integer (not a bool); else `InvalidInputError`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInputError(f"the number of draws must be a positive integer; got {n!r}.")
    return int(n)


def draw_device(generator: torch.Generator | None, device: torch.device) -> torch.device:
    """Where to draw random numbers: on ``generator``'s device if one is given (a generator
    only feeds its own device), else on ``device``; callers move the draws to ``device``."""
    return device if generator is None else generator.device


# -- registry ---------------------------------------------------------------------------------

#: Posterior classes by ``kind``; filled by `register_posterior`.
POSTERIOR_CLASSES: dict[str, type] = {}

#: Modules imported on demand by `posterior_class` so that their classes register.
_MODULES_WITH_POSTERIORS = (
    "inference.gaussian",
    "inference.ensemble",
    "inference.conjugate",
    "inference.subnet",
    "inference.network_gaussian",
)

def register_posterior(cls: type) -> type:
    """Class decorator: make ``cls`` loadable by
    [`load_posterior`][inference.posterior_file.load_posterior] under ``cls.kind``."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a non-empty class attribute `kind: str`.")
    existing = POSTERIOR_CLASSES.get(kind)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise TypeError(f"posterior kind {kind!r} is already registered by {existing.__name__}.")
    POSTERIOR_CLASSES[kind] = cls
    return cls


def posterior_class(kind: str) -> type:
    """The class registered for ``kind``.

    If ``kind`` is not registered yet, the inference modules that define posteriors are
    imported, and the classes they export with a ``kind`` and ``from_state_dict`` are registered.
    """
    if kind not in POSTERIOR_CLASSES:
        import importlib

        for name in _MODULES_WITH_POSTERIORS:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as error:
                if error.name != name:  # a real missing dependency, not an absent module
                    raise
                continue
            # classes exported by the module that declare a kind but were not decorated
            for value in vars(module).values():
                declared = getattr(value, "kind", None)
                if (isinstance(value, type) and isinstance(declared, str)
                        and hasattr(value, "from_state_dict")):
                    POSTERIOR_CLASSES.setdefault(declared, value)
    if kind not in POSTERIOR_CLASSES:
        known = ", ".join(sorted(POSTERIOR_CLASSES)) or "none"
        raise InvalidInputError(f"unknown posterior kind {kind!r}; registered kinds: {known}.")
    return POSTERIOR_CLASSES[kind]


# -- self-check ---------------------------------------------------------------------------------


def check(
    posterior: Posterior,
    inputs: Tensor | None = None,
    num_samples: int = 4000,
    generator: torch.Generator | None = None,
    rtol: float = 0.15,
) -> dict[str, float]:
    """Sanity-check a posterior; raise `NumericalError` on the first failure.

    Checks that the mean is finite; that ``sample`` returns ``(n, *mean.shape)`` finite draws;
    where the posterior has ``marginal_variance()``, that the draws' variance matches it within
    ``rtol`` (relative, averaged over coordinates; loose because it is a Monte-Carlo check);
    and, given ``inputs``, that ``predict_proba`` rows are finite, in [0, 1] and sum to one.

    Returns:
        The measured figures: ``mean_abs``, ``sample_variance_rel_error`` (if checked),
        ``max_row_sum_error`` (if checked).
    """
    report: dict[str, float] = {}
    mean = posterior.mean
    if not torch.isfinite(mean).all():
        raise NumericalError("the posterior mean contains NaN or inf.")
    report["mean_abs"] = float(mean.abs().mean())
    draws = posterior.sample(num_samples, generator=generator)
    if tuple(draws.shape) != (num_samples, *mean.shape):
        raise NumericalError(
            f"sample({num_samples}) returned shape {tuple(draws.shape)}; expected "
            f"{(num_samples, *mean.shape)}."
        )
    if not torch.isfinite(draws).all():
        raise NumericalError("posterior draws contain NaN or inf.")
    marginal_variance = getattr(posterior, "marginal_variance", None)
    if callable(marginal_variance):
        expected = marginal_variance().to(torch.float64)
        measured = draws.to(torch.float64).var(0)
        error = float(((measured - expected).abs() / expected.clamp_min(1e-300)).mean())
        report["sample_variance_rel_error"] = error
        if error > rtol:
            raise NumericalError(
                f"draws' variance differs from marginal_variance() by {error:.1%} on average "
                f"(tolerance {rtol:.0%}): the sampler and the covariance disagree."
            )
    if inputs is not None:
        probs = posterior.predict_proba(inputs)
        if not torch.isfinite(probs).all() or (probs < 0).any() or (probs > 1).any():
            raise NumericalError("predict_proba returned values outside [0, 1] or non-finite.")
        row_error = float((probs.to(torch.float64).sum(-1) - 1).abs().max())
        report["max_row_sum_error"] = row_error
        if row_error > 1e-4:
            raise NumericalError(f"predict_proba rows sum to one only within {row_error:.2e}.")
    return report
