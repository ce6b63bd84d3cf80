"""FedLog-C's auxiliary compactness loss (spec §4.1, §9.9).

Each client adds to its cross-entropy the mean squared distance between a sample's body
feature and the *global* mean feature of its class, taken from the latest broadcast statistic:

    L_c = alpha * (1/B) * sum_i || phi_i - mean_{y_i} ||^2,     mean_y = T[y, 1:] / T[y, 0],

(the constant feature contributes nothing). The means are constants (no gradient). A class with
no global samples (count <= 0) has no mean; its samples contribute 0 but still count in ``B``.
Noisy (privatised) counts are clamped to >= 1 before dividing (spec §9.16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from inference.conjugate.statistics import SufficientStatistics, checked_batch
from inference.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class ClassMeans:
    """Global class-mean body features.

    Attributes:
        means: ``(C, m)`` mean feature of each class (zeros where absent).
        present: ``(C,)`` bool, True where the class has a positive global count.
    """

    means: Tensor
    present: Tensor

    @classmethod
    def from_statistics(
        cls,
        statistics: SufficientStatistics,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ClassMeans:
        """Means from (summed) statistics, computed in float64 then cast to ``dtype`` on
        ``device`` (default: the statistics' device). Compute once per round."""
        counts = statistics.table[:, 0]
        present = counts > 0
        means = statistics.table[:, 1:] / counts.clamp(min=1.0).unsqueeze(1)
        means = torch.where(present.unsqueeze(1), means, torch.zeros_like(means))
        device = statistics.device if device is None else device
        return cls(means=means.to(device=device, dtype=dtype), present=present.to(device))


def compactness_loss(
    features: Tensor,
    labels: Tensor,
    class_means: ClassMeans | SufficientStatistics,
    alpha: float = 0.01,
) -> Tensor:
    """FedLog-C's ``alpha * mean_i ||phi_i - mean_{y_i}||^2`` (differentiable in ``features``).

    Args:
        features: body outputs ``(B, m)`` (without the constant 1), requiring grad as usual.
        labels: ``(B,)`` integer labels in ``[0, C)``, on the features' device.
        class_means: `ClassMeans` (precomputed on the features' device) or the global
            statistics (converted on each call).
        alpha: weight >= 0 (paper ablation range 0.001 .. 0.1; default 0.01).

    Returns:
        A scalar tensor in the features' dtype on their device (squared feature units).

    Raises:
        InvalidInputError: ``alpha < 0``, features not ``(B, m)`` floating point, labels not
            ``(B,)`` integers in ``[0, C)``, an empty batch.
    """
    if not alpha >= 0:
        raise InvalidInputError(f"alpha must be >= 0, got {alpha!r}")
    if isinstance(class_means, SufficientStatistics):
        class_means = ClassMeans.from_statistics(class_means, features.device, features.dtype)
    num_classes, feature_dim = class_means.means.shape
    features, labels = checked_batch(features, labels, num_classes)
    if features.shape[1] != feature_dim:
        raise InvalidInputError(
            f"features must be (B, {feature_dim}), got {tuple(features.shape)}"
        )
    targets = class_means.means.to(features.device, features.dtype)[labels].detach()
    mask = class_means.present.to(features.device)[labels].to(features.dtype)
    squared = (features - targets).pow(2).sum(dim=1) * mask
    return alpha * squared.mean()
