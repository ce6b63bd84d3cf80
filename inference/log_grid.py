"""A hyperparameter chosen on a fixed geometric grid from a summed criterion.

Federated type-II choices (FedLog's held-out feature scale, FedSI's prior variance by evidence)
have each client evaluate its share of a criterion on one fixed grid; the server adds the
vectors and takes `argmin_on_log_grid` of the sum: a deterministic function of the summed
vector, so every transport and every order of the sum gives the same choice.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from inference.errors import InvalidInputError


def geometric_grid(low_exponent: int, high_exponent: int, per_step: int, base: float
                   ) -> tuple[float, ...]:
    """``base^(k / per_step)`` for ``k = low_exponent .. high_exponent`` (inclusive)."""
    return tuple(base ** (k / per_step) for k in range(low_exponent, high_exponent + 1))


def argmin_on_log_grid(values: Tensor, grid: tuple[float, ...]) -> float:
    """The grid point minimising ``values`` ``(len(grid),)``, refined in ``log`` of the grid.

    The argmin (the smallest grid point among ties), moved to the vertex of the parabola in
    ``log x`` through it and its two neighbours when the parabola is convex (the vertex then
    lies between the neighbours); at the grid's ends the end itself.

    Raises:
        InvalidInputError: ``values`` of the wrong shape or not finite.
    """
    values = values.to(torch.float64)
    if values.shape != (len(grid),) or not bool(torch.isfinite(values).all()):
        raise InvalidInputError(f"the criterion must be {len(grid)} finite numbers, got shape "
                                f"{tuple(values.shape)}")
    best = int(torch.argmin(values))
    if best == 0 or best == len(grid) - 1:
        return grid[best]
    x0, x1, x2 = (math.log(grid[best + k]) for k in (-1, 0, 1))
    y0, y1, y2 = (float(values[best + k]) for k in (-1, 0, 1))
    if (y2 - y1) / (x2 - x1) - (y1 - y0) / (x1 - x0) <= 0:
        return grid[best]
    # the vertex of the parabola through three points equally spaced (h) in log x
    h = x1 - x0
    vertex = x1 - h * (y2 - y0) / (2 * (y2 - 2 * y1 + y0))
    return math.exp(min(max(vertex, x0), x2))
