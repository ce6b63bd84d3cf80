"""The linear head every feature-based posterior in [`inference`][inference] is over.

A head maps features ``x`` of shape ``(B, m)`` to outputs ``f = W [1, x]`` of shape ``(B, C)``,
with ``W`` of shape ``(C, m + 1)``: column 0 is the bias (the layout of
`inference.conjugate`). A flat parameter vector is ``W.reshape(-1)`` (row-major, class by
class). The observation model is a
[`Likelihood`][inference.options.Likelihood]: softmax classification or Gaussian regression.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.options import Likelihood


def augment_with_bias(features: Tensor) -> Tensor:
    """Prepend a column of ones (the bias input): ``(B, m) -> (B, m + 1)``, ``[1, x]``."""
    ones = torch.ones(features.shape[0], 1, dtype=features.dtype, device=features.device)
    return torch.cat([ones, features], dim=1)


def check_features(features: Tensor, num_features: int | None = None) -> None:
    """Raise `InvalidInputError` unless ``features`` is a finite float ``(B, m)`` tensor."""
    if not isinstance(features, Tensor) or features.ndim != 2:
        shape = getattr(features, "shape", None)
        raise InvalidInputError(f"features must be a 2-D tensor (B, m); got shape {shape}.")
    if not features.is_floating_point():
        raise InvalidInputError(f"features must be floating point; got {features.dtype}.")
    if num_features is not None and features.shape[1] != num_features:
        raise InvalidInputError(
            f"features have {features.shape[1]} columns but the head expects {num_features}."
        )
    if not torch.isfinite(features).all():
        raise InvalidInputError("features contain NaN or inf.")


def check_training_data(
    features: Tensor, targets: Tensor, num_classes: int, likelihood: Likelihood
) -> None:
    """Validate a training set: finite float ``features (N, m)``, ``targets (N,)`` on the same
    device; integer labels in ``[0, C)`` with ``C ≥ 2`` (softmax) or finite real targets with
    ``C == 1`` (gaussian). Raises `InvalidInputError` naming what is wrong."""
    check_features(features)
    if features.shape[0] == 0:
        raise InvalidInputError("the training set is empty (0 rows of features).")
    if not isinstance(targets, Tensor) or targets.shape != (features.shape[0],):
        raise InvalidInputError(
            f"targets must be a tensor of shape ({features.shape[0]},) to match the features; "
            f"got {tuple(targets.shape) if isinstance(targets, Tensor) else type(targets)}."
        )
    if targets.device != features.device:
        raise InvalidInputError(
            f"targets are on {targets.device} but features on {features.device}; move both to "
            "one device."
        )
    if likelihood is Likelihood.SOFTMAX:
        if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InvalidInputError(f"labels must be integers; got {targets.dtype}.")
        if num_classes < 2:
            raise InvalidInputError(f"num_classes must be at least 2; got {num_classes}.")
        if targets.min() < 0 or targets.max() >= num_classes:
            raise InvalidInputError(
                f"labels must lie in [0, {num_classes}); got range "
                f"[{int(targets.min())}, {int(targets.max())}]."
            )
        return
    if num_classes != 1:
        raise InvalidInputError("a Gaussian-likelihood head has one output: pass num_classes=1.")
    if not torch.isfinite(targets).all():
        raise InvalidInputError("regression targets contain NaN or inf.")


def training_tensors(
    features: Tensor,
    targets: Tensor,
    num_classes: int,
    likelihood: Likelihood,
    noise_std: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Validate a head's training set (`check_training_data`) and noise scale; return
    what the fitters compute with.

    Args:
        features: ``(N, m)`` float features (any device).
        targets: ``(N,)`` integer labels (softmax) or real targets (gaussian), same device.
        noise_std: ``σ > 0`` of the Gaussian likelihood (ignored, but still checked, for softmax).
        dtype: the floating dtype to compute in.

    Returns:
        ``inputs (N, m + 1)`` bias-augmented features in ``dtype`` and ``targets (N,)``: int64
        labels (softmax) or ``dtype`` reals (gaussian), both on the features' device.
    """
    check_training_data(features, targets, num_classes, likelihood)
    if not noise_std > 0:
        raise InvalidInputError(f"noise_std must be positive; got {noise_std}.")
    inputs = augment_with_bias(features.to(dtype))
    if likelihood is Likelihood.SOFTMAX:
        return inputs, targets.long()
    return inputs, targets.to(dtype)


def log_likelihood(
    weight: Tensor,
    inputs: Tensor,
    targets: Tensor,
    likelihood: Likelihood = Likelihood.SOFTMAX,
    noise_std: float = 1.0,
) -> Tensor:
    """Sum over rows of ``log p(y | W, x)``.

    Args:
        weight: ``(C, m + 1)`` head weights (or ``(S, C, m + 1)`` for a batch of heads).
        inputs: ``(B, m + 1)`` bias-augmented features.
        targets: ``(B,)`` integer labels (softmax) or real targets with ``C == 1`` (gaussian).
        noise_std: observation noise standard deviation of the Gaussian likelihood.

    Returns:
        A scalar (or ``(S,)``) log-likelihood, in nats.
    """
    logits = inputs @ weight.transpose(-1, -2)  # (..., B, C)
    if likelihood is Likelihood.SOFTMAX:
        log_probs = torch.log_softmax(logits, dim=-1)
        index = targets.long().expand(*logits.shape[:-1]).unsqueeze(-1)
        return log_probs.gather(-1, index).squeeze(-1).sum(-1)
    residual = (targets - logits[..., 0]) / noise_std
    return -0.5 * (residual**2).sum(-1) - targets.shape[0] * (
        math.log(noise_std) + 0.5 * math.log(2 * math.pi)
    )
