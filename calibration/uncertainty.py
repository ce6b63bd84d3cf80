"""Uncertainty scores from predicted probabilities, and the split of entropy from posterior draws.

Two input shapes, told apart by their number of dimensions (never by their values):

* ``probs`` (N, C): one probability vector per row (a plug-in or a posterior predictive);
* ``prob_samples`` (S, N, C): S posterior draws of the probabilities of N rows (MC dropout,
  ensemble members, Laplace or MFVI samples); the predictive is their mean over draws.

Every entry must be finite and >= 0 and every row must sum to 1 within
`calibration.row_scores.sum_tolerance` (1e-3 for float32/float64). Entropies are in nats
with ``0 log 0 = 0``, computed in float64 whatever the input dtype, on the input's device.

Score convention (shared with `calibration.ood`): **a higher score means more likely
out-of-distribution** (more uncertain). `ood_scores` therefore returns the *negated*
maximum probability for ``kind="max_prob"`` (negation is exact, so ties and order are kept);
pass ``higher_is_ood=False`` to the detection metrics to use a confidence (higher = more
in-distribution) as it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor
from calibration.row_scores import sum_tolerance

SCORE_KINDS = ("entropy", "max_prob", "mutual_information", "expected_entropy")
"""The kinds `ood_scores` computes (the last two need posterior draws (S, N, C))."""


def _probabilities(probs: Any, name: str, shape: str, ndim: int) -> Tensor:
    """``probs`` checked as probabilities with ``ndim`` dimensions, as a float64 tensor."""
    given = as_tensor(probs, name)
    if given.ndim != ndim:
        raise InvalidInputError(
            f"{name} must have shape {shape}; got shape {tuple(given.shape)}"
        )
    if given.dtype == torch.bool or not (given.is_floating_point() or given.dtype in (
            torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)):
        raise InvalidInputError(f"{name} must be real-valued numbers; got dtype {given.dtype}")
    if given.numel() == 0:
        raise InvalidInputError(f"{name} is empty (shape {tuple(given.shape)}): nothing to score")
    if given.shape[-1] < 2:
        raise InvalidInputError(
            f"{name} must have C >= 2 class columns; got {given.shape[-1]} "
            "(for a binary classifier pass both columns [1 - p, p])"
        )
    values = given.to(torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise InvalidInputError(f"{name} contain NaN or Inf")
    if bool((values < 0).any()):
        raise InvalidInputError(
            f"{name} contain negative values; these must be probabilities (apply a softmax to "
            "logits first)"
        )
    tolerance = sum_tolerance(given.dtype)
    deviation = (values.sum(-1) - 1.0).abs()
    if not bool((deviation <= tolerance).all()):
        worst = int(deviation.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst),
                                                          deviation.shape))
        total = float(values.sum(-1)[index])
        raise InvalidInputError(
            f"probability rows must sum to 1 (tolerance {tolerance:g}); row {index} of {name} "
            f"sums to {total:.6g} ({int((deviation > tolerance).sum())} bad rows); for logits "
            "apply a softmax first"
        )
    return values


def _entropy(probs: Tensor) -> Tensor:
    """Entropy in nats over the last axis, ``0 log 0 = 0`` (float64 in, float64 out)."""
    return -torch.special.xlogy(probs, probs).sum(-1)


def predictive_entropy(probs: Any) -> Tensor:
    """Entropy ``-sum_c p_c log p_c`` (nats) of each row of ``probs`` (N, C): (N,) float64.

    For posterior draws (S, N, C) use `entropy_decomposition` (its ``total`` is the
    entropy of the mean over draws).
    """
    return _entropy(_probabilities(probs, "probs", "(N, C)", 2))


def max_probability(probs: Any) -> Tensor:
    """Largest class probability of each row of ``probs`` (N, C): (N,) float64, a confidence
    (higher = more in-distribution)."""
    return _probabilities(probs, "probs", "(N, C)", 2).amax(-1)


def entropy_decomposition(prob_samples: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Split the predictive entropy of posterior draws into aleatoric and epistemic parts.

    ``prob_samples`` (S, N, C): S draws of the class probabilities of N rows. Returns three
    float64 tensors of shape (N,), in nats:

    * ``total`` = H(p̄), the entropy of the mean ``p̄ = mean_s p_s`` (the posterior predictive);
    * ``aleatoric`` = mean_s H(p_s), the expected entropy of a draw;
    * ``epistemic`` = the mutual information between the label and the draw,
      ``total - aleatoric``, computed as ``mean_s KL(p_s || p̄)`` (the same quantity, without the
      cancellation of subtracting two nearly equal entropies when the draws agree).

    Mathematically ``epistemic >= 0`` (the entropy is concave); rounding can leave a value a few
    ulps below zero, and such values are set to 0, so ``total == aleatoric + epistemic`` holds up
    to rounding (about 1e-15 times ``total``), not bitwise. With one draw (S = 1) the epistemic
    part is 0.
    """
    return _decomposition(_samples(prob_samples))


