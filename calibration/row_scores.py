"""One pass over a prediction matrix: per-sample confidence, correctness, Brier and log-likelihood.

Every metric in `calibration` is built from these per-row quantities, computed in a single
chunked sweep over the (N, K) array with validation folded into reductions that are needed anyway
(a full ``isfinite`` over the array would cost more than the metrics):

* NaN and +-Inf propagate into the row sum, so a row sum outside ``1 +- SUM_TOLERANCE`` (a
  non-finite sum always is) flags them along with badly normalised rows;
* a negative entry has its IEEE sign bit set, so the minimum of the bit pattern read as a signed
  integer (one scalar per sweep step) is negative; the per-row maximum of the same bit pattern is
  the largest probability of a valid (non-negative) row, so no separate float ``max`` is needed.

Only when something is flagged is the array re-examined exactly, to say what is wrong (and to
accept ``-0.0``, which has its sign bit set but is an ordinary zero).

On the CPU the same quantities come from `calibration.native_sweep`, a compiled kernel that
reads every row once (the torch sweep takes about seven reads); the torch sweep remains the path
for other devices, for arrays the kernel flags, and where no C compiler is available. The
kernel also histograms the confidences when bin edges are known before the sweep (uniform bins).

Prediction convention: the predicted class is the first class attaining the row maximum (as
``torch.argmax``/``numpy.argmax``). It is found without an ``argmax`` (several times slower than
``amax`` on CPU): a sample is correct when its label's probability equals the row maximum and no
lower-index class ties with it. A tie at the maximum m needs two entries equal to m, hence
``sum_k p_k^2 >= 2 m^2`` (and m <= 1/2): the row norm, computed in the same sweep (the Brier score
needs it anyway), rules out ties in all but the few rows whose two largest entries nearly tie, and
only those rows are re-examined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from calibration import native_sweep
from calibration.bin_stats import binned_sums
from calibration.binning import edges_in_dtype
from calibration.errors import InvalidInputError
from calibration.inputs import as_tensor, class_labels, flag, score_matrix

SUM_TOLERANCE = 1e-3
"""Absolute tolerance on ``|sum_k p_k - 1|`` per row (float32 softmax rows are well within it).

Inputs in a coarser format get their format's own bound, see `sum_tolerance`."""

PROBABILITY_FLOOR = 1e-12
"""Smallest probability used in the NLL: ``-log(max(p_y, 1e-12))`` <= 27.6 nats.

A model that puts probability exactly 0 on the true class would otherwise make the NLL infinite,
which poisons every mean, merge and bootstrap it enters; the floor keeps it finite while still
charging such a sample far more than any honestly uncertain one. Logit inputs use the same floor.
"""

# Sweep steps of about a core's L2 cache, so the reductions after the first read the chunk from
# cache; the tie check runs once per block of steps (still in the last-level cache), which keeps
# the number of small operations down. (Measured on 2 cores: 2 MB steps beat 16 MB, 64 MB and a
# single step when the machine is quiet; every step ends in a thread-pool barrier, so on a
# heavily shared CPU fewer steps can win.)
_CHUNK_BYTES = 2 * 1024 * 1024
_BLOCK_BYTES = 16 * 1024 * 1024
# sqrt(2) less a 1e-3 margin for the rounding of the norm (relative error ~K * 6e-8 in float32).
_TIE_NORM_RATIO = math.sqrt(2.0) * (1.0 - 1e-3)
_BITS_DTYPE = {torch.float32: torch.int32, torch.float64: torch.int64}


