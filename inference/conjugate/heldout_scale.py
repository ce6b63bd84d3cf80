"""The feature scale chosen by held-out label likelihood, from sums a federation can add.

`fit_conjugate_head`'s ``"validation"`` criterion,
``sum_i -log p(y_i | s phi_i, W*(s))`` over held-out examples, with ``W*(s)`` the conjugate MAP
of the *training* statistics at scale ``s``, is a sum over examples: each client can evaluate
its own share on a fixed grid of ``s`` and the server adds the clients' vectors. The grid is
`HELDOUT_SCALE_GRID` (1/32 to 8, four points an octave: a step of 19% in ``s``), and the
choice is the grid's minimum refined by the parabola through it and its two neighbours in
``log s`` (`scale_from_grid`), so it is a deterministic function of the summed vector.

Why held-out data: a body trained on its examples maps them closer to their class means than
new examples, so every criterion of training features (their label likelihood, the model's own
evidence) leans to an overconfident scale; held-out examples see the spread new data have.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.conjugate.posterior import ConjugatePosterior
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError
from inference.log_grid import argmin_on_log_grid, geometric_grid

HELDOUT_SCALE_GRID: tuple[float, ...] = geometric_grid(-20, 12, 4, 2.0)
"""33 feature scales, ``2^(k/4)`` for ``k = -20 .. 12`` (1/32 to 8): each client scores them
all; the choice takes those up to `HELDOUT_SCALE_CAP`."""

HELDOUT_SCALE_CAP = 1.0
"""The largest scale the held-out choice takes (`scale_from_grid`): it tempers the model's
own scale (s = 1), never sharpens it.

