"""Mergeable calibration state: per-bin sums plus Brier/NLL sums.

An `Accumulator` holds, for ``n_bins`` equal-width bins (see `calibration.binning`),
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

import numpy as np
import torch
from torch import Tensor

from calibration.bin_stats import BinStats
from calibration.binning import MAX_BIN_CELLS, bin_indices, check_n_bins, uniform_edges
from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, index_array, positive_int
from calibration.metrics import metrics_from_totals
from calibration.row_scores import PROBABILITY_FLOOR, row_scores

_STATE_KEYS = ("bin_counts", "bin_confidence_sums", "bin_correct_counts", "brier_sum", "nll_sum")


class Accumulator:
    """Streaming, mergeable ECE/MCE/Brier/NLL/accuracy over batches or clients.

    ``update`` adds a batch, ``merge`` (or ``+``, ``sum(...)``, `merged`) combines
    accumulators into a new one, ``compute`` returns the metrics dict of
    `calibration.metrics.evaluate`. Tensors live on the device of the first batch seen
    (or ``device`` when given).
    """

    def __init__(self, n_bins: int = 15, device: torch.device | str | None = None) -> None:
        self.n_bins = check_n_bins(n_bins)
        self._device = as_device(device)
        self._held: dict[str, Tensor] | None = None
        # (stacked state, row) when the state is that row of a stack (`per_group`)
        self._row: tuple[dict[str, Tensor], int] | None = None

    @property
    def _state(self) -> dict[str, Tensor] | None:
        """The state tensors (None before the first sample); a `per_group` row's are
        views of its row of the stack, made when first asked for."""
        if self._held is None and self._row is not None:
            stack, g = self._row
            self._held = {key: stack[key][g] for key in _STATE_KEYS}
        return self._held

    @_state.setter
    def _state(self, state: dict[str, Tensor] | None) -> None:
        self._held, self._row = state, None

    @property
    def _holds_state(self) -> bool:
        """Whether there is a state (``_state is not None``, without making a row's views)."""
        return self._held is not None or self._row is not None

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

    @classmethod
    def per_group(
        cls, probs: Any, labels: Any, groups: Any, num_groups: int, n_bins: int = 15
    ) -> list[Accumulator]:
        """One accumulator per group from one validated sweep over all rows.

        ``probs`` (N, K) probabilities, ``labels`` (N,), ``groups`` (N,) ints in
        ``[0, num_groups)``. Accumulator g holds exactly the bin counts and correct counts of
        ``Accumulator(n_bins).update(rows of group g)`` and the same float64 sums up to
        summation order (~1e-15 relative): the state of many clients, scored together.
        """
        n_bins = check_n_bins(n_bins)
        num_groups = positive_int(num_groups, "num_groups")
        if num_groups * n_bins > MAX_BIN_CELLS:
            raise InvalidInputError(
                f"num_groups x n_bins = {num_groups:,} x {n_bins:,} = {num_groups * n_bins:,} "
                f"cells exceeds the limit of {MAX_BIN_CELLS:,} (MAX_BIN_CELLS, about 56 bytes "
                "each); use fewer bins or score the groups in batches"
            )
        probs = as_tensor(probs, "probs")
        scores = row_scores(probs, labels)  # validates; top-label confidence and correctness
        probs = probs.to(torch.float64)
        labels = as_tensor(labels, "labels").to(device=probs.device, dtype=torch.int64)
        groups = as_tensor(groups, "groups")
        if tuple(groups.shape) != tuple(labels.shape):
            raise InvalidInputError(
                f"groups must have shape {tuple(labels.shape)} (one group per sample); "
                f"got {tuple(groups.shape)}"
            )
        if groups.dtype == torch.bool:
            raise InvalidInputError("groups must be integer group indices; got dtype torch.bool")
        groups = index_array(groups, "groups", num_groups, f"for {num_groups} groups",
                             probs.device)
        label_prob = probs.gather(1, labels[:, None])[:, 0]
        # per-sample Brier sum_k (p_k - 1[y=k])^2 = ||p||^2 - 2 p_y + 1; NLL -log max(p_y, floor)
        brier = probs.square().sum(1) - 2.0 * label_prob + 1.0
        nll = -label_prob.clamp(min=PROBABILITY_FLOOR).log()
        edges = uniform_edges(n_bins, device=probs.device)
        cell = groups * n_bins + bin_indices(scores.confidence, edges).to(torch.int64)
        size = num_groups * n_bins
        pairs = torch.bincount(cell * 2 + scores.correct, minlength=2 * size).view(size, 2)
        confidence = torch.zeros(size, dtype=torch.float64, device=probs.device)
        confidence.index_add_(0, cell, scores.confidence.to(torch.float64))
        sums = torch.zeros(2, num_groups, dtype=torch.float64, device=probs.device)
        sums[0].index_add_(0, groups, brier)
        sums[1].index_add_(0, groups, nll)
        counts = pairs.sum(1).view(num_groups, n_bins)
        correct = pairs[:, 1].reshape(num_groups, n_bins)
        confidence = confidence.view(num_groups, n_bins)
        # one stacked state; group g's accumulator is its row g (views, made when first used:
        # no copies and no tensors per group; an update of one writes its own row), and
        # merged/compute_each read the stack
        stack = {"bin_counts": counts, "bin_confidence_sums": confidence,
                 "bin_correct_counts": correct, "brier_sum": sums[0], "nll_sum": sums[1]}
        out = []
        for g in range(num_groups):
            acc = cls.__new__(cls)
            acc.n_bins, acc._device, acc._held, acc._row = n_bins, probs.device, None, (stack, g)
            out.append(acc)
        return out

    @staticmethod
    def compute_each(accumulators: Iterable[Accumulator]) -> list[dict[str, float]]:
        """``[a.compute() for a in accumulators]`` computed together (vectorised over the
        accumulators; the same formulas: ECE = sum_b n_b |acc_b - conf_b| / N over non-empty
        bins, MCE their maximum gap). All must share ``n_bins`` and hold samples."""
        items = _accumulator_list(accumulators)
        if not items:
            return []
        if len({a.n_bins for a in items}) != 1:
            raise InvalidInputError("compute_each needs accumulators with one number of bins")
        if not all(a._holds_state for a in items):
            raise InvalidInputError("the accumulator is empty: update it with at least one "
                                    "sample")
        stacked = _stacked_states(items, torch.device("cpu"))
        counts, conf, correct, brier, nll = (stacked[key].numpy() for key in _STATE_KEYS)
        totals = counts.sum(1)
        if bool((totals == 0).any()):
            raise InvalidInputError("the accumulator is empty: update it with at least one "
                                    "sample")
        nonempty = counts > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            gaps = np.abs(correct / counts - conf / counts)
        ece = np.where(nonempty, counts * gaps, 0.0).sum(1) / totals
        mce = np.where(nonempty, gaps, -np.inf).max(1)
        accuracy = correct.sum(1) / totals
        columns = (accuracy, ece, mce, brier / totals, nll / totals, totals)
        keys = ("accuracy", "ece", "mce", "brier", "nll", "count")
        return [dict(zip(keys, row, strict=True))
                for row in zip(*(c.tolist() for c in columns), strict=True)]

    # -- merging -------------------------------------------------------------------------
    def merge(self, other: Accumulator) -> Accumulator:
        """A new accumulator holding the samples of both (self's device). Inputs are unchanged."""
        if not isinstance(other, Accumulator):
            raise InvalidInputError(
                f"can only merge an Accumulator; got {type(other).__name__}"
            )
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
        items = _accumulator_list(accumulators)
        if not items:
            raise InvalidInputError("cannot merge an empty collection of accumulators")
        if len({a.n_bins for a in items}) != 1:
            raise InvalidInputError("cannot merge accumulators with different numbers of bins")
        result = Accumulator(items[0].n_bins, device=items[0].device)
        holding = [a for a in items if a._holds_state]
        if holding:  # one stacked sum per key (same sums as pairwise merges, one allocation)
            stacked = _stacked_states(holding, result.device)
            result._state = {key: stacked[key].sum(0) for key in _STATE_KEYS}
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
        """Rebuild an accumulator from `state_dict` output, validating it first."""
        if not isinstance(state, Mapping):
            raise InvalidInputError(
                f"an accumulator state is a mapping of name -> tensor; got {type(state).__name__}"
            )
        missing = [key for key in _STATE_KEYS if key not in state]
        extra = [key for key in state if key not in _STATE_KEYS]
        if missing or extra:
            raise InvalidInputError(
                f"accumulator state has missing keys {missing} / unexpected keys {extra}"
            )
        tensors = {key: as_tensor(state[key], key) for key in _STATE_KEYS}
        for key, tensor in tensors.items():
            if tensor.dtype == torch.bool:
                raise InvalidInputError(f"{key} must be numeric; got dtype torch.bool")
            if key in ("bin_counts", "bin_correct_counts") and tensor.is_floating_point() and not (
                    bool((tensor == tensor.round()).all())):
                raise InvalidInputError(f"{key} must hold whole numbers (sample counts)")
        counts = tensors["bin_counts"]
        if counts.ndim != 1 or counts.numel() == 0:
            raise InvalidInputError(
                f"bin_counts must be 1-D and non-empty; got shape {tuple(counts.shape)}"
            )
        n_bins = check_n_bins(counts.numel())
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
        target = as_device(device) or counts.device
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


def _accumulator_list(accumulators: Any) -> list[Accumulator]:
    """``accumulators`` (any iterable of Accumulator) as a list, or InvalidInputError."""
    try:
        items = list(accumulators)
    except TypeError:
        raise InvalidInputError(
            f"expected an iterable of Accumulators; got {type(accumulators).__name__}"
        ) from None
    strangers = [type(a).__name__ for a in items if not isinstance(a, Accumulator)]
    if strangers:
        raise InvalidInputError(f"expected Accumulators only; got a {strangers[0]}")
    return items


def _stacked_states(items: list[Accumulator], device: torch.device) -> dict[str, Tensor]:
    """Key -> the items' states stacked along a new first axis (row i is item i's), on
    ``device``; every item holds a state.

    Rows of `Accumulator.per_group` stacks are read from the stack (one indexing per
    key, not one tensor per item); the values are the same either way, so the sums over
    them are bitwise those of stacking the items' own tensors.
    """
    sources: dict[int, dict[str, Tensor]] = {}
    for a in items:
        if a._row is None:
            break
        sources.setdefault(id(a._row[0]), a._row[0])
    else:
        if len(sources) == 1:
            (stack,) = sources.values()
            rows = [a._row[1] for a in items]
            size = int(stack["bin_counts"].shape[0])
            if rows == list(range(size)):
                return {key: stack[key].to(device) for key in _STATE_KEYS}
            index = torch.tensor(rows, dtype=torch.int64, device=stack["bin_counts"].device)
            return {key: stack[key].index_select(0, index).to(device) for key in _STATE_KEYS}
    return {key: torch.stack([a._state[key].to(device) for a in items])
            for key in _STATE_KEYS}


def as_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a torch.device (None stays None), or InvalidInputError."""
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidInputError(
            f"device must be a torch device such as 'cpu' or 'cuda:0'; got {device!r}"
        ) from None