@dataclass(frozen=True, eq=False)
class RowScores:
    """What one sweep found, for N samples.

    ``confidence``: (N,) top-label probability (input dtype, input device), or None;
    ``correct``: (N,) bool, argmax class == label, or None;
    ``brier_sum``: sum over samples of sum_k (p_k - 1[y=k])^2, or None if not requested;
    ``nll_sum``: sum over samples of -log max(p_y, `PROBABILITY_FLOOR`), or None;
    ``bin_sums``: for the ``edges`` passed to `row_scores`, per-bin (count int64, sum of
    confidence float64, number correct int64), each (n_bins,), or None.
    """

    count: int
    confidence: Tensor | None
    correct: Tensor | None
    brier_sum: float | None
    nll_sum: float | None
    bin_sums: tuple[Tensor, Tensor, Tensor] | None = None


def row_scores(
    probs: Any,
    labels: Any,
    *,
    from_logits: bool = False,
    confidence: bool = True,
    brier: bool = False,
    log_prob: bool = False,
    edges: Tensor | None = None,
) -> RowScores:
    """Validate ``probs`` (N, K) and ``labels`` (N,) and compute the requested per-row quantities.

    ``probs`` are probabilities (rows >= 0 summing to 1 within `sum_tolerance`) unless
    ``from_logits=True``, in which case they are finite logits turned into probabilities with a
    softmax. Nothing is ever guessed from the values. ``edges`` (n_bins + 1,) float64: also
    histogram the top-label confidences over these bins (``RowScores.bin_sums``).
    """
    flag(from_logits, "from_logits", " (the kind of scores is stated, never guessed)")
    given = as_tensor(probs, "logits" if from_logits else "probs")
    scores = score_matrix(given, "logits" if from_logits else "probs")
    n_samples, n_classes = scores.shape
    label_index = class_labels(labels, n_samples, n_classes, scores.device)
    if from_logits:
        return _from_logits(scores, label_index, confidence, brier, log_prob, edges)
    return _from_probabilities(scores, label_index, confidence, brier, log_prob, edges,
                               sum_tolerance(given.dtype))


def sum_tolerance(dtype: torch.dtype) -> float:
    """Tolerance on ``|sum_k p_k - 1|`` for probabilities given in ``dtype``.

    `SUM_TOLERANCE`, or the format's machine epsilon where that is larger (bfloat16: 2**-7,
    the float8 formats): rounding K probabilities to a format of unit roundoff u = eps / 2
    changes each by at most u * p_k, hence their sum by at most u * sum_k p_k = u, so a row
    that summed to 1 before rounding is always within eps (twice the bound) after it.
    """
    if dtype.is_floating_point:
        return max(SUM_TOLERANCE, float(torch.finfo(dtype).eps))
    return SUM_TOLERANCE


def _from_logits(
    logits: Tensor, labels: Tensor, confidence: bool, brier: bool, log_prob: bool,
    edges: Tensor | None,
) -> RowScores:
    if not bool(torch.isfinite(logits).all()):
        row = int((~torch.isfinite(logits)).any(1).nonzero()[0, 0])
        raise InvalidInputError(f"logits contain NaN or Inf (first in row {row})")
    log_probs = torch.log_softmax(logits, dim=1)
    scores = _from_probabilities(log_probs.exp(), labels, confidence, brier, False, edges,
                                 SUM_TOLERANCE)
    nll_sum = None
    if log_prob:
        label_log_prob = log_probs.gather(1, labels[:, None])
        label_log_prob = label_log_prob.clamp_(min=math.log(PROBABILITY_FLOOR))
        nll_sum = -float(label_log_prob.sum(dtype=torch.float64))
    return replace(scores, nll_sum=nll_sum)


def _from_probabilities(
    probs: Tensor, labels: Tensor, confidence: bool, brier: bool, log_prob: bool,
    edges: Tensor | None, tolerance: float,
) -> RowScores:
    native = native_sweep.sweep(
        probs, labels, tolerance=tolerance, top=confidence, label_prob=brier or log_prob,
        squares=brier, edges=None if edges is None else edges_in_dtype(edges, probs.dtype),
    )
    if native is not None and native.valid:
        return _from_native(native, probs.shape[0], brier, log_prob, edges)
    # The torch sweep: on other devices, without the kernel, or to examine a flagged array.
    scores = _torch_sweep(probs, labels, confidence or edges is not None, brier, log_prob,
                          tolerance)
    if edges is None:
        return scores
    bin_sums = binned_sums(scores.confidence, scores.correct, edges.to(probs.device))
    if confidence:
        return replace(scores, bin_sums=bin_sums)
    return replace(scores, confidence=None, correct=None, bin_sums=bin_sums)


