"""The conjugate prior of the FedLog exponential family (spec §1.3).

``p(W; chi, nu) ∝ exp(<W, chi> - nu * logsumexp_y(||W_y||^2 / 4))``. After statistics ``T`` with
count ``n`` the posterior is the same family with ``S = chi + T`` and ``N = nu + n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class ConjugatePrior:
    """Hyperparameters ``chi`` (pseudo-statistics) and ``nu`` (pseudo-count).

    Attributes:
        chi: a number (the same pseudo-statistic in every cell) or a ``(C, m + 1)`` tensor laid
            out like `SufficientStatistics.table` (column 0 = pseudo-counts). Default 0.
        nu: pseudo-count ``>= 0``. Default 1 (the paper); 0 gives the maximum-likelihood head
            (the authors' code), which needs at least one sample.
    """

    chi: float | Tensor = 0.0
    nu: float = 1.0

    def __post_init__(self) -> None:
        nu = float(self.nu)
        if not math.isfinite(nu) or nu < 0:
            raise InvalidInputError(f"nu must be a finite number >= 0, got {self.nu!r}")
        object.__setattr__(self, "nu", nu)
        if isinstance(self.chi, Tensor):
            if self.chi.dim() != 2 or not self.chi.is_floating_point():
                raise InvalidInputError("a tensor chi must be floating point of shape (C, m + 1)")
            if not bool(torch.isfinite(self.chi).all()):
                raise InvalidInputError("chi contains NaN or Inf")
        else:
            chi = float(self.chi)
            if not math.isfinite(chi):
                raise InvalidInputError(f"chi must be finite, got {self.chi!r}")
            object.__setattr__(self, "chi", chi)

    def chi_table(self, shape: torch.Size | tuple[int, int], device: torch.device | str
                  ) -> Tensor:
        """``chi`` as a float64 tensor of ``shape`` on ``device``.

        Raises:
            InvalidInputError: a tensor ``chi`` whose shape differs from ``shape``.
        """
        if isinstance(self.chi, Tensor):
            if tuple(self.chi.shape) != tuple(shape):
                raise InvalidInputError(
                    f"prior chi has shape {tuple(self.chi.shape)}, statistics {tuple(shape)}"
                )
            return self.chi.to(device=device, dtype=torch.float64)
        return torch.full(tuple(shape), self.chi, dtype=torch.float64, device=device)