def _samples(prob_samples: Any) -> Tensor:
    return _probabilities(prob_samples, "prob_samples", "(S, N, C) (S posterior draws of N rows "
                          "of C class probabilities)", 3)


def _decomposition(samples: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    mean = samples.mean(0)
    total = _entropy(mean)
    aleatoric = _entropy(samples).mean(0)
    # KL(p_s || p̄) = sum_c p_sc (log p_sc - log p̄_c); p̄_c = 0 forces p_sc = 0 (term 0).
    # p̄_c >= p_sc / S bounds the log ratio by log S; the clamp keeps that bound where the
    # mean of subnormal draws underflows to 0 (log p̄_c = -inf would give an infinite score)
    log_ratio = torch.where(samples > 0, samples.log() - mean.log(), 0.0).clamp_(
        max=math.log(samples.shape[0]))
    epistemic = (samples * log_ratio).sum(-1).mean(0).clamp_(min=0.0)
    return total, aleatoric, epistemic


def ood_scores(probs: Any, kind: str = "entropy") -> Tensor:
    """One out-of-distribution score per row, **higher = more likely OOD**: (N,) float64.

    ``probs``: (N, C) probabilities, or (S, N, C) posterior draws (the predictive is their mean).
    ``kind``:

    * ``"entropy"``: predictive entropy (of the mean over draws for (S, N, C) input);
    * ``"max_prob"``: the *negated* maximum probability ``-max_c p_c`` (of the mean over draws),
      so that higher is more OOD; pass ``max_probability(...)`` with ``higher_is_ood=False`` to
      the metrics to keep the confidence itself;
    * ``"mutual_information"``: the epistemic part of `entropy_decomposition` (needs draws);
    * ``"expected_entropy"``: its aleatoric part (needs draws).
    """
    if kind not in SCORE_KINDS:
        raise InvalidInputError(f"kind must be one of {', '.join(SCORE_KINDS)}; got {kind!r}")
    tensor = as_tensor(probs, "probs")
    if tensor.ndim == 3:
        samples = _samples(tensor)
        if kind == "max_prob":
            return -samples.mean(0).amax(-1)
        if kind == "entropy":
            return _entropy(samples.mean(0))
        _total, aleatoric, epistemic = _decomposition(samples)
        return epistemic if kind == "mutual_information" else aleatoric
    if kind in ("mutual_information", "expected_entropy"):
        raise InvalidInputError(
            f"kind={kind!r} needs posterior draws of shape (S, N, C); got shape "
            f"{tuple(tensor.shape)} (one probability vector per row has no epistemic part: "
            "use kind='entropy' or 'max_prob', or pass the draws)"
        )
    if tensor.ndim != 2:
        raise InvalidInputError(
            f"probs must have shape (N, C) or (S, N, C) (posterior draws); got shape "
            f"{tuple(tensor.shape)}"
        )
    if kind == "entropy":
        return predictive_entropy(tensor)
    return -max_probability(tensor)
