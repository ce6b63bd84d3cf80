"""Defences against uploads that pass the schema but no honest client could send.

A schema check catches wrong names, shapes, dtypes and NaN/Inf; it cannot catch a finite but
absurd upload (parameters x1e3, a sample count of 2**40). The server has three tools, named as
the literature names them:

- **Screening** (a safe default of ours, not from a paper): reject an upload whose size is more
  than ``ratio`` times the round's median, for the update norm ``||w_c - w_global||`` and the
  declared sample count. Honest clients of one round differ by small factors; a poisoner who
  stays under the ratio can shift a K-client mean by at most ``ratio / K`` median updates.
- **Norm bounding** (Sun et al., 2019, "Can You Really Backdoor Federated Learning?"): every
  update ``w_c - w_global`` is scaled down to L2 norm at most ``M`` before averaging.
- **Coordinate-wise median** and **coordinate-wise trimmed mean** (Yin et al., 2018,
  "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"): per coordinate,
  the median of the K values, or the mean after removing the ``floor(beta K)`` largest and
  smallest. Both ignore sample-count weights, as in the paper.

Sample counts are also held to what a client declared before: the server keeps each client's
first accepted ``num_samples`` in its state (``declared/<client id>``) and rejects a later
count above it (a client's data set does not grow during a run here).

**One screening API for every strategy.** A strategy's ``upload_problems`` is
`first_reasons` over columns of per-upload reasons, in priority order: its own
invariants, `count_problems` (``num_samples`` at least 1, not above the declared count,
screened against the round's median) and `screening_reasons` for each size it screens
(an update norm, a distance, CoLearn's and FD's total class count). The decision (flag a value
above ``ratio`` times the round's lower median; nothing without a ratio, with one upload, or
when that median is 0) and the reason's wording (``"<what> <value> is more than <ratio>x the
round's median <median> (screening_ratio)"``) are therefore the same in every strategy and in
the run's ``rejections``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from bayesfl.errors import ConfigError
from bayesfl.messages import Message
from bayesfl.strategies.base import RoundPlan
from bayesfl.strategies.uploads import num_samples_problem

AGGREGATIONS = ("mean", "median", "trimmed-mean")
DECLARED = "declared/"
"""Server-state prefix of the clients' first declared sample counts (int64 scalars)."""


