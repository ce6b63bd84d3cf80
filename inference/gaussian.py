"""Gaussian posteriors in natural parameters, with the likelihood term kept apart from the prior.

A Gaussian over a flat parameter vector ``θ ∈ R^d`` is stored as natural parameters: a precision
``Λ`` (diagonal, dense, or low-rank plus diagonal) and a precision-times-mean ``η = Λ μ``.
A :class:`GaussianPosterior` keeps two such terms, as laplace-torch keeps ``H`` apart from the
prior precision::

    Λ = Λ_prior + Λ_lik          η = η_prior + η_lik

The likelihood term is *defined* as the posterior's natural parameters minus the prior's, so a
client's local posterior (Laplace, MFVI or closed form) is ``prior + its likelihood term``, and the
global posterior of K clients is ``prior + Σ_k likelihood_k`` with the prior counted once
(:func:`combine`, or ``+`` on posteriors). For a linear-Gaussian model this product is exact.
:func:`average` is the other aggregation: the moment-matched Gaussian of a mixture.

Numerics: every solve, factorisation and sample runs in float64; results come back in the
posterior's storage dtype. Cholesky factorisations follow one jitter policy
(:func:`cholesky_with_jitter`). Samples use the precision's Cholesky factor (or, for low rank,
perturb-and-solve); no covariance is inverted explicitly except where a caller asks for it
(:meth:`GaussianPosterior.covariance`) or the probit predictive of a dense posterior needs the
per-class covariance blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError
from inference.inputs import as_features
from inference.linear_model import augment_with_bias, check_features
from inference.options import CovarianceStructure, PredictiveMethod
from inference.posterior import check_num_draws, draw_device, register_posterior

#: Relative jitter tried, in order, when a Cholesky factorisation fails (times mean |diag|).
JITTER_SCHEDULE = (0.0, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6)

_STRUCTURE_RANK = {
    CovarianceStructure.DIAG: 0,
    CovarianceStructure.LOWRANK: 1,
    CovarianceStructure.FULL: 2,
}


def cholesky_with_jitter(matrix: Tensor, what: str = "precision") -> Tensor:
    """Lower Cholesky factor of a symmetric positive-definite matrix, in float64.

    Jitter policy: the matrix is symmetrised; if the factorisation fails, ``j · mean|diag|`` is
    added to the diagonal for ``j`` in :data:`JITTER_SCHEDULE` (1e-10 up to 1e-6, relative)
    and the first success is returned. If all fail the matrix is not positive definite in any
    useful sense and :class:`NumericalError` reports its smallest eigenvalue.
    """
    a = matrix.to(torch.float64)
    if not torch.isfinite(a).all():
        raise NumericalError(f"the {what} matrix contains NaN or inf.")
    a = 0.5 * (a + a.transpose(-1, -2))
    scale = a.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(torch.finfo(torch.float64).tiny)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for jitter in JITTER_SCHEDULE:
        factor, info = torch.linalg.cholesky_ex(a + jitter * scale * eye)
        if int(info.max()) == 0:
            return factor
    smallest = float(torch.linalg.eigvalsh(a).min())
    raise NumericalError(
        f"the {what} matrix is not positive definite (smallest eigenvalue {smallest:.3e}, "
        f"size {a.shape[-1]}), even with a relative jitter of {JITTER_SCHEDULE[-1]:g}. "
        "Increase the prior precision or check the curvature for NaNs / negative terms."
    )


@dataclass(frozen=True)
class GaussianTerm:
    """Natural parameters of one Gaussian factor over a flat vector of size ``d``.

    Attributes:
        structure: how the precision is stored (see :class:`CovarianceStructure`).
        shift: ``(d,)`` precision-times-mean ``η``.
        diag: ``(d,)`` diagonal of the precision (``diag`` and ``lowrank`` structures).
        dense: ``(d, d)`` symmetric precision (``full`` structure).
        factor: ``(d, r)`` factor ``L`` of the low-rank part ``L Lᵀ`` (``lowrank`` structure).

    A term on its own need not be positive definite (a likelihood term obtained by subtraction
    may not be); only a posterior's total precision must be.
    """

    structure: CovarianceStructure
    shift: Tensor
    diag: Tensor | None = None
    dense: Tensor | None = None
    factor: Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "structure", CovarianceStructure.parse(self.structure))
        d = self.shift.shape[0] if self.shift.ndim == 1 else -1
        if d < 0:
            raise InvalidInputError(f"shift must be 1-D (d,); got {tuple(self.shift.shape)}.")
        needed = {
            CovarianceStructure.DIAG: ("diag",),
            CovarianceStructure.FULL: ("dense",),
            CovarianceStructure.LOWRANK: ("diag", "factor"),
        }[self.structure]
        for name in ("diag", "dense", "factor"):
            value = getattr(self, name)
            if (value is not None) != (name in needed):
                state = "needs" if name in needed else "must not have"
                raise InvalidInputError(f"a {self.structure} term {state} `{name}`.")
        expected = {"diag": (d,), "dense": (d, d)}
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise InvalidInputError(
                    f"`{name}` must have shape {shape}; got {tuple(value.shape)}."
                )
        if self.factor is not None and (self.factor.ndim != 2 or self.factor.shape[0] != d):
            raise InvalidInputError(
                f"`factor` must have shape ({d}, r); got {tuple(self.factor.shape)}."
            )
        kinds = {(t.dtype, t.device) for t in self.tensors().values()}
        if len(kinds) != 1 or not self.shift.is_floating_point():
            raise InvalidInputError(
                "a term's tensors must share one floating dtype and one device; got "
                + ", ".join(f"{n}: {t.dtype} on {t.device}" for n, t in self.tensors().items())
            )

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def isotropic(
        cls, dim: int, precision: float, mean: float | Tensor = 0.0, *,
        dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
    ) -> GaussianTerm:
        """An isotropic Gaussian ``N(mean, I / precision)`` over ``R^dim`` (a typical prior)."""
        if not precision > 0:
            raise InvalidInputError(f"prior precision must be positive; got {precision}.")
        diag = torch.full((dim,), float(precision), dtype=dtype, device=device)
        mean_vec = torch.as_tensor(mean, dtype=dtype, device=device).expand(dim)
        return cls(CovarianceStructure.DIAG, shift=diag * mean_vec, diag=diag)

    @classmethod
    def zeros(
        cls, dim: int, structure: CovarianceStructure | str = "diag", *,
        dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
    ) -> GaussianTerm:
        """The neutral term (no information), of the given structure.

        Every tensor is its own allocation (safetensors refuses tensors that share memory).
        """
        structure = CovarianceStructure.parse(structure)
        shift = torch.zeros(dim, dtype=dtype, device=device)
        if structure is CovarianceStructure.FULL:
            return cls(structure, shift, dense=shift.new_zeros(dim, dim))
        if structure is CovarianceStructure.LOWRANK:
            return cls(structure, shift, diag=shift.new_zeros(dim), factor=shift.new_zeros(dim, 0))
        return cls(structure, shift, diag=shift.new_zeros(dim))

    # -- basic properties ---------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """``d``, the size of the flat parameter vector."""
        return self.shift.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.shift.dtype

    @property
    def device(self) -> torch.device:
        return self.shift.device

    def tensors(self) -> dict[str, Tensor]:
        """The tensors this term holds, by name (``shift``, ``diag``, ``dense``, ``factor``)."""
        names = ("shift", "diag", "dense", "factor")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> GaussianTerm:
        """A copy on ``device`` and/or in ``dtype`` (``None`` keeps the current one)."""
        moved = {n: t.to(device=device, dtype=dtype) for n, t in self.tensors().items()}
        return GaussianTerm(self.structure, **moved)

    # -- algebra ------------------------------------------------------------------------------

    def promoted(self, structure: CovarianceStructure | str) -> GaussianTerm:
        """The same term stored with a richer structure (``diag < lowrank < full``)."""
        structure = CovarianceStructure.parse(structure)
        if structure is self.structure:
            return self
        if _STRUCTURE_RANK[structure] < _STRUCTURE_RANK[self.structure]:
            raise InvalidInputError(f"cannot store a {self.structure} term as {structure}.")
        if structure is CovarianceStructure.LOWRANK:
            return GaussianTerm(structure, self.shift, diag=self.diag,
                                factor=self.shift.new_zeros(self.dim, 0))
        return GaussianTerm(structure, self.shift, dense=self.precision_matrix())

    def __add__(self, other: GaussianTerm) -> GaussianTerm:
        """Product of two Gaussian factors: natural parameters add (structure promoted)."""
        if not isinstance(other, GaussianTerm):
            return NotImplemented
        if other.dim != self.dim:
            raise InvalidInputError(f"cannot add terms of dimension {self.dim} and {other.dim}.")
        target = max(self.structure, other.structure, key=_STRUCTURE_RANK.__getitem__)
        a, b = self.promoted(target), other.promoted(target)
        shift = a.shift + b.shift
        if target is CovarianceStructure.DIAG:
            return GaussianTerm(target, shift, diag=a.diag + b.diag)
        if target is CovarianceStructure.FULL:
            return GaussianTerm(target, shift, dense=a.dense + b.dense)
        factor = torch.cat([a.factor, b.factor], dim=1)
        return GaussianTerm(target, shift, diag=a.diag + b.diag, factor=factor)

    def __sub__(self, other: GaussianTerm) -> GaussianTerm:
        """Division of Gaussian factors (natural parameters subtract). Low rank is densified."""
        if not isinstance(other, GaussianTerm):
            return NotImplemented
        if other.dim != self.dim:
            raise InvalidInputError(
                f"cannot subtract terms of dimension {self.dim} and {other.dim}."
            )
        shift = self.shift - other.shift
        if self.structure is other.structure is CovarianceStructure.DIAG:
            return GaussianTerm(self.structure, shift, diag=self.diag - other.diag)
        dense = self.precision_matrix() - other.precision_matrix()
        return GaussianTerm(CovarianceStructure.FULL, shift, dense=dense)

    def scaled(self, weight: float) -> GaussianTerm:
        """The term raised to the power ``weight ≥ 0`` (natural parameters times ``weight``)."""
        if weight < 0:
            raise InvalidInputError(f"a term can only be scaled by a weight ≥ 0; got {weight}.")
        w = float(weight)
        factor = None if self.factor is None else self.factor * math.sqrt(w)
        return GaussianTerm(
            self.structure, self.shift * w,
            diag=None if self.diag is None else self.diag * w,
            dense=None if self.dense is None else self.dense * w,
            factor=factor,
        )

    def precision_matrix(self) -> Tensor:
        """The precision as a dense ``(d, d)`` matrix (memory ``d²``)."""
        if self.structure is CovarianceStructure.FULL:
            return self.dense
        matrix = torch.diag(self.diag)
        if self.structure is CovarianceStructure.LOWRANK:
            matrix = matrix + self.factor @ self.factor.T
        return matrix

    def precision_diagonal(self) -> Tensor:
        """The diagonal of the precision, ``(d,)``."""
        if self.structure is CovarianceStructure.FULL:
            return self.dense.diagonal()
        if self.structure is CovarianceStructure.LOWRANK:
            return self.diag + (self.factor**2).sum(1)
        return self.diag

    def matvec(self, vector: Tensor) -> Tensor:
        """``Λ v`` for ``v`` of shape ``(d,)`` or ``(d, k)``."""
        if self.structure is CovarianceStructure.FULL:
            return self.dense @ vector
        diag = self.diag if vector.ndim == 1 else self.diag[:, None]
        out = diag * vector
        if self.structure is CovarianceStructure.LOWRANK:
            out = out + self.factor @ (self.factor.T @ vector)
        return out

    def allclose(self, other: GaussianTerm, rtol: float = 1e-12, atol: float = 0.0) -> bool:
        """Whether two terms have the same natural parameters (compared densely if needed)."""
        if self.dim != other.dim or not torch.allclose(self.shift, other.shift, rtol, atol):
            return False
        if self.structure is other.structure is CovarianceStructure.DIAG:
            return torch.allclose(self.diag, other.diag, rtol, atol)
        return torch.allclose(self.precision_matrix(), other.precision_matrix(), rtol, atol)


@dataclass
class _Factorisation:
    """float64 factors of a total precision, enough to solve, sample and get variances."""

    structure: CovarianceStructure
    diag: Tensor | None = None  # (d,) diagonal part (diag, lowrank)
    chol: Tensor | None = None  # (d, d) Cholesky of Λ (full)
    factor: Tensor | None = None  # (d, r) low-rank factor (lowrank)
    capacitance_chol: Tensor | None = None  # (r, r) Cholesky of I + Lᵀ D⁻¹ L (lowrank)

    @classmethod
    def of(cls, term: GaussianTerm) -> _Factorisation:
        if term.structure is CovarianceStructure.FULL:
            return cls(term.structure, chol=cholesky_with_jitter(term.dense))
        diag = term.diag.to(torch.float64)
        if not torch.isfinite(diag).all() or (diag <= 0).any():
            bad = int((~(diag > 0)).sum())
            raise NumericalError(
                f"the precision's diagonal part has {bad} entries that are not positive and "
                "finite; a diagonal (or low-rank-plus-diagonal) posterior needs all of them > 0."
            )
        if term.structure is CovarianceStructure.DIAG:
            return cls(term.structure, diag=diag)
        factor = term.factor.to(torch.float64)
        rank = factor.shape[1]
        capacitance = torch.eye(rank, dtype=torch.float64, device=diag.device)
        capacitance = capacitance + factor.T @ (factor / diag[:, None])
        return cls(term.structure, diag=diag, factor=factor,
                   capacitance_chol=cholesky_with_jitter(capacitance, "capacitance"))

    def solve(self, rhs: Tensor) -> Tensor:
        """``Λ⁻¹ b`` for ``b`` of shape ``(d,)`` or ``(d, k)`` (float64)."""
        b = rhs.to(torch.float64)
        column = b.ndim == 1
        b = b[:, None] if column else b
        if self.structure is CovarianceStructure.FULL:
            x = torch.cholesky_solve(b, self.chol)
        else:
            x = b / self.diag[:, None]
            if self.structure is CovarianceStructure.LOWRANK:  # Woodbury identity
                inner = torch.cholesky_solve(self.factor.T @ x, self.capacitance_chol)
                x = x - (self.factor @ inner) / self.diag[:, None]
        return x[:, 0] if column else x

    def _randn(self, *size: int, generator: torch.Generator | None) -> Tensor:
        """Standard normals of ``size`` (float64) on the factors' device, drawn on the
        generator's device (so a CPU generator also seeds draws of a CUDA posterior)."""
        device = (self.diag if self.diag is not None else self.chol).device
        return torch.randn(*size, dtype=torch.float64, generator=generator,
                           device=draw_device(generator, device)).to(device)

    def standard_draws(self, n: int, generator: torch.Generator | None) -> Tensor:
        """``(n, d)`` draws of ``N(0, Λ⁻¹)`` (float64)."""
        d = (self.diag if self.diag is not None else self.chol).shape[0]
        eps = self._randn(d, n, generator=generator)
        if self.structure is CovarianceStructure.DIAG:
            return (eps / self.diag.sqrt()[:, None]).T
        if self.structure is CovarianceStructure.FULL:  # z = L⁻ᵀ ε has covariance (L Lᵀ)⁻¹
            return torch.linalg.solve_triangular(self.chol.T, eps, upper=True).T
        # perturb-and-solve: x = D^½ ε + L ε' has covariance Λ, so Λ⁻¹ x has covariance Λ⁻¹.
        eps_low = self._randn(self.factor.shape[1], n, generator=generator)
        return self.solve(self.diag.sqrt()[:, None] * eps + self.factor @ eps_low).T

    def covariance(self) -> Tensor:
        """Dense ``Λ⁻¹`` (float64, ``(d, d)``)."""
        if self.structure is CovarianceStructure.FULL:
            return torch.cholesky_inverse(self.chol)
        d = self.diag.shape[0]
        return self.solve(torch.eye(d, dtype=torch.float64, device=self.diag.device))

    def variance(self) -> Tensor:
        """Diagonal of ``Λ⁻¹`` without forming it for diag / low rank (float64, ``(d,)``)."""
        if self.structure is CovarianceStructure.DIAG:
            return 1.0 / self.diag
        if self.structure is CovarianceStructure.FULL:
            eye = torch.eye(self.chol.shape[0], dtype=torch.float64, device=self.chol.device)
            inv_chol = torch.linalg.solve_triangular(self.chol, eye, upper=False)
            return (inv_chol**2).sum(0)
        # Woodbury: diag(D⁻¹) - rowsum((D⁻¹ L K^{-T/2})²)
        scaled = torch.linalg.solve_triangular(
            self.capacitance_chol, (self.factor / self.diag[:, None]).T, upper=False
        )
        return 1.0 / self.diag - (scaled**2).sum(0)

    def log_det(self) -> Tensor:
        """``log|Λ|`` (float64 scalar); low rank by the matrix determinant lemma."""
        if self.structure is CovarianceStructure.FULL:
            return 2 * torch.log(self.chol.diagonal()).sum()
        log_det = torch.log(self.diag).sum()
        if self.structure is CovarianceStructure.LOWRANK:
            log_det = log_det + 2 * torch.log(self.capacitance_chol.diagonal()).sum()
        return log_det


