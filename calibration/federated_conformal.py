"""The split-conformal threshold of scores spread over clients, without pooling them.

Two protocols; in both a client's scores never leave it.

**Exact: a search over the score values** (`exact_threshold_search`). The pooled
threshold is the k-th smallest of all N scores, ``k = ceil((N + 1)(1 - alpha))``
(`calibration.conformal.quantile_rank`), i.e. the *smallest float t with at least k
scores <= t*. The server looks for that t over the totally ordered float64 values (a float's
bit pattern, read as a signed integer and folded for negatives, orders like the float: no NaN
lies between -inf and +inf). Each step it proposes ``probes`` thresholds; every client answers
with how many of its scores are <= each (`ThresholdCounts`, mergeable by addition), and
the server keeps the bracket ``(lo, hi]`` with ``count(lo) < k <= count(hi)``. The bracket's
width in representable floats falls by a factor ``probes + 1`` a step, so at most
``ceil(64 / log2(probes + 1))`` steps after the first (16 with the default 15 probes) leave
``hi`` as the smallest float with ``count >= k``: *exactly* the pooled threshold, bit for bit.
Per client and step: ``probes`` counts up (int64) and ``probes`` floats down.

**One shot: quantile of quantiles** (FedCP-QQ, Humbert et al., ICML 2023). Client ``j`` sends one
number, the ``l_j``-th smallest of its ``n_j`` scores, with ``n_j`` and ``l_j``; the server takes
the ``k``-th smallest of the ``m`` local quantiles. For exchangeable scores that are almost surely
distinct, ``F(local_j)`` (``F`` the scores' distribution function) is the ``l_j``-th order
statistic of ``n_j`` uniforms, ``Beta(l_j, n_j - l_j + 1)``, independent over clients, so the
coverage of the threshold is exactly

    M = E[V_(k)] = integral_0^1 P(#{j : V_j <= v} < k) dv,   V_j ~ Beta(l_j, n_j - l_j + 1)

(`one_shot_coverage`; with ties in the scores the coverage is at least ``M``). The paper
picks, for m clients of n scores each, the pair ``(l, k)`` whose coverage ``M(l, k)`` is the
smallest that is still ``>= 1 - alpha`` (`one_shot_ranks`), so the guarantee is
``1 - alpha <= coverage = M(l*, k*)``. Clients of unequal sizes each take the ``l`` of that rule
for their own ``n_j`` and the server picks the smallest ``k`` whose ``M`` (computed with every
client's actual ``(l_j, n_j)``) reaches ``1 - alpha``; for equal sizes that is the paper's
``(l*, k*)``. When no pair reaches ``1 - alpha`` (too few scores), the threshold is ``+inf``.
Per client: 3 numbers up (24 bytes of payload), ``alpha`` and ``m`` down. **The bound holds only
for exchangeable clients**: it needs every client's scores to be draws from one distribution
(the paper's iid-clients assumption). Under label skew (clients whose scores differ in
distribution) the quantile of quantiles can sit below the pooled threshold and the coverage
below ``1 - alpha`` (S1, 5 labels per client: 0.876 against a stated 0.901).

**One shot: a quantile sketch** (`sketch_threshold`; the guarantee of the exact search,
whatever the clients' heterogeneity). Client ``j`` sends its ``K_j = min(size, n_j)`` order
statistics at the fixed ranks ``r_i = ceil(i n_j / K_j)``, ``i = 1..K_j`` (so ``r_K = n_j``:
its largest score) and ``n_j`` (`ScoreSketch`). Since ``v_i = s_(r_i) <= t`` implies at
least ``r_i`` of its scores are ``<= t``, ``L_j(t) = max{r_i : v_i <= t}`` is a lower bound on
its count at ``t``; the server takes the smallest sketch value ``T`` with ``sum_j L_j(T) >= k``.
Then at least ``k`` pooled scores are ``<= T``, so ``T >= `` the pooled threshold
*deterministically*, and the coverage is ``>= k / (N + 1) >= 1 - alpha`` under the exact
search's assumption alone (the pooled rows exchangeable with a test row), with no condition
on how the clients differ. The price is over-coverage, bounded by the sketch's resolution: at
the candidate ``t'`` just below ``T`` the lower bounds sum to ``< k``, and a client's scores in
``[t', T)`` lie strictly between two of its consecutive ranks, so fewer than
``k + D`` pooled scores are ``< T``, ``D = sum_j (g_j - 1)`` with ``g_j`` the largest gap
between consecutive ranks (``r_0 = 0``; ``g_j <= ceil(n_j / K_j)``). Hence ``T <= s_(k + D)``
and, for almost surely distinct scores, ``coverage <= (k + D) / (N + 1)``
(`SketchThreshold.coverage_upper_bound`). A client with ``n_j <= size`` sends all its
scores (``g_j = 1``); when every client does, ``T`` is the pooled threshold exactly. Per client:
``K_j + 1`` numbers up, nothing but the request down. What it reveals: ``K_j`` of the client's
calibration scores (FedCP-QQ reveals one; the exact search reveals counts only).
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calibration.conformal import check_alpha, quantile_rank, score_vector
from calibration.errors import CalibrationError, InvalidInputError

DEFAULT_PROBES = 15
"""Thresholds proposed per step of the exact search: 4 bits of the answer a step."""

_SIGN = 1 << 63
_MAGNITUDE = _SIGN - 1


# ---- the ordered integer key of a float64 ------------------------------------------------------
def float_key(x: float) -> int:
    """An integer that orders like the float (``-0.0`` just below ``+0.0``); not for NaN."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & _MAGNITUDE) - 1


