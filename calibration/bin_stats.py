"""Per-bin statistics of top-label confidence: the table behind ECE, MCE and the diagram.

ECE = sum_b (n_b / N) |acc_b - conf_b| over non-empty bins (empty bins contribute nothing);
MCE = max_b |acc_b - conf_b| over non-empty bins. Both lie in [0, 1].

L2 calibration error = sqrt(sum_b (n_b / N) (acc_b - conf_b)^2). Its plug-in estimate is
biased upwards: even a perfectly calibrated model has (acc_b - conf_b)^2 of order
acc_b (1 - acc_b) / n_b from sampling alone. The debiased estimate of Kumar, Liang & Ma
("Verified Uncertainty Calibration", NeurIPS 2019) subtracts acc_b (1 - acc_b) / (n_b - 1) from
each bin's squared gap (bins with fewer than 2 samples contribute 0), clips the weighted sum at
0 and takes the square root; the paper pairs it with equal-mass bins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from calibration.binning import bin_indices
from calibration.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class BinStats:
    """Reliability table over ``n_bins`` confidence bins (numpy arrays on the CPU).

    edges: float64 (n_bins + 1,) bin edges in [0, 1]; counts: int64 (n_bins,) samples per bin;
    mean_confidence, accuracy: float64 (n_bins,) per-bin averages, NaN where the bin is empty.
    """

    edges: np.ndarray
    counts: np.ndarray
    mean_confidence: np.ndarray
    accuracy: np.ndarray

    @classmethod
    def from_sums(cls, edges: Tensor, counts: Tensor, confidence_sums: Tensor,
                  correct_counts: Tensor) -> BinStats:
        """Build from per-bin sums (any device): count, sum of confidence, number correct."""
        counts_np = counts.detach().cpu().numpy().astype(np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_conf = confidence_sums.detach().cpu().double().numpy() / counts_np
            accuracy = correct_counts.detach().cpu().double().numpy() / counts_np
        empty = counts_np == 0
        mean_conf[empty] = np.nan
        accuracy[empty] = np.nan
        return cls(edges.detach().cpu().double().numpy(), counts_np, mean_conf, accuracy)

    @property
    def n_bins(self) -> int:
        return int(self.counts.shape[0])

    @property
    def total(self) -> int:
        """Number of samples N."""
        return int(self.counts.sum())

    @property
    def correct_total(self) -> int:
        """Number of correctly predicted samples (recovered exactly from the per-bin accuracy)."""
        mask = self.nonempty
        return round(float(np.sum(self.accuracy[mask] * self.counts[mask])))

    @property
    def nonempty(self) -> np.ndarray:
        """Bool (n_bins,): bins holding at least one sample."""
        return self.counts > 0

    @property
    def gaps(self) -> np.ndarray:
        """|accuracy - mean confidence| per bin, NaN for empty bins."""
        return np.abs(self.accuracy - self.mean_confidence)

    @property
    def ece(self) -> float:
        if self.total == 0:
            raise InvalidInputError("no samples: ECE is undefined")
        mask = self.nonempty
        return float(np.sum(self.counts[mask] * self.gaps[mask]) / self.total)

    @property
    def mce(self) -> float:
        if self.total == 0:
            raise InvalidInputError("no samples: MCE is undefined")
        return float(np.max(self.gaps[self.nonempty]))

    def squared_l2_error(self, debiased: bool = False) -> float:
        """``sum_b (n_b / N) (acc_b - conf_b)^2``; ``debiased=True``: Kumar et al.'s unbiased
        estimate of it, which can be negative (it is not clipped here)."""
        if self.total == 0:
            raise InvalidInputError("no samples: the calibration error is undefined")
        mask = self.nonempty
        counts, accuracy = self.counts[mask], self.accuracy[mask]
        squares = self.gaps[mask] ** 2
        if debiased:
            spread = accuracy * (1.0 - accuracy) / np.maximum(counts - 1, 1)
            squares = np.where(counts >= 2, squares - spread, 0.0)
        return float(np.sum(counts * squares)) / self.total

    def l2_error(self, debiased: bool = False) -> float:
        """L2 calibration error in [0, 1]: the root of `squared_l2_error` (clipped at 0)."""
        return float(np.sqrt(max(self.squared_l2_error(debiased), 0.0)))


def binned_sums(
    confidence: Tensor, correct: Tensor, edges: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin (count int64, sum of confidence float64, number correct int64), each (n_bins,).

    ``confidence`` (N,) float, ``correct`` (N,) bool, ``edges`` (n_bins + 1,) float64.
    """
    n_bins = edges.numel() - 1
    index = bin_indices(confidence, edges)
    confidence_sums = torch.bincount(index, weights=confidence.to(torch.float64),
                                     minlength=n_bins)
    # One histogram over (bin, correct) pairs gives both the counts and the correct counts
    # (int32 indices: bincount is several times faster on them than on int64).
    pairs = torch.bincount(index * 2 + correct.to(torch.int32), minlength=2 * n_bins)
    pairs = pairs.view(n_bins, 2)
    return pairs.sum(1), confidence_sums, pairs[:, 1].contiguous()


def bin_stats_from_confidence(confidence: Tensor, correct: Tensor, edges: Tensor) -> BinStats:
    """Reliability table from per-sample confidence (N,) and correctness (N,) bool."""
    return BinStats.from_sums(edges, *binned_sums(confidence, correct, edges))