@register_posterior
class GaussianPosterior:
    """A Gaussian posterior ``prior + likelihood`` over parameters of shape ``shape``.

    When ``shape == (C, m + 1)`` the Gaussian is over a linear softmax head (bias in column 0,
    see :mod:`inference.linear_model`) and :meth:`predict_proba` maps features ``(B, m)`` to
    class probabilities. Instances are immutable; the float64 factorisation is cached.

    Args:
        prior: the prior's natural parameters (counted once, whatever is combined).
        likelihood: the likelihood term, posterior minus prior natural parameters.
        shape: the parameter shape; ``prod(shape) == d``.
        n_data: number of observations the likelihood term summarises.
    """

    kind = "gaussian"

    def __init__(
        self, prior: GaussianTerm, likelihood: GaussianTerm, shape: Sequence[int], n_data: int = 0
    ) -> None:
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != prior.dim or prior.dim != likelihood.dim:
            raise InvalidInputError(
                f"shape {shape} (size {math.prod(shape)}), prior dimension {prior.dim} and "
                f"likelihood dimension {likelihood.dim} must agree."
            )
        if prior.device != likelihood.device:
            raise InvalidInputError("prior and likelihood terms must be on the same device.")
        self.prior = prior
        self.likelihood = likelihood
        self.shape = shape
        self.n_data = int(n_data)
        self._cache: dict[str, object] = {}

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_mean_and_precision(
        cls, mean: Tensor, precision: Tensor, prior: GaussianTerm, n_data: int = 0,
        low_rank_factor: Tensor | None = None,
    ) -> GaussianPosterior:
        """From a posterior mean (any shape) and its *total* precision.

        ``precision`` is ``(d,)`` (diagonal), ``(d, d)`` (full), or with ``low_rank_factor``
        ``(d, r)`` the diagonal part of a low-rank-plus-diagonal precision.
        """
        flat = mean.reshape(-1)
        if low_rank_factor is not None:
            total = GaussianTerm(CovarianceStructure.LOWRANK, flat, diag=precision,
                                 factor=low_rank_factor)
        elif precision.ndim == 1:
            total = GaussianTerm(CovarianceStructure.DIAG, flat, diag=precision)
        else:
            total = GaussianTerm(CovarianceStructure.FULL, flat, dense=precision)
        total = GaussianTerm(total.structure, total.matvec(flat), diag=total.diag,
                             dense=total.dense, factor=total.factor)
        return cls.from_total(total, prior, mean.shape, n_data)

    @classmethod
    def from_total(
        cls, total: GaussianTerm, prior: GaussianTerm, shape: Sequence[int], n_data: int = 0
    ) -> GaussianPosterior:
        """From the posterior's total natural parameters (likelihood term = total − prior)."""
        prior = prior.to(total.device, total.dtype)
        lowrank_over_diag = (total.structure is CovarianceStructure.LOWRANK
                             and prior.structure is CovarianceStructure.DIAG)
        if lowrank_over_diag:
            lik = GaussianTerm(total.structure, total.shift - prior.shift,
                               diag=total.diag - prior.diag, factor=total.factor)
        else:
            lik = total - prior
        return cls(prior, lik, shape, n_data)

    # -- natural parameters and moments -------------------------------------------------------

    @property
    def natural(self) -> GaussianTerm:
        """Total natural parameters ``prior + likelihood``."""
        if "natural" not in self._cache:
            self._cache["natural"] = self.prior + self.likelihood
        return self._cache["natural"]

    @property
    def structure(self) -> CovarianceStructure:
        return self.natural.structure

    @property
    def precision_times_mean(self) -> Tensor:
        """``η = Λ μ``, shape ``(d,)``."""
        return self.natural.shift

    @property
    def dtype(self) -> torch.dtype:
        return self.likelihood.dtype

    @property
    def device(self) -> torch.device:
        return self.likelihood.device

    def _factorisation(self) -> _Factorisation:
        if "factor" not in self._cache:
            self._cache["factor"] = _Factorisation.of(self.natural)
        return self._cache["factor"]

    @property
    def flat_mean(self) -> Tensor:
        """Posterior mean as a flat ``(d,)`` vector: ``Λ⁻¹ η`` solved in float64."""
        if "mean" not in self._cache:
            solved = self._factorisation().solve(self.natural.shift)
            self._cache["mean"] = solved.to(self.dtype)
        return self._cache["mean"]

    @property
    def mean(self) -> Tensor:
        """Posterior mean, shape ``shape``."""
        return self.flat_mean.reshape(self.shape)

    def log_det_precision(self) -> Tensor:
        """``log|Λ|`` of the total precision, a float64 scalar tensor."""
        return self._factorisation().log_det()

    def marginal_variance(self) -> Tensor:
        """Diagonal of the covariance, shape ``shape`` (no dense inverse for diag / low rank)."""
        return self._factorisation().variance().to(self.dtype).reshape(self.shape)

    def covariance(self) -> Tensor:
        """Dense ``(d, d)`` covariance (an explicit inverse; meant for small ``d``)."""
        return self._factorisation().covariance().to(self.dtype)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n ≥ 1`` draws, shape ``(n, *shape)``, in the storage dtype on the posterior's
        device, via the precision's factorisation (``generator`` may live on any device)."""
        n = check_num_draws(n)
        draws = self._factorisation().standard_draws(n, generator)
        flat = self.flat_mean.to(torch.float64) + draws
        return flat.to(self.dtype).reshape(n, *self.shape)

    # -- softmax-head predictive --------------------------------------------------------------

    def _head_shape(self, features: Tensor) -> tuple[int, int]:
        if len(self.shape) != 2:
            raise InvalidInputError(
                f"predict_proba needs a posterior over a (C, m + 1) head; this one has shape "
                f"{self.shape}."
            )
        num_classes, width = self.shape
        check_features(features, width - 1)
        return num_classes, width

    def logit_moments(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and per-class variance of the logits ``f = W [1, x]``, each ``(B, C)``, float64."""
        features = as_features(features)
        num_classes, width = self._head_shape(features)
        x = augment_with_bias(features.to(device=self.device, dtype=torch.float64))
        mean_w = self.mean.to(torch.float64)
        logit_mean = x @ mean_w.T
        fac = self._factorisation()
        if fac.structure is CovarianceStructure.DIAG:
            var_w = fac.variance().reshape(num_classes, width)
            return logit_mean, (x**2) @ var_w.T
        if fac.structure is CovarianceStructure.FULL:
            if "class_blocks" not in self._cache:  # (C, P, P) diagonal blocks of Σ
                cov = fac.covariance().reshape(num_classes, width, num_classes, width)
                self._cache["class_blocks"] = torch.diagonal(cov, dim1=0, dim2=2).permute(2, 0, 1)
            blocks = self._cache["class_blocks"]
            var = torch.einsum("bp,cpq,bq->bc", x, blocks, x)
            return logit_mean, var.clamp_min(0.0)
        rank, batch = fac.factor.shape[1], x.shape[0]  # explicit sizes: rank may be 0
        inv_diag = (1.0 / fac.diag).reshape(num_classes, width)
        scaled = (fac.factor / fac.diag[:, None]).reshape(num_classes, width, rank)
        u = torch.einsum("bp,cpr->bcr", x, scaled)  # Lᵀ D⁻¹ J for every (b, c)
        w = torch.linalg.solve_triangular(
            fac.capacitance_chol, u.reshape(batch * num_classes, rank).T, upper=False
        )
        correction = (w**2).sum(0).reshape(batch, num_classes)
        return logit_mean, ((x**2) @ inv_diag.T - correction).clamp_min(0.0)

    def logit_covariance(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``(B, C)`` and full covariance ``(B, C, C)`` of the logits ``f = W [1, x]``,
        float64 (the diagonal is :meth:`logit_moments`' variance)."""
        features = as_features(features)
        num_classes, width = self._head_shape(features)
        x = augment_with_bias(features.to(device=self.device, dtype=torch.float64))
        logit_mean = x @ self.mean.to(torch.float64).T
        fac = self._factorisation()
        if fac.structure is CovarianceStructure.FULL:
            if "weight_blocks" not in self._cache:  # Σ as (C, P, C, P)
                self._cache["weight_blocks"] = fac.covariance().reshape(
                    num_classes, width, num_classes, width)
            return logit_mean, torch.einsum("bp,cpkq,bq->bck", x, self._cache["weight_blocks"],
                                            x)
        if fac.structure is CovarianceStructure.DIAG:
            var_w = fac.variance().reshape(num_classes, width)
            return logit_mean, torch.diag_embed((x**2) @ var_w.T)
        rank, batch = fac.factor.shape[1], x.shape[0]  # Σ = D⁻¹ − D⁻¹ L K⁻¹ Lᵀ D⁻¹
        inv_diag = (1.0 / fac.diag).reshape(num_classes, width)
        scaled = (fac.factor / fac.diag[:, None]).reshape(num_classes, width, rank)
        u = torch.einsum("bp,cpr->bcr", x, scaled)
        w = torch.linalg.solve_triangular(
            fac.capacitance_chol, u.reshape(batch * num_classes, rank).T, upper=False
        ).T.reshape(batch, num_classes, rank)
        return logit_mean, (torch.diag_embed((x**2) @ inv_diag.T)
                            - torch.einsum("bcr,bkr->bck", w, w))

    def predict_proba(
        self,
        inputs: Tensor,
        method: PredictiveMethod | str = PredictiveMethod.CENTRED_PROBIT,
        n_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Class probabilities ``(B, C)`` for features ``inputs (B, m)``.

        ``method``: ``"centred_probit"`` (default; the probit of the centred logits, see
        :class:`~inference.options.PredictiveMethod`), ``"probit"`` (``softmax(f / sqrt(1 +
        π v / 8))`` with the marginal variances, laplace-torch's), ``"mc"`` (average of
        ``n_samples`` softmax draws) or ``"map"`` (softmax at the mean).
        Computed in float64 on the posterior's device; returned in the inputs' dtype there.
        """
        method = PredictiveMethod.parse(method, "method")
        inputs = as_features(inputs)  # NumPy arrays and lists too (inference.inputs)
        self._head_shape(inputs)
        out_dtype = inputs.dtype
        if method is PredictiveMethod.MAP:
            x = augment_with_bias(inputs.to(device=self.device, dtype=torch.float64))
            return torch.softmax(x @ self.mean.to(torch.float64).T, -1).to(out_dtype)
        if method is PredictiveMethod.PROBIT:
            mean, var = self.logit_moments(inputs)
            kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * var)
            return torch.softmax(kappa * mean, dim=-1).to(out_dtype)
        if method is PredictiveMethod.CENTRED_PROBIT:
            mean, cov = self.logit_covariance(inputs)
            centring = torch.eye(mean.shape[1], dtype=torch.float64, device=mean.device)
            centring = centring - 1.0 / mean.shape[1]
            var = torch.diagonal(centring @ cov @ centring, dim1=1, dim2=2).clamp_min(0.0)
            kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * var)
            return torch.softmax(kappa * (mean @ centring), dim=-1).to(out_dtype)
        from inference.ensemble import mean_softmax  # avoid a cycle at import time

        weights = self.sample(n_samples, generator).to(torch.float64)
        features = inputs.to(device=self.device, dtype=torch.float64)
        return mean_softmax(weights, features).to(out_dtype)

    # -- federation algebra -------------------------------------------------------------------

    def __add__(self, other: GaussianPosterior) -> GaussianPosterior:
        """Exact product of two posteriors built against the same prior (prior counted once)."""
        if not isinstance(other, GaussianPosterior):
            return NotImplemented
        return combine([self, other])

    # -- devices and state --------------------------------------------------------------------

    def to(self, device: torch.device | str) -> GaussianPosterior:
        """A copy on ``device``."""
        return GaussianPosterior(self.prior.to(device), self.likelihood.to(device),
                                 self.shape, self.n_data)

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``prior.*``, ``likelihood.*`` (which keys exist says the structure),
        ``shape`` (int64 ``(len(shape),)``) and ``n_data`` (int64 scalar)."""
        state = {f"prior.{k}": v for k, v in self.prior.tensors().items()}
        state.update({f"likelihood.{k}": v for k, v in self.likelihood.tensors().items()})
        state["shape"] = torch.tensor(self.shape, dtype=torch.int64)
        state["n_data"] = torch.tensor(self.n_data, dtype=torch.int64)
        return state

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> GaussianPosterior:
        """Inverse of :meth:`state_dict`; raises :class:`InvalidInputError` on missing keys."""
        missing = [k for k in ("shape", "n_data") if k not in state]
        if missing:
            raise InvalidInputError(f"state lacks {missing}; not a Gaussian posterior.")
        terms = {}
        for prefix in ("prior", "likelihood"):
            parts = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(prefix + ".")}
            if "shift" not in parts:
                raise InvalidInputError(f"state has no `{prefix}.shift`; not a Gaussian posterior.")
            if "dense" in parts:
                structure = CovarianceStructure.FULL
            elif "factor" in parts:
                structure = CovarianceStructure.LOWRANK
            else:
                structure = CovarianceStructure.DIAG
            terms[prefix] = GaussianTerm(structure, **parts)
        shape = tuple(int(s) for s in state["shape"].tolist())
        return cls(terms["prior"], terms["likelihood"], shape, int(state["n_data"]))

    def __repr__(self) -> str:
        return (f"GaussianPosterior(shape={self.shape}, structure={self.structure.value}, "
                f"n_data={self.n_data}, dtype={self.dtype}, device={self.device})")


def gaussian_prior(
    shape: Sequence[int], precision: float = 1.0, mean: float = 0.0, *,
    dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
) -> GaussianTerm:
    """Isotropic prior ``N(mean, I / precision)`` over parameters of shape ``shape``."""
    return GaussianTerm.isotropic(math.prod(shape), precision, mean, dtype=dtype, device=device)


def _shared_prior(posteriors: Sequence[GaussianPosterior]) -> GaussianTerm:
    first = posteriors[0].prior
    for post in posteriors[1:]:
        if not post.prior.allclose(first, rtol=1e-12, atol=1e-300):
            raise InvalidInputError(
                "posteriors were built against different priors; pass `prior=` explicitly or "
                "rebuild them against one prior (the prior must be counted exactly once)."
            )
    return first


def _check_same_space(posteriors: Sequence[GaussianPosterior]) -> None:
    if len(posteriors) == 0:
        raise InvalidInputError("nothing to aggregate: the list of posteriors is empty.")
    shapes = {p.shape for p in posteriors}
    if len(shapes) != 1:
        raise InvalidInputError(f"posteriors have different parameter shapes: {sorted(shapes)}.")


def combine(
    posteriors: Sequence[GaussianPosterior], prior: GaussianTerm | None = None
) -> GaussianPosterior:
    """Exact product combination: ``prior + Σ_k likelihood_k`` (the prior counted once).

    Order-independent up to floating-point summation (terms are summed in float64 when the
    inputs are float64). The structure is the richest among the inputs (diag < lowrank < full).
    If ``prior`` is None, all posteriors must share one prior.
    """
    _check_same_space(posteriors)
    prior = _shared_prior(posteriors) if prior is None else prior
    likelihood = posteriors[0].likelihood
    for post in posteriors[1:]:
        likelihood = likelihood + post.likelihood
    n_data = sum(p.n_data for p in posteriors)
    return GaussianPosterior(prior.to(likelihood.device, likelihood.dtype), likelihood,
                             posteriors[0].shape, n_data)


def average(
    posteriors: Sequence[GaussianPosterior],
    weights: Sequence[float] | Tensor | None = None,
    prior: GaussianTerm | None = None,
) -> GaussianPosterior:
    """Moment-matched average: the Gaussian with the mean and covariance of the mixture
    ``Σ_k w_k N(μ_k, Σ_k)``.

    ``weights`` default to the clients' ``n_data`` (uniform if any is 0) and are normalised.
    The result is diagonal if every input is diagonal, else full (mixture covariances are dense).
    Its likelihood term is the moment-matched natural parameters minus the (shared) prior.
    """
    _check_same_space(posteriors)
    prior = _shared_prior(posteriors) if prior is None else prior
    device, dtype = posteriors[0].device, posteriors[0].dtype
    if weights is None:
        counts = [p.n_data for p in posteriors]
        weights = counts if min(counts) > 0 else [1.0] * len(posteriors)
    w = torch.as_tensor(weights, dtype=torch.float64, device=device).reshape(-1)
    valid = w.shape[0] == len(posteriors) and bool(torch.isfinite(w).all())
    if not valid or (w < 0).any() or w.sum() <= 0:
        raise InvalidInputError(f"weights must be {len(posteriors)} non-negative finite numbers "
                                "with a positive sum.")
    w = w / w.sum()
    means = torch.stack([p.flat_mean.to(torch.float64) for p in posteriors])  # (K, d)
    mean = (w[:, None] * means).sum(0)
    centred = means - mean
    all_diag = all(p.structure is CovarianceStructure.DIAG for p in posteriors)
    if all_diag:
        variances = torch.stack([p._factorisation().variance() for p in posteriors])
        variance = (w[:, None] * (variances + centred**2)).sum(0)
        total = GaussianTerm(CovarianceStructure.DIAG, mean / variance, diag=1.0 / variance)
    else:
        cov = sum(wk * p._factorisation().covariance() for wk, p in zip(w, posteriors, strict=True))
        cov = cov + centred.T @ (w[:, None] * centred)
        chol = cholesky_with_jitter(cov, "mixture covariance")
        precision = torch.cholesky_inverse(chol)
        total = GaussianTerm(CovarianceStructure.FULL, precision @ mean, dense=precision)
    total = total.to(dtype=dtype)
    n_data = sum(p.n_data for p in posteriors)
    return GaussianPosterior.from_total(total, prior, posteriors[0].shape, n_data)


__all__ = [
    "JITTER_SCHEDULE",
    "GaussianPosterior",
    "GaussianTerm",
    "average",
    "cholesky_with_jitter",
    "combine",
    "gaussian_prior",
]
