"""The conjugate posterior over a FedLog head (spec §1.3, §2, §2.5).

``p(W | data) ∝ exp(<W, S> - N logsumexp_y(||W_y||^2 / 4))`` with ``S = chi + T`` and
``N = nu + n`` (prior `ConjugatePrior`, statistics `SufficientStatistics`). The
prior and the likelihood statistics are kept apart, so a server sums client statistics and adds
the prior exactly once. ``W`` is ``(C, m + 1)`` with column 0 the bias: logits are
``[1, phi] @ W.T`` for body features ``phi (B, m)``.

Feature scale. The model's class-conditional density is ``N(W_y / 2, I / 2)`` (spec §1.2): it
fixes the features' within-class standard deviation at ``1/√2``. A body whose features have
another scale (any body not trained against this head) makes the MAP overconfident. With
``feature_scale = s`` the model is fitted to ``s phi`` instead (class-conditional standard
deviation ``1 / (s √2)`` in the body's units): the statistics' feature columns are multiplied
by ``s``, which needs nothing beyond the statistics, and every head this class hands out
(``map``, ``mean``, ``sample``, ``covariance``) is mapped back to the body's features, so logits
stay ``[1, phi] @ W.T``. ``s = 1`` is the paper's model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from torch import Tensor

from inference.conjugate.laplace import ConjugateLaplace
from inference.conjugate.nuts import sample_nuts
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.solver import (
    DEFAULT_MAX_ROOT_STEPS,
    checked_max_steps,
    map_objective,
    solve_map,
    solve_map_adam,
)
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError
from inference.hyperparameters import HyperparameterChoice
from inference.inputs import as_features

SampleMethod = Literal["laplace", "nuts"]
PredictMethod = Literal["map", "probit", "mc"]
Solver = Literal["exact", "adam"]
_SOLVER_CODES: dict[str, int] = {"exact": 0, "adam": 1}


class ConjugatePosterior:
    """Posterior over the head; satisfies `inference.posterior.Posterior`.

    ``sample(n)`` draws head weights ``(n, C, m + 1)`` (the bias in column 0) in the space of
    the scaled features ``[1, s phi]``, float64.

    Args:
        prior: hyperparameters (``None`` means ``ConjugatePrior()``: chi = 0, nu = 1).
        statistics: summed statistics (possibly privatised).
        solver: ``"exact"`` (the closed-form maximiser, `inference.conjugate.solve_map`;
            default) or ``"adam"`` (the FedLog authors' code: Adam on the paper's Eq. 12).
        feature_scale: ``s > 0`` (see the module docstring); ``chi`` lives in the scaled
            space (it is a pseudo-statistic of ``[1, s phi]``).
        max_root_steps: the exact solver's step limit
            ([`solve_map`][inference.conjugate.solver.solve_map]'s ``max_steps``; an integer >= 1).

    Attributes:
        feature_scale_selection: how `inference.fit_head` chose ``feature_scale`` (a
            `HyperparameterChoice`), or ``None``; a record of
            the fit, not part of the state.

    Raises:
        InvalidInputError: ``N = nu + n <= 0``, a prior chi of the wrong shape, an unknown
            solver, a feature scale that is not a finite positive number, or statistics that
            fail [`SufficientStatistics.validate`][inference.SufficientStatistics.validate].
    """

    kind: ClassVar[str] = "conjugate"

    def __init__(
        self,
        prior: ConjugatePrior | None,
        statistics: SufficientStatistics,
        solver: Solver = "exact",
        feature_scale: float = 1.0,
        max_root_steps: int = DEFAULT_MAX_ROOT_STEPS,
    ) -> None:
        self.max_root_steps = checked_max_steps(max_root_steps, "max_root_steps")
        if not isinstance(statistics, SufficientStatistics):
            raise InvalidInputError("statistics must be a SufficientStatistics")
        if solver not in _SOLVER_CODES:
            raise InvalidInputError(f"solver must be 'exact' or 'adam', got {solver!r}")
        self.prior = ConjugatePrior() if prior is None else prior
        self.statistics = statistics.validate()
        self.solver = solver
        self.feature_scale = _checked_scale(feature_scale)
        # [1, s, ..., s]: statistics of [1, s phi] are the table's columns times this
        self._column_scale = torch.full((statistics.table.shape[1],), self.feature_scale,
                                        dtype=torch.float64, device=statistics.device)
        self._column_scale[0] = 1.0
        self.natural_statistic = statistics.table * self._column_scale + self.prior.chi_table(
            statistics.table.shape, statistics.device
        )
        self.natural_count = self.prior.nu + statistics.n
        if not self.natural_count > 0:
            raise InvalidInputError(
                "N = nu + n must be > 0: with nu = 0 the statistics need at least one sample"
            )
        self._map: Tensor | None = None
        self._laplace: ConjugateLaplace | None = None
        self.feature_scale_selection: HyperparameterChoice | None = None

    # ------------------------------------------------------------------ shape

    @property
    def num_classes(self) -> int:
        """``C``."""
        return self.statistics.num_classes

    @property
    def feature_dim(self) -> int:
        """``m``: body features (heads have ``m + 1`` columns)."""
        return self.statistics.feature_dim

    @property
    def device(self) -> torch.device:
        """The device of the statistics, the MAP and every draw."""
        return self.statistics.device

    # ------------------------------------------------------------------ point estimate

    def map(self) -> Tensor:
        """The MAP head ``W (C, m + 1)`` for body features, float64, column 0 the bias
        (cached)."""
        return self._map_scaled() * self._column_scale

    def _map_scaled(self) -> Tensor:
        """The MAP in the model's coordinates (the head of ``[1, s phi]``)."""
        if self._map is None:
            if self.solver == "exact":
                self._map = solve_map(self.natural_statistic, self.natural_count,
                                      max_steps=self.max_root_steps)
            else:
                self._map, _ = solve_map_adam(self.natural_statistic, self.natural_count)
        return self._map

    @property
    def mean(self) -> Tensor:
        """The MAP (the posterior's mode; the protocol's point estimate)."""
        return self.map()

    def log_posterior(self, W: Tensor) -> Tensor:
        """Exact unnormalised log density ``<W, S> - N logsumexp(||W_y||^2/4)`` of heads ``W``
        of shape ``(C, m + 1)`` or ``(..., C, m + 1)`` (heads of body features; with a feature
        scale, up to the constant log-Jacobian of the change to the model's coordinates)."""
        if W.shape[-2:] != self.natural_statistic.shape:
            raise InvalidInputError(
                f"W must end in shape {tuple(self.natural_statistic.shape)}, got {tuple(W.shape)}"
            )
        scaled = W.to(torch.float64) / self._column_scale
        return map_objective(scaled, self.natural_statistic, self.natural_count)

    # ------------------------------------------------------------------ uncertainty

    def laplace(self) -> ConjugateLaplace:
        """Laplace approximation ``N(W*, H^-1)`` with structured covariance (cached), in the
        model's coordinates (heads of ``[1, s phi]``; the same as the body's when ``s = 1``)."""
        if self._laplace is None:
            # classes without data get the moment-matched block of their conditional
            # posterior (inference.conjugate.laplace: their curvature at the MAP is ~0)
            empty = (self.natural_statistic == 0).all(dim=1)
            self._laplace = ConjugateLaplace(self._map_scaled(), self.natural_count, empty)
        return self._laplace

    def covariance(self) -> Tensor:
        """Dense Laplace covariance ``(C (m+1), C (m+1))`` of heads of body features, row-major
        over (class, column); refused with MemoryBudgetError above 1 GiB. Prefer
        [`laplace`][inference.conjugate.posterior.ConjugatePosterior.laplace] for large heads."""
        scale = self._column_scale.repeat(self.num_classes)
        return self.laplace().dense_covariance() * scale[:, None] * scale[None, :]

    def sample(
        self,
        n: int,
        generator: torch.Generator | None = None,
        method: SampleMethod = "laplace",
        warmup_steps: int | None = None,
        max_tree_depth: int = 8,
    ) -> Tensor:
        """``n`` head draws, shape ``(n, C, m + 1)``, float64, on the posterior's device.

        ``"laplace"`` draws from ``N(W*, H^-1)`` through the structured factor (``generator``
        must live on the posterior's device); ``"nuts"`` runs pyro's NUTS on the CPU on the
        exact log posterior (whitened by the Laplace factor), with ``warmup_steps`` adaptation
        steps (default ``max(100, n // 2)``) and at most ``2 ** max_tree_depth`` leapfrog steps
        per draw, seeded from ``generator``.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"n must be a positive integer, got {n!r}")
        if method == "laplace":
            return self.laplace().sample(n, generator=generator) * self._column_scale
        if method == "nuts":
            draws = sample_nuts(
                self.laplace(), self.natural_statistic, self.natural_count, n,
                warmup_steps=warmup_steps, generator=generator, max_tree_depth=max_tree_depth,
            )
            return draws * self._column_scale.to(draws.device)
        raise InvalidInputError(f"method must be 'laplace' or 'nuts', got {method!r}")

    # ------------------------------------------------------------------ predictive

    def predict_proba(
        self,
        inputs: Tensor,
        method: PredictMethod = "map",
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        samples: Tensor | None = None,
    ) -> Tensor:
        """Class probabilities ``(B, C)`` for body features ``inputs (B, m)`` (no constant 1).

        Methods: ``"map"`` plug-in softmax of the MAP logits (the paper); ``"probit"``
        ``softmax(mu / sqrt(1 + pi/8 var))`` with the Laplace logit variances; ``"mc"`` the mean
        softmax over ``n_samples`` Laplace draws, or over given ``samples (S, C, m + 1)`` (e.g.
        from ``sample(..., method="nuts")``). Computed in float64, returned in the inputs'
        floating dtype on the posterior's device.
        """
        inputs = as_features(inputs, self.feature_dim)  # tensors, NumPy arrays or lists
        x = self._augmented(inputs)
        if method == "map":
            probs = torch.softmax(x @ self.map().T, dim=1)
        elif method == "probit":
            mean, variance = self.laplace().logit_moments(x * self._column_scale)
            probs = torch.softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * variance), dim=1)
        elif method == "mc":
            if samples is None:
                samples = self.sample(n_samples, generator=generator)
            elif samples.dim() != 3 or samples.shape[1:] != self.natural_statistic.shape:
                raise InvalidInputError("samples must have shape (S, C, m + 1)")
            draws = samples.to(x.device, torch.float64)
            s, c, k = draws.shape
            # the (rows, classes, draws) logits from one matrix product, then the softmax over
            # the classes and the mean over the draws: einsum("bk,sck->sbc")'s sums, laid out
            # with the draws innermost, where PyTorch's softmax over a dimension that is not
            # the last runs along contiguous vectors of draws (3x faster at 256 draws and 10
            # classes than over each draw's 10 classes; equal to 1e-16)
            logits = (x @ draws.transpose(0, 1).reshape(c * s, k).T).view(-1, c, s)
            probs = torch.softmax(logits, dim=1).mean(dim=2)
        else:
            raise InvalidInputError(f"method must be 'map', 'probit' or 'mc', got {method!r}")
        return probs.to(inputs.dtype)

    def _augmented(self, inputs: Tensor) -> Tensor:
        """``[1, inputs]`` (B, m + 1) float64 on the posterior's device; ``inputs`` are body
        features without the constant 1, checked by `inference.inputs.as_features`."""
        x = as_features(inputs, self.feature_dim).to(device=self.device, dtype=torch.float64)
        return torch.cat([torch.ones_like(x[:, :1]), x], dim=1)

    # ------------------------------------------------------------------ transport

    def to(self, device: torch.device | str) -> ConjugatePosterior:
        """A copy on ``device`` (the cached MAP moves along; nothing is recomputed)."""
        chi = self.prior.chi
        prior = ConjugatePrior(chi=chi.to(device) if isinstance(chi, Tensor) else chi,
                               nu=self.prior.nu)
        moved = ConjugatePosterior(prior, self.statistics.to(device), solver=self.solver,
                                   feature_scale=self.feature_scale,
                                   max_root_steps=self.max_root_steps)
        if self._map is not None:
            moved._map = self._map.to(device)
        return moved

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: the statistics' state, ``prior_chi`` (float64 ``(C, m+1)``),
        ``prior_nu`` (float64 scalar), ``solver`` (int64 code) and, unless it is 1,
        ``feature_scale`` (float64 scalar). The MAP is recomputed."""
        state = dict(self.statistics.state_dict())
        state["prior_chi"] = self.prior.chi_table(self.statistics.table.shape, self.device)
        state["prior_nu"] = torch.tensor(self.prior.nu, dtype=torch.float64)
        state["solver"] = torch.tensor(_SOLVER_CODES[self.solver], dtype=torch.int64)
        if self.feature_scale != 1.0:
            state["feature_scale"] = torch.tensor(self.feature_scale, dtype=torch.float64)
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> ConjugatePosterior:
        """Inverse of `state_dict` (validates the statistics and the prior)."""
        for key in ("prior_chi", "prior_nu", "solver"):
            if key not in state:
                raise InvalidInputError(f"conjugate posterior state lacks {key!r}")
        statistics = SufficientStatistics.from_state_dict(state)
        prior = ConjugatePrior(chi=state["prior_chi"].to(torch.float64),
                               nu=float(state["prior_nu"]))
        codes = {code: name for name, code in _SOLVER_CODES.items()}
        solver = codes.get(int(state["solver"]))
        if solver is None:
            raise InvalidInputError(f"unknown solver code {int(state['solver'])}")
        scale = state.get("feature_scale")
        if scale is not None and scale.numel() != 1:
            raise InvalidInputError("feature_scale must be a scalar tensor")
        return cls(prior, statistics, solver=solver,  # type: ignore[arg-type]
                   feature_scale=1.0 if scale is None else float(scale))

    def __repr__(self) -> str:
        return (
            f"ConjugatePosterior(C={self.num_classes}, m={self.feature_dim}, "
            f"N={self.natural_count:g}, solver={self.solver!r}, "
            f"feature_scale={self.feature_scale:g}, device={self.device})"
        )


def _checked_scale(value: float) -> float:
    """``value`` as a float if it is a finite number > 0; else `InvalidInputError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise InvalidInputError(f"feature_scale must be a finite number > 0, got {value!r}")
    return float(value)