def key_float(key: int) -> float:
    """The float of `float_key`'s ``key``."""
    bits = key if key >= 0 else (-key - 1) | _SIGN
    return struct.unpack("<d", struct.pack("<Q", bits & (2**64 - 1)))[0]


_KEY_MIN, _KEY_MAX = float_key(-math.inf), float_key(math.inf)


# ---- the client side: counts at proposed thresholds -------------------------------------------
@dataclass(frozen=True)
class ThresholdCounts:
    """One answer to a step of the exact search, mergeable by ``+`` (sums over clients).

    Attributes:
        thresholds: the proposed thresholds, float64 (B,) (the same for every client).
        at_most: (B,) int64: how many scores are <= each threshold.
        count: how many scores in all.
    """

    thresholds: Tensor
    at_most: Tensor
    count: int

    @classmethod
    def of(cls, scores: Any, thresholds: Any) -> ThresholdCounts:
        """A client's answer: its (n,) scores counted at the (B,) thresholds."""
        s = score_vector(scores)
        t = torch.as_tensor(thresholds, dtype=torch.float64).reshape(-1)
        at_most = (s[None, :] <= t[:, None].to(s.device)).sum(dim=1).cpu()
        return cls(t.cpu(), at_most, int(s.shape[0]))

    def __add__(self, other: ThresholdCounts) -> ThresholdCounts:
        if not isinstance(other, ThresholdCounts):
            return NotImplemented
        if not torch.equal(self.thresholds, other.thresholds):
            raise InvalidInputError("cannot add counts taken at different thresholds")
        return ThresholdCounts(self.thresholds, self.at_most + other.at_most,
                               self.count + other.count)


def counts_problem(answer: ThresholdCounts, expected_count: int | None) -> str | None:
    """None if ``answer`` could come from an honest client, else what is wrong with it:
    counts outside ``[0, n]``, counts that fall as the threshold rises, or an ``n`` that
    changed between steps."""
    n = answer.count
    if n < 1:
        return f"count must be >= 1, got {n}"
    if expected_count is not None and n != expected_count:
        return f"count changed from {expected_count} to {n} during the search"
    c = answer.at_most
    if bool((c < 0).any()) or bool((c > n).any()):
        return f"counts must lie in [0, {n}]"
    order = torch.argsort(answer.thresholds, stable=True)
    if bool((torch.diff(c[order]) < 0).any()):
        return "counts fall as the threshold rises"
    return None


# ---- the server side: the search ---------------------------------------------------------------
@dataclass(frozen=True)
class ExactThreshold:
    """The result of the exact search.

    Attributes:
        threshold: the pooled k-th smallest score (``inf`` when ``k > count``).
        rank: ``k``.
        count: the pooled number of scores ``N``.
        alpha: the miscoverage level.
        steps: proposals sent (the first asks for the counts alone).
    """

    threshold: float
    rank: int
    count: int
    alpha: float
    steps: int