def _from_native(
    native: native_sweep.NativeSweep, n_samples: int, brier: bool, log_prob: bool,
    edges: Tensor | None,
) -> RowScores:
    brier_sum = nll_sum = None
    if brier:
        label_total = float(native.label_prob.sum(dtype=torch.float64))
        brier_sum = native.squares - 2.0 * label_total + n_samples
    if log_prob:
        log_label = native.label_prob.clamp(min=PROBABILITY_FLOOR).log_()
        nll_sum = -float(log_label.sum(dtype=torch.float64))
    return RowScores(n_samples, native.top, native.correct, brier_sum, nll_sum,
                     native.bin_sums if edges is not None else None)


def _torch_sweep(
    probs: Tensor, labels: Tensor, confidence: bool, brier: bool, log_prob: bool,
    tolerance: float = SUM_TOLERANCE,
) -> RowScores:
    n_samples, n_classes = probs.shape
    bits_dtype = _BITS_DTYPE[probs.dtype]
    bits = probs.view(bits_dtype)
    device = probs.device
    step, n_steps, steps_per_block = _sweep_plan(probs)
    max_bits = torch.empty(n_samples, dtype=bits_dtype, device=device) if confidence else None
    step_min_bits = torch.empty(n_steps, dtype=bits_dtype, device=device)
    row_sum = torch.empty(n_samples, dtype=probs.dtype, device=device)
    label_prob = torch.empty(n_samples, 1, dtype=probs.dtype, device=device)
    need_norm = brier or confidence
    row_norm = torch.empty(n_samples, dtype=probs.dtype, device=device) if need_norm else None
    correct = torch.empty(n_samples, dtype=torch.bool, device=device) if confidence else None
    ones = torch.ones(n_classes, dtype=probs.dtype, device=device)
    column = labels[:, None]

    for index, start in enumerate(range(0, n_samples, step)):
        rows = slice(start, min(start + step, n_samples))
        chunk, chunk_bits = probs[rows], bits[rows]
        # One minimum per step: its sign bit says whether any entry has its sign bit set.
        torch.amin(chunk_bits, dim=(0, 1), out=step_min_bits[index])
        torch.mv(chunk, ones, out=row_sum[rows])
        torch.gather(chunk, 1, column[rows], out=label_prob[rows])
        if max_bits is not None:
            torch.amax(chunk_bits, dim=1, out=max_bits[rows])
        if row_norm is not None:
            torch.linalg.vector_norm(chunk, dim=1, out=row_norm[rows])
        block_done = (index + 1) % steps_per_block == 0 or rows.stop == n_samples
        if correct is not None and block_done:  # while the block is still in cache
            block = slice(index // steps_per_block * steps_per_block * step, rows.stop)
            correct[block] = _first_maximum_is_label(
                probs[block], column[block], max_bits[block].view(probs.dtype),
                label_prob[block, 0], row_norm[block],
            )

    _check_rows(probs, bits, bool((step_min_bits < 0).any()), row_sum, tolerance)
    label_prob = label_prob.squeeze(1)
    top = max_bits.view(probs.dtype) if max_bits is not None else None
    brier_sum = None
    if brier:
        # sum_i sum_k (p_ik - 1[y_i=k])^2 = sum_i ||p_i||^2 - 2 sum_i p_iy_i + N, summed in float64
        squares = float(row_norm.square().sum(dtype=torch.float64))
        brier_sum = squares - 2.0 * float(label_prob.sum(dtype=torch.float64)) + n_samples
    nll_sum = None
    if log_prob:
        nll_sum = -float(label_prob.clamp(min=PROBABILITY_FLOOR).log_().sum(dtype=torch.float64))
    return RowScores(n_samples, top, correct, brier_sum, nll_sum)


def _sweep_plan(probs: Tensor) -> tuple[int, int, int]:
    """Rows per sweep step, number of steps, steps per tie-check block."""
    n_samples, n_classes = probs.shape
    if probs.device.type != "cpu":  # on accelerators one launch per reduction is best
        return n_samples, 1, 1
    step = max(1, _CHUNK_BYTES // (n_classes * probs.element_size()))
    return step, -(-n_samples // step), max(1, _BLOCK_BYTES // _CHUNK_BYTES)


def _check_rows(probs: Tensor, bits: Tensor, sign_bit_seen: bool, row_sum: Tensor,
                tolerance: float) -> None:
    """Raise InvalidInputError for non-finite, negative or badly normalised rows.

    NaN/Inf anywhere in a row make its sum non-finite, which fails the ``<= tolerance`` test;
    ``sign_bit_seen`` (some entry is negative, -0.0, -NaN or -Inf) triggers an exact scan.
    """
    if sign_bit_seen:
        signed_rows = (bits < 0).any(1).nonzero().squeeze(1)
        flagged = probs.index_select(0, signed_rows)
        flagged_bits = bits.index_select(0, signed_rows)
        # Sign bit and something more: below zero (-0.0 is an ordinary zero). Bits, not a float
        # compare, which a denormals-are-zero mode would make blind to negative subnormals.
        negative = ((flagged_bits < 0) & (flagged_bits != torch.iinfo(bits.dtype).min)).any(1)
        if bool(negative.any()):
            row = int(signed_rows[negative.nonzero()[0, 0]])
            non_finite = ~torch.isfinite(flagged[negative.nonzero()[0, 0]]).all()
            if not bool(non_finite):
                raise InvalidInputError(
                    f"probs contain negative values ({int(negative.sum())} bad rows, "
                    f"first: row {row}); if these are logits pass from_logits=True"
                )
    deviation = (row_sum - 1.0).abs_()
    if bool((deviation <= tolerance).all()):
        return
    non_finite = ~torch.isfinite(row_sum)
    if bool(non_finite.any()):
        row = int(non_finite.nonzero()[0, 0])
        raise InvalidInputError(
            f"probs contain NaN or Inf ({int(non_finite.sum())} bad rows, first: row {row})"
        )
    off = ~(deviation <= tolerance)
    row = int(off.nonzero()[0, 0])
    raise InvalidInputError(
        f"probability rows must sum to 1 (tolerance {tolerance:g}); row {row} sums to "
        f"{row_sum[row].item():.6g} ({int(off.sum())} bad rows); "
        "if these are logits pass from_logits=True"
    )


def _first_maximum_is_label(
    probs: Tensor, label_column: Tensor, top: Tensor, label_prob: Tensor, row_norm: Tensor
) -> Tensor:
    """Bool (n,): the first class attaining the row maximum is the label (argmax semantics).

    ``probs`` (n, K), ``label_column`` (n, 1) int64, ``top`` / ``label_prob`` / ``row_norm`` (n,).
    """
    correct = label_prob == top
    # Two entries equal to the maximum m imply ||p||_2 >= sqrt(2) m (so also m <= 1/2).
    maybe_tied = correct & (row_norm >= _TIE_NORM_RATIO * top)
    rows = maybe_tied.nonzero().squeeze(1)
    if rows.numel():
        # Largest entry other than the label's own: a tie iff it equals the maximum.
        others = probs.index_select(0, rows).scatter_(1, label_column[rows], -1.0)
        tied = rows[others.amax(1) == top[rows]]
        if tied.numel():
            first = probs.index_select(0, tied).argmax(1)
            correct[tied] = first == label_column[tied, 0]
    return correct
