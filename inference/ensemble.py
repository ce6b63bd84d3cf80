"""A posterior represented by a stack of parameter draws (SGLD samples, deep ensembles)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.inputs import as_features
from inference.linear_model import augment_with_bias, check_features
from inference.options import PredictiveMethod
from inference.posterior import check_num_draws, draw_device, register_posterior


def mean_softmax(weights: Tensor, features: Tensor, chunk_size: int = 64) -> Tensor:
    """Average over heads of ``softmax(W_s [1, x])``.

    Args:
        weights: ``(S, C, m + 1)`` head weights.
        features: ``(B, m)`` features (moved to the weights' device and dtype).
        chunk_size: heads processed at once (bounds memory at ``chunk_size · B · C``).

    Returns:
        ``(B, C)`` probabilities, in the dtype and on the device of ``weights``.
    """
    x = augment_with_bias(features.to(device=weights.device, dtype=weights.dtype))
    total = torch.zeros(x.shape[0], weights.shape[1], dtype=weights.dtype, device=weights.device)
    for start in range(0, weights.shape[0], chunk_size):
        logits = torch.einsum("bp,scp->sbc", x, weights[start : start + chunk_size])
        total += torch.softmax(logits, dim=-1).sum(0)
    return total / weights.shape[0]


@register_posterior
class EnsemblePosterior:
    """An equally weighted set of parameter draws, ``samples`` of shape ``(S, *shape)``.

    For a softmax head (``shape == (C, m + 1)``), `predict_proba` averages the class
    probabilities of the members (Bayesian model averaging), not their logits.
    ``sample(n)`` draws members of the set, uniformly with replacement: ``(n, *shape)``, in
    the members' own space.
    """

    kind = "ensemble"

    def __init__(self, samples: Tensor, n_data: int = 0) -> None:
        if samples.ndim < 2 or samples.shape[0] == 0:
            raise InvalidInputError(
                f"samples must have shape (S, *shape) with S ≥ 1; got {tuple(samples.shape)}."
            )
        if not torch.isfinite(samples).all():
            raise InvalidInputError("ensemble samples contain NaN or inf.")
        self.samples = samples
        self.n_data = int(n_data)

    @property
    def mean(self) -> Tensor:
        """Sample mean, shape ``samples.shape[1:]``."""
        return self.samples.mean(0)

    def marginal_variance(self) -> Tensor:
        """Sample variance (unbiased), shape ``samples.shape[1:]``."""
        return self.samples.var(0)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n ≥ 1`` members drawn uniformly with replacement, shape ``(n, *shape)``, on the
        samples' device (``generator`` may live on any device)."""
        device = self.samples.device
        index = torch.randint(self.samples.shape[0], (check_num_draws(n),), generator=generator,
                              device=draw_device(generator, device))
        return self.samples[index.to(device)]

    def predict_proba(
        self, inputs: Tensor, method: PredictiveMethod | str = PredictiveMethod.MC
    ) -> Tensor:
        """``(B, C)`` probabilities for features ``(B, m)``.

        ``method``: ``"mc"`` (average over all members, the default) or ``"map"`` (softmax at
        the sample mean). ``"probit"`` is not defined for an ensemble and is rejected.
        Computed in the samples' dtype on their device; returned in the inputs' dtype there.
        """
        method = PredictiveMethod.parse(method, "method")
        inputs = as_features(inputs)  # NumPy arrays and lists too (inference.inputs)
        if method in (PredictiveMethod.PROBIT, PredictiveMethod.CENTRED_PROBIT):
            raise InvalidInputError("an ensemble posterior predicts with method 'mc' or 'map'.")
        if self.samples.ndim != 3:
            raise InvalidInputError(
                "predict_proba needs samples of a (C, m + 1) head; got "
                f"{tuple(self.samples.shape)}."
            )
        check_features(inputs, self.samples.shape[2] - 1)
        x = inputs.to(device=self.samples.device)
        weights = self.samples if method is PredictiveMethod.MC else self.mean[None]
        return mean_softmax(weights, x).to(inputs.dtype)

    def to(self, device: torch.device | str) -> EnsemblePosterior:
        """A copy on ``device``."""
        return EnsemblePosterior(self.samples.to(device), self.n_data)

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``samples (S, *shape)`` and ``n_data`` (int64 scalar)."""
        return {"samples": self.samples,
                "n_data": torch.tensor(self.n_data, dtype=torch.int64)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> EnsemblePosterior:
        """Inverse of `state_dict` (``n_data`` defaults to 0)."""
        if "samples" not in state:
            raise InvalidInputError("state lacks `samples`; not an ensemble posterior.")
        return cls(state["samples"], int(state.get("n_data", torch.tensor(0))))

    def __repr__(self) -> str:
        return (f"EnsemblePosterior(num_samples={self.samples.shape[0]}, "
                f"shape={tuple(self.samples.shape[1:])}, device={self.samples.device})")