def exact_threshold_search(
    alpha: float, probes: int = DEFAULT_PROBES,
) -> Generator[Tensor, ThresholdCounts, ExactThreshold]:
    """The exact search as a protocol: yields (B,) float64 thresholds to count at, receives
    the clients' summed `ThresholdCounts`, returns `ExactThreshold`.

    The first proposal is ``[+inf]`` (every score counts: the answer gives N).
    """
    alpha = check_alpha(alpha)
    if isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes <= 1024:
        raise InvalidInputError(f"probes must be an integer in [1, 1024], got {probes!r}")
    answer = yield torch.tensor([math.inf], dtype=torch.float64)
    steps = 1
    n = answer.count
    k = quantile_rank(n, alpha)
    if k > n:
        return ExactThreshold(math.inf, k, n, alpha, steps)
    lo, hi = _KEY_MIN, _KEY_MAX  # count(lo) = 0 < k <= n = count(hi): scores are finite
    while hi - lo > 1:
        width = hi - lo
        keys = sorted({lo + width * j // (probes + 1) for j in range(1, probes + 1)} - {lo})
        proposal = torch.tensor([key_float(key) for key in keys], dtype=torch.float64)
        answer = yield proposal
        steps += 1
        if answer.count != n:
            raise CalibrationError(f"the number of scores changed from {n} to {answer.count} "
                                   "during the search")
        for key, at_most in zip(keys, answer.at_most.tolist(), strict=True):
            if at_most >= k:
                hi = key
                break
            lo = key
    return ExactThreshold(key_float(hi) + 0.0, k, n, alpha, steps)


def federated_threshold(client_scores: Sequence[Any], alpha: float,
                        probes: int = DEFAULT_PROBES) -> ExactThreshold:
    """`exact_threshold_search` driven in this process: each client's scores are only
    ever counted at the proposals (what a client computes on its own data); the answers are
    summed. Equal, bit for bit, to `calibration.conformal.conformal_threshold` of the
    pooled scores.
    """
    clients = [score_vector(s) for s in client_scores]
    if not clients:
        raise InvalidInputError("federated_threshold needs at least one client's scores")
    search = exact_threshold_search(alpha, probes)
    proposal = next(search)
    while True:
        total = ThresholdCounts.of(clients[0], proposal)
        for scores in clients[1:]:
            total = total + ThresholdCounts.of(scores, proposal)
        try:
            proposal = search.send(total)
        except StopIteration as done:
            return done.value


# ---- one shot: quantile of quantiles ----------------------------------------------------------
def _beta_cdf(v: np.ndarray, a: int, b: int) -> np.ndarray:
    from scipy.special import betainc

    return betainc(a, b, v)


def one_shot_coverage(ells: Sequence[int], sizes: Sequence[int], k: int) -> float:
    """The exact marginal coverage of the quantile-of-quantiles threshold (module docstring).

    Args:
        ells: ``l_j``, the rank of client j's local quantile (1-based, ``<= n_j``).
        sizes: ``n_j``, client j's number of scores.
        k: the rank of the threshold among the m local quantiles (1-based).

    Returns:
        ``E[V_(k)]``, ``V_j ~ Beta(l_j, n_j - l_j + 1)`` independent: the probability that a
        new exchangeable score is <= the threshold (for almost surely distinct scores).
    """
    return _one_shot_coverage(tuple(int(e) for e in ells), tuple(int(n) for n in sizes), int(k))


# A pure function of its integers, evaluated by adaptive quadrature (~ms each): cached, since a
# server (and one_shot_ranks' search) asks for the same (ranks, sizes, k) again and again.
@functools.lru_cache(maxsize=4096)
def _one_shot_coverage(ells: tuple[int, ...], sizes: tuple[int, ...], k: int) -> float:
    """`one_shot_coverage` on tuples (cached).

    Args:
        ells: ``l_j``, the rank of client j's local quantile (1-based, ``<= n_j``).
        sizes: ``n_j``, client j's number of scores.
        k: the rank of the threshold among the m local quantiles (1-based).

    Returns:
        ``E[V_(k)]``, ``V_j ~ Beta(l_j, n_j - l_j + 1)`` independent: the probability that a
        new exchangeable score is <= the threshold (for almost surely distinct scores).
    """
    from scipy.integrate import quad

    m = len(ells)
    if m != len(sizes) or m == 0 or not 1 <= k <= m:
        raise InvalidInputError(f"need as many ranks as sizes (m >= 1) and 1 <= k <= m; got "
                                f"{len(ells)} ranks, {len(sizes)} sizes, k = {k}")
    params = [(int(ell), int(n) - int(ell) + 1) for ell, n in zip(ells, sizes, strict=True)]
    if any(a < 1 or b < 1 for a, b in params):
        raise InvalidInputError("every rank must lie in [1, n_j]")

    def below_k(v: float) -> float:
        # P(fewer than k of the V_j are <= v): a Poisson-binomial tail, by dynamic programming
        dist = np.zeros(m + 1)
        dist[0] = 1.0
        for a, b in params:
            g = float(_beta_cdf(np.asarray(v), a, b))
            dist[1:] = dist[1:] * (1 - g) + dist[:-1] * g
            dist[0] *= 1 - g
        return float(dist[:k].sum())

    # the integrand falls from 1 to 0 around the local quantiles' means: tell quad where
    means = sorted({a / (a + b) for a, b in params})
    value, _ = quad(below_k, 0.0, 1.0, points=means, limit=500, epsabs=1e-13, epsrel=1e-12)
    return float(value)


def _smallest_ell(m: int, n: int, k: int, level: float) -> tuple[int, float] | None:
    """The smallest l in [1, n] with M(l, k) >= level (M rises with l), with its M."""
    if one_shot_coverage([n] * m, [n] * m, k) < level:
        return None
    lo, hi = 0, n  # M(lo) < level <= M(hi) (M(0) read as 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if one_shot_coverage([mid] * m, [n] * m, k) >= level:
            hi = mid
        else:
            lo = mid
    return hi, one_shot_coverage([hi] * m, [n] * m, k)


@functools.lru_cache(maxsize=1024)
def one_shot_ranks(m: int, n: int, alpha: float) -> tuple[int, int, float] | None:
    """The paper's order statistics for m clients of n scores: ``(l*, k*, M(l*, k*))``, the
    pair with the smallest coverage that is still ``>= 1 - alpha``; None when no pair reaches
    it (then the threshold is ``+inf``)."""
    alpha = check_alpha(alpha)
    best: tuple[int, int, float] | None = None
    for k in range(1, m + 1):
        found = _smallest_ell(m, n, k, 1.0 - alpha)
        if found is not None and (best is None or found[1] < best[2]):
            best = (found[0], k, found[1])
    return best


@dataclass(frozen=True)
class LocalQuantile:
    """A client's one-shot upload: its ``ell``-th smallest score of ``count`` (``inf`` when the
    rule asks for a rank beyond its scores)."""

    value: float
    ell: int
    count: int

    @classmethod
    def of(cls, scores: Any, alpha: float, num_clients: int) -> LocalQuantile:
        """Client side: the local rank from `one_shot_ranks` for ``num_clients`` clients
        of this client's size (``num_clients`` and ``alpha`` are what the server broadcasts)."""
        s = score_vector(scores)
        n = int(s.shape[0])
        ranks = one_shot_ranks(num_clients, n, alpha)
        if ranks is None:
            return cls(math.inf, n + 1, n)
        ell = ranks[0]
        return cls(float(torch.kthvalue(s.cpu(), ell).values) + 0.0, ell, n)


@dataclass(frozen=True)
class OneShotThreshold:
    """The server's quantile of quantiles.

    Attributes:
        threshold: the k-th smallest local quantile (``inf`` when no k reaches the level).
        rank: ``k`` (None when infinite).
        coverage_bound: the exact marginal coverage ``M`` of the threshold (>= 1 - alpha), 1.0
            when infinite.
        alpha: the miscoverage level.
        clients: m.
    """

    threshold: float
    rank: int | None
    coverage_bound: float
    alpha: float
    clients: int


def quantile_of_quantiles(uploads: Sequence[LocalQuantile], alpha: float) -> OneShotThreshold:
    """Server side: the smallest ``k`` whose exact coverage reaches ``1 - alpha`` given every
    client's ``(l_j, n_j)``, and the ``k``-th smallest local quantile."""
    alpha = check_alpha(alpha)
    m = len(uploads)
    if m == 0:
        raise InvalidInputError("quantile_of_quantiles needs at least one client's upload")
    if any(u.ell > u.count for u in uploads):  # some client could not form its quantile
        return OneShotThreshold(math.inf, None, 1.0, alpha, m)
    ells, sizes = [u.ell for u in uploads], [u.count for u in uploads]
    values = sorted(u.value for u in uploads)
    lo, hi = 0, m + 1  # smallest k in [1, m] with M(k) >= 1 - alpha (M rises with k)
    if one_shot_coverage(ells, sizes, m) < 1.0 - alpha:
        return OneShotThreshold(math.inf, None, 1.0, alpha, m)
    hi = m
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if one_shot_coverage(ells, sizes, mid) >= 1.0 - alpha:
            hi = mid
        else:
            lo = mid
    return OneShotThreshold(values[hi - 1], hi, one_shot_coverage(ells, sizes, hi), alpha, m)


def one_shot_threshold(client_scores: Sequence[Any], alpha: float) -> OneShotThreshold:
    """FedCP-QQ driven in this process: each client's `LocalQuantile`, then the
    server's `quantile_of_quantiles`."""
    m = len(client_scores)
    return quantile_of_quantiles([LocalQuantile.of(s, alpha, m) for s in client_scores], alpha)


# ---- one shot: a quantile sketch ---------------------------------------------------------------
SKETCH_SIZE = 32
"""Order statistics a client sends per predictive by default: two predictives' sketches and
counts fit a signed message under 1 KB."""


def sketch_ranks(count: int, size: int = SKETCH_SIZE) -> list[int]:
    """The 1-based ranks ``r_i = ceil(i n / K)``, ``i = 1..K``, ``K = min(size, n)``, of a
    sketch of ``n = count`` scores: increasing, the last is ``n``, gaps at most ``ceil(n / K)``.
    """
    n = _positive(count, "count")
    k = min(_positive(size, "size"), n)
    return [-((-i * n) // k) for i in range(1, k + 1)]


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def max_rank_gap(count: int, size: int = SKETCH_SIZE) -> int:
    """``g``: the largest gap between consecutive ranks of `sketch_ranks` (``r_0 = 0``)."""
    ranks = [0, *sketch_ranks(count, size)]
    return max(b - a for a, b in itertools.pairwise(ranks))


@dataclass(frozen=True)
class ScoreSketch:
    """A client's one-shot sketch: the order statistics of its scores at
    `sketch_ranks` ``(count, size)``.

    Attributes:
        values: (K,) float64, non-decreasing: the ``r_i``-th smallest scores.
        count: ``n``, the client's number of scores.
        size: the requested ``K`` (the sketch holds ``min(size, n)`` values).
    """

    values: Tensor
    count: int
    size: int = SKETCH_SIZE

    def __post_init__(self) -> None:
        ranks = sketch_ranks(self.count, self.size)
        v = self.values
        if not isinstance(v, Tensor) or v.shape != (len(ranks),) or v.dtype != torch.float64:
            raise InvalidInputError(f"a sketch of {self.count} scores holds {len(ranks)} float64 "
                                    f"values, got {getattr(v, 'shape', v)!r}")
        if not bool(torch.isfinite(v).all()) or bool((torch.diff(v) < 0).any()):
            raise InvalidInputError("sketch values must be finite and non-decreasing")

    @classmethod
    def of(cls, scores: Any, size: int = SKETCH_SIZE) -> ScoreSketch:
        """Client side: the sketch of its (n,) finite scores."""
        s = torch.sort(score_vector(scores).cpu()).values
        n = int(s.shape[0])
        index = torch.tensor(sketch_ranks(n, size), dtype=torch.int64) - 1
        return cls(s[index] + 0.0, n, size)

    @property
    def ranks(self) -> list[int]:
        return sketch_ranks(self.count, self.size)

    def at_most_lower(self, thresholds: Tensor) -> Tensor:
        """(B,) int64 lower bounds on how many of the client's scores are ``<= thresholds``."""
        below = torch.searchsorted(self.values, thresholds, right=True)  # values <= t
        ranks = torch.tensor([0, *self.ranks], dtype=torch.int64)
        return ranks[below]

    def below_upper(self, thresholds: Tensor) -> Tensor:
        """(B,) int64 upper bounds on how many of the client's scores are ``< thresholds``:
        ``r_i - 1`` for the first sketch value ``>= t`` (``n`` when none)."""
        first = torch.searchsorted(self.values, thresholds, right=False)  # values < t
        ranks = torch.tensor([*self.ranks, self.count + 1], dtype=torch.int64)
        return ranks[first] - 1


@dataclass(frozen=True)
class SketchThreshold:
    """The server's threshold from the clients' sketches.

    Attributes:
        threshold: the smallest sketch value whose pooled lower-bounded count reaches ``k``
            (``inf`` when ``k > N``): ``>=`` the pooled split-conformal threshold, always.
        rank: ``k = ceil((N + 1)(1 - alpha))``.
        count: ``N``, the pooled number of scores.
        alpha: the miscoverage level.
        slack: ``D = sum_j (g_j - 1)``: ``threshold <= s_(k + D)``, the ``(k + D)``-th smallest
            pooled score (0: the exact pooled threshold).
        coverage_upper_bound: ``min(1, (k + D) / (N + 1))``, the marginal coverage's upper
            bound for almost surely distinct exchangeable scores (the lower one is
            ``k / (N + 1) >= 1 - alpha``).
        clients: the number of sketches.
    """

    threshold: float
    rank: int
    count: int
    alpha: float
    slack: int
    coverage_upper_bound: float
    clients: int

    @property
    def coverage_lower_bound(self) -> float:
        """``k / (N + 1)`` (1.0 when the threshold is infinite)."""
        return 1.0 if self.rank > self.count else self.rank / (self.count + 1)


def sketch_threshold(sketches: Sequence[ScoreSketch], alpha: float) -> SketchThreshold:
    """Server side (module docstring): the smallest candidate ``T`` among the sketch values with
    ``sum_j L_j(T) >= k``; ``T >= `` the pooled threshold whatever the clients' scores."""
    alpha = check_alpha(alpha)
    if not sketches:
        raise InvalidInputError("sketch_threshold needs at least one client's sketch")
    n = sum(s.count for s in sketches)
    k = quantile_rank(n, alpha)
    slack = sum(max_rank_gap(s.count, s.size) - 1 for s in sketches)
    if k > n:
        return SketchThreshold(math.inf, k, n, alpha, slack, 1.0, len(sketches))
    candidates = torch.unique(torch.cat([s.values for s in sketches]))  # sorted
    lower = sum(s.at_most_lower(candidates) for s in sketches)
    # the largest candidate is every client's largest score: the lower bound there is N >= k
    first = int(torch.nonzero(lower >= k)[0, 0])
    bound = min(1.0, (k + slack) / (n + 1))
    return SketchThreshold(float(candidates[first]) + 0.0, k, n, alpha, slack, bound,
                           len(sketches))


def one_shot_sketch_threshold(client_scores: Sequence[Any], alpha: float,
                              size: int = SKETCH_SIZE) -> SketchThreshold:
    """The sketch protocol driven in this process: each client's `ScoreSketch`, then
    the server's `sketch_threshold`."""
    return sketch_threshold([ScoreSketch.of(s, size) for s in client_scores], alpha)


__all__ = [
    "DEFAULT_PROBES",
    "SKETCH_SIZE",
    "ExactThreshold",
    "LocalQuantile",
    "OneShotThreshold",
    "ScoreSketch",
    "SketchThreshold",
    "ThresholdCounts",
    "counts_problem",
    "exact_threshold_search",
    "federated_threshold",
    "float_key",
    "key_float",
    "max_rank_gap",
    "one_shot_coverage",
    "one_shot_ranks",
    "one_shot_sketch_threshold",
    "one_shot_threshold",
    "quantile_of_quantiles",
    "sketch_ranks",
    "sketch_threshold",
]