Why. A held-out slice shows overconfidence by its confidently wrong examples; it can favour a
sharper predictive only by having none. Where the task is easy and the slice small, that is
no evidence: FedLog on digits (20 clients, ``shards:2``, the demo's setting: a few held-out
examples a client, none misclassified) had a held-out NLL near 0 at every s >= 1, chose s
well above 1 and predicted near one-hot, several times the test NLL of the choice capped at 1
at equal accuracy (commit 6dfa019's message has the paired runs). On S1 the choice settles
well below 1 (the ``chosen`` scales in ``bench/results/s1_shift.jsonl``) and the cap changes
nothing there."""


def heldout_nll_grid(
    statistics: SufficientStatistics,
    prior: ConjugatePrior,
    features: Tensor,
    labels: Tensor,
    grid: tuple[float, ...] = HELDOUT_SCALE_GRID,
) -> Tensor:
    """Summed held-out label NLL (nats) of the MAP head at every scale of ``grid``.

    Args:
        statistics: the training statistics ``(C, m)`` the heads are solved from.
        prior: the conjugate prior.
        features: ``(V, m - 1)`` held-out body features; labels: ``(V,)`` int in ``[0, C)``.
        grid: scales ``s > 0``.

    Returns:
        ``(len(grid),)`` float64 on the CPU: ``sum_i -log softmax(W*(s) [1, phi_i])[y_i]``
        (the head ``W*(s)`` acts on the unscaled features; zeros when ``V = 0``).
    """
    _check_rows(statistics.feature_dim, features, labels)
    if features.shape[0] == 0:
        return torch.zeros(len(grid), dtype=torch.float64)
    return heldout_nll_of_heads(grid_heads(statistics, prior, grid), features, labels)


def grid_heads(
    statistics: SufficientStatistics,
    prior: ConjugatePrior,
    grid: tuple[float, ...] = HELDOUT_SCALE_GRID,
) -> Tensor:
    """The MAP heads ``W*(s)`` ``(len(grid), C, m)`` float64 of ``statistics`` at every scale
    of ``grid`` (acting on unscaled features): what `heldout_nll_grid` scores with, to
    be solved once and shared by every client scoring under the same statistics."""
    return torch.stack([ConjugatePosterior(prior, statistics, feature_scale=scale).map()
                        for scale in grid])


def heldout_nll_of_heads(heads: Tensor, features: Tensor, labels: Tensor) -> Tensor:
    """`heldout_nll_grid` with the grid's heads given (`grid_heads`): ``(G,)``
    float64 on the CPU, the summed label NLL of ``features`` ``(V, m - 1)`` under each head
    ``(G, C, m)``."""
    _check_rows(heads.shape[-1] - 1, features, labels)
    return heldout_nll_by_group(heads, features, labels, [features.shape[0]])[0]


def heldout_nll_by_group(heads: Tensor, features: Tensor, labels: Tensor,
                         sizes: list[int]) -> Tensor:
    """`heldout_nll_of_heads` of consecutive row groups at once: ``(K, G)`` float64 on the
    CPU, row ``k`` the summed label NLL of the ``sizes[k]`` rows of ``features`` ``(V, m - 1)``
    after the first ``sum(sizes[:k])`` (zeros for an empty group), under each head
    ``(G, C, m)``.

    One batched product and log-softmax over all heads and rows, then one scatter-add per
    group: what a round's clients score with, instead of ``K * G`` small cross-entropies (the
    loop that made FedLog's default scale cost 3.5x a round's CPU seconds). Equal to them up
    to the order of the float64 sums.

    Raises:
        InvalidInputError: rows of the wrong width, labels not ``(V,)``, or ``sizes`` not
            non-negative and summing to ``V``.
    """
    _check_rows(heads.shape[-1] - 1, features, labels)
    if any(k < 0 for k in sizes) or sum(sizes) != features.shape[0]:
        raise InvalidInputError(f"group sizes must be >= 0 and sum to the {features.shape[0]} "
                                f"rows, got {sizes}")
    out = torch.zeros(len(sizes), heads.shape[0], dtype=torch.float64, device=heads.device)
    if features.shape[0] == 0:
        return out.cpu()
    inputs = torch.cat([torch.ones_like(features[:, :1]), features], dim=1).to(
        device=heads.device, dtype=torch.float64)
    labels = labels.to(device=heads.device, dtype=torch.int64)
    logits = torch.matmul(inputs, heads.to(torch.float64).transpose(1, 2))  # (G, V, C)
    picked = logits.gather(2, labels.view(1, -1, 1).expand(heads.shape[0], -1, 1))[..., 0]
    nll = torch.logsumexp(logits, dim=2) - picked  # (G, V): -log softmax at the label
    group = torch.repeat_interleave(torch.arange(len(sizes), device=heads.device),
                                    torch.tensor(sizes, device=heads.device))
    return out.index_add_(0, group, nll.T).cpu()


def _check_rows(feature_dim: int, features: Tensor, labels: Tensor) -> None:
    if features.ndim != 2 or features.shape[1] != feature_dim:
        raise InvalidInputError(f"held-out features must be (V, {feature_dim}), got "
                                f"{tuple(features.shape)}")
    if labels.shape != (features.shape[0],):
        raise InvalidInputError(f"held-out labels must be ({features.shape[0]},), got "
                                f"{tuple(labels.shape)}")


def scale_from_grid(nll: Tensor, grid: tuple[float, ...] = HELDOUT_SCALE_GRID,
                    cap: float | None = HELDOUT_SCALE_CAP) -> float:
    """The scale minimising the summed held-out NLL ``nll`` ``(len(grid),)`` over ``grid``
    (`inference.log_grid.argmin_on_log_grid`: the grid's argmin refined by a parabola in
    ``log s``; at the grid's ends the end itself), held to at most ``cap``
    (`HELDOUT_SCALE_CAP`: the choice only tempers; ``None``: no cap). Above the cap, the
    minimiser over the grid's scales up to it (the cap itself where the NLL falls up to it).

    Raises:
        InvalidInputError: ``nll`` of the wrong shape or not finite; ``cap`` below the grid.
    """
    choice = argmin_on_log_grid(nll, grid)
    if cap is None or choice <= cap:
        return choice
    kept = sum(1 for scale in grid if scale <= cap)
    if kept == 0:
        raise InvalidInputError(f"cap {cap!r} lies below the grid's smallest scale {grid[0]!r}")
    return argmin_on_log_grid(nll[:kept], grid[:kept])
