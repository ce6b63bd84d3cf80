"""The principal branch of the Lambert W function, evaluated from log(x).

torch has no Lambert W. The FedLog MAP (spec §2.3) needs ``W0(x)`` for arguments ``x`` from
far below 1e-300 to far above 1e300, so the argument is passed as ``t = log(x)`` and ``x``
itself is never formed: the routine solves ``w + log(w) = t`` for ``w > 0`` by Newton's method.
That equation is concave and increasing in ``w``, so from the starts used here (an upper bound
for ``t < 1``, a lower bound for ``t >= 1``) every iterate after the first lies below the root
and the iteration climbs to it monotonically and quadratically.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MAX_NEWTON_STEPS = 100
# Below this log-argument W0(x) = x (1 - x + ...) equals x to float64 precision.
_LINEAR_REGIME_LOG = -40.0


def lambert_w0_from_log(t: Tensor) -> tuple[Tensor, Tensor]:
    """``W0(exp(t))`` and its logarithm, elementwise, for any real ``t`` (``-inf`` allowed).

    Args:
        t: log of the argument, any shape, floating point (float64 recommended).

    Returns:
        ``(w, log_w)`` with ``w * exp(w) = exp(t)``, same shape and dtype as ``t``, each to a
        few ulps. ``log_w`` stays exact where ``w`` underflows (then ``log_w = t``).
    """
    linear = t < _LINEAR_REGIME_LOG
    t_iter = torch.where(linear, torch.zeros_like(t), t)
    small_start = torch.log1p(torch.exp(torch.clamp(t_iter, max=1.0)))
    large_start = t_iter - torch.log(torch.clamp(t_iter, min=1.0))
    w = torch.where(t_iter < 1.0, small_start, large_start)
    tolerance = 4 * torch.finfo(t.dtype).eps
    for _ in range(_MAX_NEWTON_STEPS):
        # w - f(w) / f'(w) with f(w) = w + log(w) - t, written so that no product overflows.
        w_next = w - (w / (1.0 + w)) * (w + torch.log(w) - t_iter)
        converged = bool(((w_next - w).abs() <= tolerance * w_next).all())
        w = w_next
        if converged:
            break
    w_linear = torch.exp(t)
    w = torch.where(linear, w_linear, w)
    log_w = torch.where(linear, t - w_linear, torch.log(w))
    return w, log_w
