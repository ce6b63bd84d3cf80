"""Confidence bins: the edges ECE, MCE and the reliability diagram share.

Conventions (the same as netcal's equal-width binning):

* ``"uniform"`` (default): ``n_bins`` equal-width bins on [0, 1]; edge ``k`` is ``k * (1 / n_bins)``
  in float64 and the last edge is exactly 1.0 (what ``numpy.linspace(0, 1, n_bins + 1)`` gives).
* ``"quantile"`` (adaptive, equal-mass): inner edges are the linear-interpolation quantiles
  (``numpy.quantile``'s default) of the confidences at ``k / n_bins``; the first edge is forced to
  0 and the last to 1. Repeated confidences can make edges coincide, leaving empty bins.
* Every bin is half-open ``[a, b)`` except the last, which is closed ``[a, 1]``: a confidence of
  exactly 1.0 falls in the last bin and 0.0 in the first.
* Empty bins contribute nothing to ECE and are skipped by MCE.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from calibration.errors import InvalidInputError
from calibration.inputs import positive_int

MAX_BINS = 1_000_000
"""The most bins any metric, accumulator, report or diagram accepts.

Every bin costs memory in every table built from it (an accumulator holds 24 bytes per bin, a
reliability table 32, a report one accumulator per client, the native sweep a histogram per block
of rows), so ``n_bins`` must be bounded before anything is allocated: a million bins keep one
table under about 60 MB, where 1e8 bins needed gigabytes. Nothing informative is lost: a bin's
accuracy needs samples, and even a billion predictions give only a thousand per bin at this limit
(ECE is usually computed with 10-20 bins).
"""

MAX_BIN_CELLS = 1 << 24
"""The most (group, bin) cells built in one call of `Accumulator.per_group`: clients times
bins, about 56 bytes each while they are summed, so at most about 1 GB."""


class Binning(enum.StrEnum):
    """How bin edges are placed. Accepts the strings ``"uniform"`` and ``"quantile"``."""

    UNIFORM = "uniform"
    QUANTILE = "quantile"

    @classmethod
    def parse(cls, value: Binning | str) -> Binning:
        """Return the member for ``value`` (a member or its string name, case-insensitive)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(repr(m.value) for m in cls)
            raise InvalidInputError(f"binning must be one of {choices}; got {value!r}") from None


def check_n_bins(n_bins: int) -> int:
    """Validate ``n_bins`` (a positive integer of any integer type, at most `MAX_BINS`)
    and return it as a Python int."""
    return positive_int(n_bins, "n_bins", MAX_BINS,
                        " (MAX_BINS: memory grows with every bin; 10-20 bins are usual)")


def uniform_edges(n_bins: int, device: torch.device | str | None = None) -> Tensor:
    """Equal-width edges on [0, 1]: float64 tensor of shape (n_bins + 1,)."""
    n_bins = check_n_bins(n_bins)
    edges = torch.arange(n_bins + 1, dtype=torch.float64, device=device) * (1.0 / n_bins)
    edges[-1] = 1.0
    return edges


def quantile_edges(confidences: Tensor, n_bins: int) -> Tensor:
    """Equal-mass edges from ``confidences`` (N,): float64 tensor of shape (n_bins + 1,).

    Linear interpolation between order statistics (numpy's default ``method="linear"``),
    computed with a sort so that it works for any N (``torch.quantile`` caps the input size).
    """
    n_bins = check_n_bins(n_bins)
    values = confidences.to(torch.float64).sort().values
    n = values.numel()
    positions = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=values.device)
    positions = positions * (n - 1)
    lower = positions.floor().long()
    upper = positions.ceil().long()
    fraction = positions - lower
    edges = values[lower] + (values[upper] - values[lower]) * fraction
    edges[0] = 0.0
    edges[-1] = 1.0
    # Interpolation rounding must not make edges decrease (bucketize needs them sorted).
    return torch.cummax(edges, dim=0).values


def bin_edges(confidences: Tensor, n_bins: int, binning: Binning | str) -> Tensor:
    """Edges for ``binning`` ("uniform" ignores the confidences), float64 (n_bins + 1,)."""
    if Binning.parse(binning) is Binning.QUANTILE:
        return quantile_edges(confidences, n_bins)
    return uniform_edges(n_bins, device=confidences.device)


def bin_indices(confidences: Tensor, edges: Tensor) -> Tensor:
    """Bin index in ``[0, n_bins)`` of each confidence (N,), as int32 (N,).

    Bins are ``[edges[i], edges[i+1])``; the last is closed so 1.0 lands in bin ``n_bins - 1``.
    Membership is decided exactly as a float64 comparison with the float64 edges would decide it,
    without widening the confidences (see `edges_in_dtype`). Equal-width edges take an
    arithmetic path (``floor(c * n_bins)`` corrected by one comparison each way), others a
    binary search.
    """
    n_bins = edges.numel() - 1
    confidences = confidences.contiguous()
    exact_edges = edges_in_dtype(edges, confidences.dtype, confidences.device)
    if torch.equal(edges.cpu(), uniform_edges(n_bins)):
        index = (confidences * n_bins).to(torch.int32).clamp_(0, n_bins - 1)
        # The product can round across an edge by one ulp; compare with the edges to settle it
        # (index_select: much faster than advanced indexing on CPU).
        index -= torch.lt(confidences, exact_edges.index_select(0, index)).to(torch.int32)
        index += torch.ge(confidences, exact_edges.index_select(0, index + 1)).to(torch.int32)
    else:
        index = torch.bucketize(confidences, exact_edges, right=True, out_int32=True) - 1
    return index.clamp_(0, n_bins - 1)


def edges_in_dtype(
    edges: Tensor, dtype: torch.dtype, device: torch.device | str | None = None
) -> Tensor:
    """float64 ``edges`` in ``dtype`` (float32 or float64), each rounded up to that dtype.

    For a float32 confidence c and a float64 edge e, ``c >= e`` holds exactly when ``c >= e32``
    where e32 is the smallest float32 not below e, so comparing in float32 against e32 gives the
    same bins as widening every confidence to float64.
    """
    edges = edges.to(device=device if device is not None else edges.device, dtype=torch.float64)
    if dtype == torch.float64:
        return edges
    narrow = edges.to(dtype)
    below = narrow.to(torch.float64) < edges
    upward = torch.nextafter(narrow, torch.full_like(narrow, float("inf")))
    return torch.where(below, upward, narrow)
