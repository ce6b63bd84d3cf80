"""The FedLog MAP: exact solver (spec §2.3) and the paper's Adam loop (spec §2.2).

The MAP of the conjugate posterior maximises the concave objective

    J(W) = <W, S>_F - N * logsumexp_y(||W_y||^2 / 4),     W, S in R^(C x k), N > 0,

with ``S = chi + (sum of client statistics)`` and ``N = nu + n`` (see
`inference.conjugate.ConjugatePosterior`). Its gradient is ``S_y - N p_y W_y / 2`` with
``p = softmax_y(||W_y||^2 / 4)``. Setting it to zero gives ``W_y = 2 S_y / (N p_y)``: every row of
the MAP is a positive multiple of its row of ``S``, and the whole problem reduces to one scalar,
``l = log Z`` with ``Z = sum_y exp(||W_y||^2 / 4)``. With ``a_y = ||S_y||`` and
``b_y = log(sqrt(2) a_y / N)``, the row norm is ``u_y = sqrt(2 w_y)`` where
``w_y = W0(exp(2 (b_y + l)))`` (principal Lambert W) and the class probability is
``log p_y = b_y - log(w_y) / 2``. The scalar ``l`` is the root of

    F(l) = logsumexp_y(log p_y(l)) = 0,     F'(l) = -sum_y softmax(log p)_y / (1 + w_y) < 0.

``F`` is convex and decreasing on ``[max(log C, a_max^2 / N^2), log C + C^2 a_max^2 / N^2]``,
whose ends bracket the root, so a safeguarded Newton iteration from the left end converges
monotonically. Every quantity is formed in log space, so statistics from 1e-300 to 1e150 (times
N) neither overflow nor lose relative precision. Only the C-vector of row norms is moved to the
CPU for the scalar root-find; the C x k matrices stay on their device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inference.conjugate.lambert import lambert_w0_from_log
from inference.errors import InvalidInputError, NumericalError

DEFAULT_MAX_ROOT_STEPS = 500
"""The root-find's step limit unless given (``max_steps`` of `solve_map`,
``max_root_steps`` of [`ConjugatePosterior`][inference.conjugate.ConjugatePosterior], of
`fit_conjugate_head` and of
``inference.fit_head("conjugate", ...)``); Newton inside the bracket needs a few dozen."""
# Bound on C * max_y ||S_y|| / N. The root l = log Z is at most log C + (C a_max / N)^2 (equal
# when every row has the same norm), so beyond this bound l, and the squared row norms of W,
# could exceed ~1e300.
_MAX_NORM_RATIO = 1e150


def map_objective(W: Tensor, S: Tensor, N: float | Tensor) -> Tensor:
    """``J(W) = <W, S> - N logsumexp_y(||W_y||^2 / 4)`` (the unnormalised log posterior).

    Args:
        W: heads, shape ``(C, k)`` or batched ``(..., C, k)``.
        S: natural statistic ``chi + sum of statistics``, shape ``(C, k)``.
        N: natural count ``nu + n``.

    Returns:
        ``J`` with the batch shape of ``W`` (a scalar for a single head).
    """
    linear = (W * S).sum(dim=(-2, -1))
    return linear - N * torch.logsumexp(W.pow(2).sum(dim=-1) / 4.0, dim=-1)


def map_gradient(W: Tensor, S: Tensor, N: float | Tensor) -> Tensor:
    """``dJ/dW_y = S_y - N p_y W_y / 2`` with ``p = softmax(||W_y||^2 / 4)``; shape of ``W``."""
    p = torch.softmax(W.pow(2).sum(dim=-1) / 4.0, dim=-1)
    return S - N * p.unsqueeze(-1) * W / 2.0


def solve_map(S: Tensor, N: float | Tensor, *, max_steps: int = DEFAULT_MAX_ROOT_STEPS) -> Tensor:
    """Exact maximiser of ``J(W) = <W, S> - N logsumexp_y(||W_y||^2 / 4)``.

    Args:
        S: any finite real matrix, shape ``(C, k)`` (here ``k`` counts every column, the bias
            column included); any float dtype and device.
        N: a finite number > 0 (float or 0-dim tensor).
        max_steps: the scalar root-find's step limit (an integer >= 1).

    Returns:
        ``W``, float64, shape ``(C, k)``, on ``S``'s device. Each row is a non-negative multiple
        of the row of ``S``; rows of ``S`` that are all zero give zero rows.

    Raises:
        InvalidInputError: ``S`` not a finite 2-D matrix, ``N`` not a finite positive number,
            ``C max_y ||S_y|| / N`` above 1e150 (the head could overflow float64), or
            ``max_steps`` not an integer >= 1.
        NumericalError: the root-find did not converge in ``max_steps`` steps (the message
            says how to raise the limit or solve by Adam instead).
    """
    S = _checked_statistic(S)
    N = _checked_count(N)
    max_steps = checked_max_steps(max_steps, "max_steps")
    S64 = S.to(torch.float64)
    row_norms = torch.linalg.vector_norm(S64, dim=1).cpu()
    row_scales = _row_norm_ratios(row_norms, N, max_steps)  # u_y / a_y on the CPU, 0 for empty rows
    return S64 * row_scales.to(S64.device).unsqueeze(1)


def solve_map_adam(
    S: Tensor, N: float | Tensor, lr: float = 0.01, tol: float = 1e-3, max_steps: int = 10_000
) -> tuple[Tensor, int]:
    """The paper's server solver (spec §2.2, [code]): Adam on ``-J`` from ``S / (2N)``.

    Stops when one Adam step moves no entry by more than ``tol`` or after ``max_steps``. Kept for
    paper-faithful runs and as the benchmark peer; it stops about 1% short of the optimum.

    Returns:
        ``(W, steps)``: the head (float64, shape of ``S``, on ``S``'s device) and the number of
        Adam steps taken.
    """
    S = _checked_statistic(S).to(torch.float64)
    N = _checked_count(N)
    W = (S / N / 2.0).clone().requires_grad_(True)
    optimizer = torch.optim.Adam([W], lr=lr)
    steps = 0
    for steps in range(1, max_steps + 1):  # noqa: B007 - the count is returned
        previous = W.detach().clone()
        optimizer.zero_grad(set_to_none=True)
        loss = -map_objective(W, S, N)
        loss.backward()
        optimizer.step()
        if float((W.detach() - previous).abs().max()) <= tol:
            break
    return W.detach(), steps


def checked_max_steps(value: object, name: str) -> int:
    """``value`` as a step limit: an integer >= 1 (InvalidInputError naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _row_norm_ratios(row_norms: Tensor, N: float, max_steps: int) -> Tensor:
    """``u_y / a_y`` for every class (0 where ``a_y = 0``), float64 on the CPU."""
    C = row_norms.numel()
    present = row_norms > 0
    if not bool(present.any()):
        return torch.zeros_like(row_norms)
    a_max = float(row_norms.max())
    if C * (a_max / N) > _MAX_NORM_RATIO:
        raise InvalidInputError(
            f"statistics too large for the count: C max_y ||S_y|| / N = {C * (a_max / N):.3g} > "
            f"{_MAX_NORM_RATIO:.0e}; rescale the features or check N"
        )
    log_a = torch.where(present, torch.log(row_norms), torch.zeros_like(row_norms))
    b = 0.5 * math.log(2.0) + log_a - math.log(N)
    l = _solve_log_partition(b, present, C, a_max / N, max_steps)
    w, _ = lambert_w0_from_log(2.0 * (b + l))
    ratios = torch.sqrt(2.0 * w) / torch.where(present, row_norms, torch.ones_like(row_norms))
    return torch.where(present, ratios, torch.zeros_like(ratios))


def _log_class_probabilities(b: Tensor, present: Tensor, l: float) -> tuple[Tensor, Tensor]:
    """``log p_y(l)`` and ``w_y(l)``; an absent class has ``w = 0`` and ``log p = -l``."""
    w, log_w = lambert_w0_from_log(2.0 * (b + l))
    log_p = torch.where(present, b - 0.5 * log_w, torch.full_like(b, -l))
    return log_p, torch.where(present, w, torch.zeros_like(w))


def _solve_log_partition(b: Tensor, present: Tensor, C: int, norm_ratio: float,
                         max_steps: int) -> float:
    """Root of ``F(l) = logsumexp(log p(l))`` by Newton safeguarded with bisection."""
    lo = max(math.log(C), norm_ratio**2)
    hi = math.log(C) + (C * norm_ratio) ** 2  # finite: C * norm_ratio <= _MAX_NORM_RATIO
    l = lo
    for _ in range(max_steps):
        log_p, w = _log_class_probabilities(b, present, l)
        value = float(torch.logsumexp(log_p, dim=0))
        if value > 0:
            lo = l
        elif value < 0:
            hi = l
        else:
            return l
        slope = -float((torch.softmax(log_p, dim=0) / (1.0 + w)).sum())
        candidate = l - value / slope
        if not lo < candidate < hi:
            candidate = 0.5 * (lo + hi)
        if abs(candidate - l) <= 2 * torch.finfo(torch.float64).eps * abs(l) or hi <= lo:
            return candidate
        l = candidate
    # Not expected for valid statistics with the default limit (the bracket is finite and
    # Newton converges quadratically inside it); the figures let a report reproduce it.
    raise NumericalError(
        f"the FedLog MAP root-find did not converge in {max_steps} steps (bracket "
        f"[{lo:.6g}, {hi:.6g}], C = {C}, max ||S_y|| / N = {norm_ratio:.3g}). Raise the step "
        "limit: max_root_steps= of ConjugatePosterior, fit_conjugate_head or "
        "inference.fit_head('conjugate', ...), max_steps= of solve_map (default "
        f"{DEFAULT_MAX_ROOT_STEPS}); or solve the same problem with solver='adam' "
        "(solve_map_adam, about 1% short of the optimum). Newton needs a few dozen steps here, "
        "so if the default limit was not enough, please report these figures"
    )


def _checked_statistic(S: Tensor) -> Tensor:
    if not isinstance(S, Tensor) or S.dim() != 2 or not S.is_floating_point():
        raise InvalidInputError("S must be a floating-point tensor of shape (C, k)")
    if S.shape[0] < 1 or S.shape[1] < 1:
        raise InvalidInputError(f"S needs at least one row and column, got {tuple(S.shape)}")
    if not bool(torch.isfinite(S).all()):
        raise InvalidInputError("S contains NaN or Inf entries")
    return S


def _checked_count(N: float | Tensor) -> float:
    value = float(N)
    if not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"N must be a finite number > 0, got {value}")
    return value
