"""FedLog sufficient statistics: class-wise sums of augmented features (spec §1.4, §3.2).

For a batch of body features ``phi (B, m)`` and labels ``y (B,)`` the statistic is the table

    T[c] = sum_{i : y_i = c} [1, phi_i]        shape (C, m + 1), bias (count) column first,

so ``T[:, 0]`` holds the class counts and ``T[:, 1:]`` the class-wise feature sums.

Dtype policy. Tables are float64 whatever the feature dtype: float32 features are summed
exactly enough (53-bit mantissas) that a client's table does not depend on how its pass was
chunked beyond float64 rounding, and counts are exact integers up to 2^53. Sums of tables are
carried in double-double arithmetic (a float64 ``table`` plus a float64 ``low`` part holding the
rounding error of every addition, error-free TwoSum), so ``table`` of a sum is the float64
rounding of the sum to about 2^-104 relative: in practice bitwise the same whatever the order or
grouping of the additions (``a + b``, ``sum([...])``, ``0 + a``). A table straight from
`SufficientStatistics.from_features` has a zero low part, which `state_dict` omits,
so a client's message is exactly ``C (m + 1)`` float64 numbers plus the count. (On CUDA the
scatter uses atomic adds, so a single client's table may differ in the last bit between runs;
sums of tables are unaffected.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.errors import InvalidInputError

# float64 entries per block of augmented rows in from_features (512 KiB).
_BLOCK_ELEMENTS = 65_536
# Keys every statistics state dict carries ("table_low" only when non-zero).
_STATE_KEYS = ("table", "count", "privatized")


@dataclass(frozen=True, eq=False)
class SufficientStatistics:
    """Class-wise sums of augmented features ``[1, phi]`` and the sample count.

    Attributes:
        table: float64 tensor ``(C, m + 1)``; column 0 holds class counts, columns ``1:`` the
            class-wise sums of the body features.
        n: total number of samples (an int; for privatised statistics the released count, see
            [`inference.conjugate.privatize`][inference.conjugate.privatize]).
        privatized: True when noise was added; then column 0 need not equal integer counts.
        low: float64 tensor like ``table`` with the rounding error carried by exact
            (double-double) addition; zero for statistics made from features.

    Build with `from_features` (or `zeros`); add with ``+`` or ``sum``.
    """

    table: Tensor
    n: int
    privatized: bool = False
    low: Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.table, Tensor) or self.table.dim() != 2:
            raise InvalidInputError("table must be a tensor of shape (C, m + 1)")
        if self.table.shape[0] < 1 or self.table.shape[1] < 1:
            raise InvalidInputError(f"table must be at least (1, 1), got {tuple(self.table.shape)}")
        if self.table.dtype != torch.float64:
            object.__setattr__(self, "table", self.table.to(torch.float64))
        if self.low is None:
            object.__setattr__(self, "low", torch.zeros_like(self.table))
        elif self.low.shape != self.table.shape or self.low.device != self.table.device:
            raise InvalidInputError("low part must match the table's shape and device")
        elif self.low.dtype != torch.float64:
            object.__setattr__(self, "low", self.low.to(torch.float64))
        if isinstance(self.n, bool) or int(self.n) != self.n or self.n < 0:
            raise InvalidInputError(f"n must be a non-negative integer, got {self.n!r}")
        object.__setattr__(self, "n", int(self.n))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_features(
        cls, features: Tensor, labels: Tensor, num_classes: int
    ) -> SufficientStatistics:
        """Statistics of one batch in a single fused scatter pass, on the features' device.

        Args:
            features: body outputs ``phi``, shape ``(B, m)``, WITHOUT the constant 1 (it is
                accounted for in column 0), finite, any float dtype.
            labels: integer class indices, shape ``(B,)``, in ``[0, num_classes)``.
            num_classes: ``C >= 1``.

        Returns:
            Statistics with a ``(C, m + 1)`` float64 table on ``features.device`` and ``n = B``.

        Raises:
            InvalidInputError: empty batch, wrong shapes, non-integer or out-of-range labels,
                NaN/Inf features, ``num_classes < 1``.
        """
        features, labels = checked_batch(features, labels, num_classes)
        B, m = features.shape
        table = torch.zeros(num_classes, m + 1, dtype=torch.float64, device=features.device)
        # On the CPU, [1, phi] rows are formed in float64 a block at a time: a cache-sized
        # buffer instead of a full float64 copy of the batch (more memory traffic than the sums
        # themselves). On accelerators one block avoids a kernel launch per block.
        block = B if features.device.type != "cpu" else max(1, min(B, _BLOCK_ELEMENTS // (m + 1)))
        rows = torch.empty(block, m + 1, dtype=torch.float64, device=features.device)
        rows[:, 0] = 1.0
        for start in range(0, B, block):
            stop = min(B, start + block)
            chunk = rows[: stop - start]
            chunk[:, 1:] = features[start:stop]
            table.index_add_(0, labels[start:stop], chunk)
        # A NaN or Inf feature always makes its class row non-finite (as does a sum that
        # overflows float64), so the small table is checked instead of the whole batch.
        if not bool(torch.isfinite(table).all()):
            raise InvalidInputError("features contain NaN or Inf; check the body's outputs")
        return cls(table=table, n=B)

    @classmethod
    def zeros(
        cls, num_classes: int, feature_dim: int, device: torch.device | str = "cpu"
    ) -> SufficientStatistics:
        """Empty statistics (``n = 0``), the neutral element of ``+``."""
        if num_classes < 1 or feature_dim < 0:
            raise InvalidInputError("need num_classes >= 1 and feature_dim >= 0")
        table = torch.zeros(num_classes, feature_dim + 1, dtype=torch.float64, device=device)
        return cls(table=table, n=0)

    # ------------------------------------------------------------------ shape

    @property
    def num_classes(self) -> int:
        """``C``."""
        return int(self.table.shape[0])

    @property
    def feature_dim(self) -> int:
        """``m``: body features per sample (the table has ``m + 1`` columns)."""
        return int(self.table.shape[1]) - 1

    @property
    def device(self) -> torch.device:
        """The device holding the table."""
        return self.table.device

    @property
    def class_counts(self) -> Tensor:
        """Column 0 of the table, shape ``(C,)`` (noisy for privatised statistics)."""
        return self.table[:, 0]

    # ------------------------------------------------------------------ algebra

    def __add__(self, other: object) -> SufficientStatistics:
        if isinstance(other, int | float) and other == 0:
            return self
        if not isinstance(other, SufficientStatistics):
            return NotImplemented
        _check_addable(self, other)
        high, low = _double_double_add(self.table, self.low, other.table, other.low)
        return SufficientStatistics(
            table=high, n=self.n + other.n, privatized=self.privatized or other.privatized, low=low
        )

    def __radd__(self, other: object) -> SufficientStatistics:
        return self.__add__(other)

    @classmethod
    def sum(cls, statistics: Iterable[SufficientStatistics]) -> SufficientStatistics:
        """The exact sum of a non-empty collection (same as Python's ``sum``), computed as a
        pairwise tree of vectorised double-double additions."""
        items = list(statistics)
        if not items:
            raise InvalidInputError("cannot sum an empty collection of statistics")
        for item in items[1:]:
            _check_addable(items[0], item)
        high, low = exact_table_sum(
            torch.stack([s.table for s in items]), torch.stack([s.low for s in items])
        )
        return cls(
            table=high,
            n=sum(s.n for s in items),
            privatized=any(s.privatized for s in items),
            low=low,
        )

    @classmethod
    def sum_tables(
        cls, tables: Tensor, n: int, *, privatized: bool = False
    ) -> SufficientStatistics:
        """The exact sum of K stacked float64 tables ``(K, C, m + 1)`` whose counts add to
        ``n``: what `sum` gives for the same statistics, without building K objects."""
        if tables.ndim != 3 or tables.shape[0] == 0:
            raise InvalidInputError(
                f"expected a non-empty stack (K, C, m + 1) of tables, got {tuple(tables.shape)}"
            )
        high, low = exact_table_sum(tables.to(torch.float64), torch.zeros_like(tables,
                                                                             dtype=torch.float64))
        return cls(table=high, n=n, privatized=privatized, low=low)

    # ------------------------------------------------------------------ checks

    def validate(self, atol: float = 1e-6) -> SufficientStatistics:
        """Check finiteness and, unless privatised, that column 0 holds non-negative integer
        class counts summing to ``n`` (within ``atol``). Returns ``self``.

        Raises:
            InvalidInputError: on the first violated invariant, saying which.
        """
        if not bool(torch.isfinite(self.table).all() and torch.isfinite(self.low).all()):
            raise InvalidInputError("statistics contain NaN or Inf entries")
        if self.privatized:
            return self
        counts = self.table[:, 0]
        if bool((counts < -atol).any()):
            raise InvalidInputError("bias column has negative class counts")
        if bool(((counts - counts.round()).abs() > atol).any()):
            raise InvalidInputError("bias column is not integer class counts")
        total = float(counts.sum())
        if abs(total - self.n) > atol * max(1.0, self.n):
            raise InvalidInputError(
                f"bias column sums to {total:g} but n = {self.n}: the counts disagree"
            )
        return self

    # ------------------------------------------------------------------ transport

    def to(self, device: torch.device | str) -> SufficientStatistics:
        """A copy on ``device``."""
        return SufficientStatistics(
            table=self.table.to(device), n=self.n, privatized=self.privatized,
            low=self.low.to(device),
        )

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``table`` (float64 ``(C, m+1)``), ``count`` (int64 scalar),
        ``privatized`` (bool scalar) and, only when non-zero, ``table_low``."""
        state = {
            "table": self.table,
            "count": torch.tensor(self.n, dtype=torch.int64),
            "privatized": torch.tensor(self.privatized),
        }
        if bool((self.low != 0).any()):
            state["table_low"] = self.low
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> SufficientStatistics:
        """Inverse of `state_dict`; validates the result.

        Raises:
            InvalidInputError: missing keys, wrong shapes or a failed `validate`.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise InvalidInputError(f"statistics state lacks {missing}")
        count = state["count"]
        if count.numel() != 1 or count.is_floating_point() or count.is_complex():
            raise InvalidInputError("count must be an integer scalar tensor")
        table = state["table"]
        if not isinstance(table, Tensor) or not table.is_floating_point():
            raise InvalidInputError("table must be a floating-point tensor")
        stats = cls(
            table=table.to(torch.float64),
            n=int(count),
            privatized=bool(state["privatized"]),
            low=state.get("table_low"),
        )
        return stats.validate()

    def __repr__(self) -> str:
        flag = ", privatized" if self.privatized else ""
        return (
            f"SufficientStatistics(C={self.num_classes}, m={self.feature_dim}, n={self.n}"
            f"{flag}, device={self.device})"
        )


def _check_addable(a: SufficientStatistics, b: SufficientStatistics) -> None:
    if b.table.shape != a.table.shape:
        raise InvalidInputError(
            f"cannot add statistics of shapes {tuple(a.table.shape)} and "
            f"{tuple(b.table.shape)} (classes x (features + 1) must match)"
        )
    if b.table.device != a.table.device:
        raise InvalidInputError(
            f"cannot add statistics on {a.table.device} and {b.table.device}; "
            "move one with .to(device) first"
        )


def exact_table_sum(high: Tensor, low: Tensor) -> tuple[Tensor, Tensor]:
    """Double-double sum over the leading axis of ``high + low`` (both ``(K, ...)``, float64):
    a pairwise tree of vectorised additions (log2 K tensor steps). Every addition carries its
    rounding error, so the result is the exact sum to ~2^-104 relative, whatever the order."""
    while high.shape[0] > 1:
        half = high.shape[0] // 2
        pair_high, pair_low = _double_double_add(
            high[:half], low[:half], high[half : 2 * half], low[half : 2 * half]
        )
        if high.shape[0] % 2:
            pair_high = torch.cat([pair_high, high[-1:]])
            pair_low = torch.cat([pair_low, low[-1:]])
        high, low = pair_high, pair_low
    return high[0], low[0]


def _double_double_add(a_high: Tensor, a_low: Tensor, b_high: Tensor, b_low: Tensor
                       ) -> tuple[Tensor, Tensor]:
    """Accurate double-double addition (TwoSum on both parts, renormalised twice)."""
    s, e = _two_sum(a_high, b_high)
    t, f = _two_sum(a_low, b_low)
    e = e + t
    s, e = _fast_two_sum(s, e)
    e = e + f
    return _fast_two_sum(s, e)


def _two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``s + e == a + b`` exactly with ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    b_virtual = s - a
    a_virtual = s - b_virtual
    return s, (a - a_virtual) + (b - b_virtual)


def _fast_two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``s + e == a + b`` exactly, valid when ``|a| >= |b|`` (or ``a == 0``)."""
    s = a + b
    return s, b - (s - a)


def checked_batch(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Validate a ``(B, m)`` floating feature batch and its ``(B,)`` integer labels in
    ``[0, num_classes)`` (same device, ``B >= 1``); return them with int64 labels.

    Raises:
        InvalidInputError: saying which of these fails (finiteness is not checked here).
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise InvalidInputError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    if not isinstance(features, Tensor) or features.dim() != 2:
        raise InvalidInputError("features must be a tensor of shape (B, m)")
    if not features.is_floating_point():
        raise InvalidInputError(f"features must be floating point, got {features.dtype}")
    if not isinstance(labels, Tensor) or labels.dim() != 1:
        raise InvalidInputError("labels must be a tensor of shape (B,)")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise InvalidInputError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.shape[0] != features.shape[0]:
        raise InvalidInputError(
            f"{features.shape[0]} feature rows but {labels.shape[0]} labels"
        )
    if features.shape[0] == 0:
        raise InvalidInputError("empty batch: statistics need at least one sample")
    if labels.device != features.device:
        raise InvalidInputError("labels and features must be on the same device")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise InvalidInputError(
            f"labels must lie in [0, {num_classes}), found values in [{low}, {high}]"
        )
    return features, labels.to(torch.int64)
