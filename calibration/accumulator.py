"""Mergeable calibration state: per-bin sums plus Brier/NLL sums.

An :class:`Accumulator` holds, for ``n_bins`` equal-width bins (see :mod:`calibration.binning`),
the number of samples, the sum of top-label confidence and the number of correct predictions,
plus the summed per-sample Brier score and NLL. These are plain sums, so the state of several
clients merges by addition: the merged accumulator gives the pooled (micro) metrics of all their
samples together, equal to scoring the concatenated data (up to float64 summation order,
~1e-15 relative). Quantile bins depend on the data and therefore cannot be merged; accumulators
always use equal-width bins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from calibration.bin_stats import BinStats
from calibration.binning import check_n_bins, uniform_edges
from calibration.errors import InvalidInputError
from calibration.metrics import metrics_from_totals
from calibration.row_scores import row_scores

_STATE_KEYS = ("bin_counts", "bin_confidence_sums", "bin_correct_counts", "brier_sum", "nll_sum")


class Accumulator:
    """Streaming, mergeable ECE/MCE/Brier/NLL/accuracy over batches or clients.

    ``update`` adds a batch, ``merge`` (or ``+``, ``sum(...)``, :meth:`merged`) combines
    accumulators into a new one, ``compute`` returns the metrics dict of
    :func:`calibration.metrics.evaluate`. Tensors live on the device of the first batch seen
    (or ``device`` when given).
    """

    def __init__(self, n_bins: int = 15, device: torch.device | str | None = None) -> None:
        self.n_bins = check_n_bins(n_bins)
        self._device = torch.device(device) if device is not None else None
        self._state: dict[str, Tensor] | None = None

    # -- state ---------------------------------------------------------------------------
    def _empty_state(self, device: torch.device) -> dict[str, Tensor]:
        return {
            "bin_counts": torch.zeros(self.n_bins, dtype=torch.int64, device=device),
            "bin_confidence_sums": torch.zeros(self.n_bins, dtype=torch.float64, device=device),
            "bin_correct_counts": torch.zeros(self.n_bins, dtype=torch.int64, device=device),
            "brier_sum": torch.zeros((), dtype=torch.float64, device=device),
            "nll_sum": torch.zeros((), dtype=torch.float64, device=device),
        }

    def _state_on(self, device: torch.device) -> dict[str, Tensor]:
        if self._state is None:
            self._state = self._empty_state(self._device or device)
        return self._state

    @property
    def device(self) -> torch.device:
        if self._state is not None:
            return self._state["bin_counts"].device
        return self._device or torch.device("cpu")

    @property
    def count(self) -> int:
        """Number of samples accumulated so far."""
        return 0 if self._state is None else int(self._state["bin_counts"].sum())

    def update(self, probs: Any, labels: Any, from_logits: bool = False) -> Accumulator:
        """Add a batch of ``probs`` (N, K) (or logits) and ``labels`` (N,); returns self."""
        scores = row_scores(probs, labels, from_logits=from_logits, confidence=False,
                            brier=True, log_prob=True, edges=uniform_edges(self.n_bins))
        counts, confidence_sums, correct_counts = scores.bin_sums
        state = self._state_on(counts.device)
        device = state["bin_counts"].device
        state["bin_counts"] += counts.to(device)
        state["bin_confidence_sums"] += confidence_sums.to(device)
        state["bin_correct_counts"] += correct_counts.to(device)
        state["brier_sum"] += scores.brier_sum
        state["nll_sum"] += scores.nll_sum
        return self

    # -- merging -------------------------------------------------------------------------
    def merge(self, other: Accumulator) -> Accumulator:
        """A new accumulator holding the samples of both (self's device). Inputs are unchanged."""
        if not isinstance(other, Accumulator):
            raise TypeError(f"can only merge an Accumulator, got {type(other).__name__}")
        if other.n_bins != self.n_bins:
            raise InvalidInputError(
                f"cannot merge accumulators with {self.n_bins} and {other.n_bins} bins"
            )
        merged = Accumulator(self.n_bins, device=self.device)
        state = merged._state_on(self.device)
        for source in (self, other):
            if source._state is not None:
                for key in _STATE_KEYS:
                    state[key] += source._state[key].to(merged.device)
        return merged

    def __add__(self, other: Accumulator) -> Accumulator:
        return self.merge(other)

    def __radd__(self, other: Any) -> Accumulator:
        # sum(accumulators) starts from the integer 0.
        if isinstance(other, int) and other == 0:
            return self.merge(Accumulator(self.n_bins, device=self.device))
        return NotImplemented

    @classmethod
    def merged(cls, accumulators: Iterable[Accumulator]) -> Accumulator:
        """Merge any number of accumulators (at least one) into a new one."""
        items = list(accumulators)
        if not items:
            raise InvalidInputError("cannot merge an empty collection of accumulators")
        result = items[0].merge(Accumulator(items[0].n_bins, device=items[0].device))
        for item in items[1:]:
            result = result.merge(item)
        return result

    # -- results -------------------------------------------------------------------------
    def bin_stats(self) -> BinStats:
        """Reliability table (equal-width bins) of everything accumulated."""
        state = self._state_on(self.device)
        return BinStats.from_sums(
            uniform_edges(self.n_bins),
            state["bin_counts"],
            state["bin_confidence_sums"],
            state["bin_correct_counts"],
        )

    def compute(self) -> dict[str, float]:
        """Metrics dict with keys accuracy, ece, mce, brier, nll (floats) and count (int)."""
        if self.count == 0:
            raise InvalidInputError("the accumulator is empty: update it with at least one sample")
        state = self._state
        return metrics_from_totals(
            self.bin_stats(), float(state["brier_sum"]), float(state["nll_sum"])
        )

    # -- serialisation -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only (safe for safetensors/npz messages): copies, on the current device.

        Keys: bin_counts (int64, n_bins), bin_confidence_sums (float64, n_bins),
        bin_correct_counts (int64, n_bins), brier_sum and nll_sum (float64 scalars).
        """
        state = self._state_on(self.device)
        return {key: state[key].clone() for key in _STATE_KEYS}

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Tensor], device: torch.device | str | None = None
    ) -> Accumulator:
        """Rebuild an accumulator from :meth:`state_dict` output, validating it first."""
        missing = [key for key in _STATE_KEYS if key not in state]
        extra = [key for key in state if key not in _STATE_KEYS]
        if missing or extra:
            raise InvalidInputError(
                f"accumulator state has missing keys {missing} / unexpected keys {extra}"
            )
        tensors = {key: torch.as_tensor(state[key]) for key in _STATE_KEYS}
        counts = tensors["bin_counts"]
        if counts.ndim != 1 or counts.numel() == 0:
            raise InvalidInputError(
                f"bin_counts must be 1-D and non-empty; got shape {tuple(counts.shape)}"
            )
        n_bins = counts.numel()
        for key in ("bin_confidence_sums", "bin_correct_counts"):
            if tuple(tensors[key].shape) != (n_bins,):
                raise InvalidInputError(f"{key} must have shape ({n_bins},)")
        for key in ("brier_sum", "nll_sum"):
            if tensors[key].numel() != 1:
                raise InvalidInputError(f"{key} must be a scalar")
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise InvalidInputError(f"{key} contains NaN or Inf")
            if bool((tensor < 0).any()):
                raise InvalidInputError(f"{key} contains negative values")
        correct, confidence = tensors["bin_correct_counts"], tensors["bin_confidence_sums"]
        if bool((correct > counts).any()) or bool((confidence > counts * (1 + 1e-9)).any()):
            raise InvalidInputError("per-bin sums exceed the bin counts: inconsistent state")
        target = torch.device(device) if device is not None else counts.device
        accumulator = cls(n_bins, device=target)
        accumulator._state = {
            "bin_counts": counts.to(target, torch.int64).clone(),
            "bin_confidence_sums": confidence.to(target, torch.float64).clone(),
            "bin_correct_counts": correct.to(target, torch.int64).clone(),
            "brier_sum": tensors["brier_sum"].to(target, torch.float64).reshape(()).clone(),
            "nll_sum": tensors["nll_sum"].to(target, torch.float64).reshape(()).clone(),
        }
        return accumulator

    def __repr__(self) -> str:
        return f"Accumulator(n_bins={self.n_bins}, count={self.count}, device={self.device})"