def check_robust_options(
    aggregation: str, trim_fraction: float, norm_bound: float | None,
    screening_ratio: float | None,
) -> None:
    """ConfigError naming the first invalid robust-aggregation option."""
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got "
                          f"{aggregation!r}")
    if not (_is_number(trim_fraction) and 0 <= trim_fraction < 0.5):
        raise ConfigError(f"trim_fraction must be a number in [0, 0.5), got {trim_fraction!r}")
    if norm_bound is not None and not (_is_number(norm_bound) and 0 < norm_bound < math.inf):
        raise ConfigError(f"norm_bound must be a finite number > 0 or None, got {norm_bound!r}")
    if screening_ratio is not None and not (
            _is_number(screening_ratio) and 1 < screening_ratio < math.inf):
        raise ConfigError(f"screening_ratio must be a finite number > 1 or None (no "
                          f"screening), got {screening_ratio!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def coordinate_median(stacked: Tensor) -> Tensor:
    """Per-coordinate median of ``stacked`` (K, ...) over its first dimension; for even K the
    mean of the two middle values (torch.median would return the lower one)."""
    ordered = stacked.sort(dim=0).values
    k = stacked.shape[0]
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2


def trimmed_mean(stacked: Tensor, trim_fraction: float) -> Tensor:
    """Per-coordinate mean of ``stacked`` (K, ...) after dropping its ``floor(trim_fraction
    K)`` largest and smallest values (Yin et al. 2018's beta-trimmed mean)."""
    k = stacked.shape[0]
    cut = math.floor(trim_fraction * k)
    if cut == 0:
        return stacked.mean(dim=0)
    return stacked.sort(dim=0).values[cut:k - cut].mean(dim=0)


def combine(stacked: Tensor, weights: Tensor, aggregation: str, trim_fraction: float) -> Tensor:
    """The aggregate of ``stacked`` (K, ...): the ``weights``-weighted mean (weights (K,)
    summing to 1), the coordinate-wise median, or the trimmed mean."""
    if aggregation == "median":
        return coordinate_median(stacked)
    if aggregation == "trimmed-mean":
        return trimmed_mean(stacked, trim_fraction)
    return torch.tensordot(weights.to(stacked.dtype), stacked, dims=1)


def norm_scales(norms: Tensor, bound: float | None) -> Tensor:
    """Per update, the factor ``min(1, bound / norm)`` that norm bounding applies (ones when
    ``bound`` is None)."""
    if bound is None:
        return torch.ones_like(norms)
    return torch.clamp(bound / norms.clamp_min(torch.finfo(norms.dtype).tiny), max=1.0)


def screen(values: Tensor, ratio: float | None) -> Tensor:
    """Bool (K,): the ``values`` (K,) above ``ratio`` times their lower median.

    The lower median is an honest client's value whenever fewer than half the uploads are
    hostile, even for K = 2. Nothing is flagged without a ratio, with one value, or when the
    median is 0 (no scale to compare with).
    """
    if ratio is None or values.numel() < 2:
        return torch.zeros(values.shape, dtype=torch.bool)
    median = values.median()
    if not bool(median > 0):
        return torch.zeros(values.shape, dtype=torch.bool)
    return values > ratio * median


def screening_reasons(
    values: Tensor, ratio: float | None, what: str
) -> list[str | None]:
    """`screen` as per-upload reasons (None for accepted ones)."""
    flagged = screen(values, ratio)
    median = float(values.median()) if values.numel() else 0.0
    return [f"{what} {float(v):.4g} is more than {ratio:g}x the round's median {median:.4g} "
            "(screening_ratio)" if bad else None
            for v, bad in zip(values.tolist(), flagged.tolist(), strict=True)]


def declared_problems(
    state: Mapping[str, Tensor], client_ids: Sequence[int], counts: Sequence[int]
) -> list[str | None]:
    """Per upload, a reason if its sample count exceeds the client's first declared one."""
    reasons: list[str | None] = []
    for cid, n in zip(client_ids, counts, strict=True):
        declared = state.get(f"{DECLARED}{cid}")
        if declared is not None and n > int(declared):
            reasons.append(f"num_samples {n} exceeds the {int(declared)} this client declared "
                           "in its first accepted upload")
        else:
            reasons.append(None)
    return reasons


def declared_ledger_problem(state: Mapping[str, Tensor], num_clients: int) -> str | None:
    """The first ``declared/<client id>`` tensor of a server state received from outside (a
    checkpoint to resume) that this run cannot have written: not an int64 scalar, a count
    below 1, or a client id outside ``0 .. num_clients - 1``; None if the ledger fits. (A
    declared count is read with ``int()`` every round: a wrong shape would stop the run
    there.)"""
    for name, tensor in state.items():
        if not name.startswith(DECLARED):
            continue
        cid = name[len(DECLARED):]
        if not cid.isdigit() or int(cid) >= num_clients:
            return (f"server tensor {name!r} names no client of this run "
                    f"(0 to {num_clients - 1})")
        if tensor.dtype != torch.int64 or tensor.dim() != 0:
            return (f"server tensor {name!r} is {tensor.dtype} of shape {tuple(tensor.shape)}; "
                    "a declared sample count is a torch.int64 scalar")
        if int(tensor) < 1:
            return (f"server tensor {name!r} declares {int(tensor)} samples; a declared "
                    "sample count is at least 1")
    return None


def declarations(
    state: Mapping[str, Tensor], client_ids: Sequence[int], counts: Sequence[int]
) -> dict[str, Tensor]:
    """The ledger of first declared counts after accepting ``counts`` from ``client_ids``."""
    ledger = {k: v for k, v in state.items() if k.startswith(DECLARED)}
    for cid, n in zip(client_ids, counts, strict=True):
        ledger.setdefault(f"{DECLARED}{cid}", torch.tensor(int(n), dtype=torch.int64))
    return ledger


def first_reasons(*columns: Sequence[str | None]) -> list[str | None]:
    """Per upload, the first non-None reason across ``columns`` (checks in priority order)."""
    return [next((r for r in row if r is not None), None) for row in zip(*columns, strict=True)]


def count_problems(plan: RoundPlan, messages: Sequence[Message],
                   screening_ratio: float | None) -> list[str | None]:
    """Per upload, the first problem of its ``num_samples``: below 1, above the client's first
    declared count (the ledger in ``plan.state``), or more than ``screening_ratio`` times the
    round's median count (None: counts are not screened)."""
    ids = [m.header.client_id for m in messages]
    counts = [int(m.tensors["num_samples"].item()) for m in messages]
    return first_reasons(
        [num_samples_problem(m) for m in messages],
        declared_problems(plan.state, ids, counts),
        screening_reasons(torch.tensor(counts, dtype=torch.float64), screening_ratio,
                          "num_samples"))
