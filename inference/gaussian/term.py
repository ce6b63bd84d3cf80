"""One Gaussian factor in natural parameters: a precision ``Λ`` and a shift ``η = Λ μ``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from inference.errors import InvalidInputError
from inference.gaussian.diagonal import DiagonalPrecision
from inference.gaussian.precision import Precision, precision_class
from inference.options import CovarianceStructure


@dataclass(frozen=True, init=False, eq=False)
class GaussianTerm:
    """Natural parameters of one Gaussian factor over a flat vector of size ``d``.

    Built either from a `Precision` of any structure,
    ``GaussianTerm(precision, shift)``, or from a structure name and its tensors::

        GaussianTerm("diag", shift, diag=λ)              # Λ = diag(λ), λ (d,)
        GaussianTerm("full", shift, dense=Λ)             # Λ (d, d) symmetric
        GaussianTerm("lowrank", shift, diag=D, factor=L)  # Λ = diag(D) + L Lᵀ, L (d, r)

    (a structure registered by a subclass takes its own tensor names as keywords).

    Attributes:
        precision: ``Λ`` in its structure.
        shift: ``(d,)`` precision-times-mean ``η``.

    A term on its own need not be positive definite (a likelihood term obtained by subtraction
    may not be); only a posterior's total precision must be.
    """

    precision: Precision
    shift: Tensor

    def __init__(
        self, structure: CovarianceStructure | str | type[Precision] | Precision, shift: Tensor,
        diag: Tensor | None = None, dense: Tensor | None = None, factor: Tensor | None = None,
        **tensors: Tensor | None,
    ) -> None:
        parts = {"diag": diag, "dense": dense, "factor": factor, **tensors}
        given_precision = isinstance(structure, Precision)
        cls = type(structure) if given_precision else precision_class(structure)
        d = shift.shape[0] if shift.ndim == 1 else -1
        if d < 0:
            raise InvalidInputError(f"shift must be 1-D (d,); got {tuple(shift.shape)}.")
        if given_precision:
            if any(t is not None for t in parts.values()):
                raise InvalidInputError("pass a Precision or a structure name with its tensors, "
                                        "not both.")
            precision = structure
            cls._check_shapes(d, precision.tensors())
            if precision.dim != d:
                raise InvalidInputError(f"a precision of dimension {precision.dim} cannot go "
                                        f"with a shift of dimension {d}.")
        else:
            precision = cls.from_parts(d, parts)
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "shift", shift)
        kinds = {(t.dtype, t.device) for t in self.tensors().values()}
        if len(kinds) != 1 or not shift.is_floating_point():
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
        return cls(DiagonalPrecision(diag), diag * mean_vec)

    @classmethod
    def zeros(
        cls, dim: int, structure: CovarianceStructure | str = "diag", *,
        dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
    ) -> GaussianTerm:
        """The neutral term (no information), of the given structure.

        Every tensor is its own allocation (safetensors refuses tensors that share memory).
        """
        precision = precision_class(structure).zeros(dim, dtype=dtype, device=device)
        return cls(precision, torch.zeros(dim, dtype=dtype, device=device))

    # -- basic properties ---------------------------------------------------------------------

    @property
    def structure(self) -> CovarianceStructure | str:
        """The precision's structure (see `CovarianceStructure`)."""
        return self.precision.structure

    @property
    def diag(self) -> Tensor | None:
        """``(d,)`` diagonal of the precision (``diag``) or its diagonal part (``lowrank``)."""
        return self.precision.tensors().get("diag")

    @property
    def dense(self) -> Tensor | None:
        """``(d, d)`` precision of a ``full`` term, else ``None``."""
        return self.precision.tensors().get("dense")

    @property
    def factor(self) -> Tensor | None:
        """``(d, r)`` factor ``L`` of the low-rank part ``L Lᵀ`` (``lowrank``), else ``None``."""
        return self.precision.tensors().get("factor")

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
        """The tensors this term holds, by name: ``shift`` and the precision's (``diag``,
        ``dense``, ``factor`` for the built-in structures)."""
        return {"shift": self.shift, **self.precision.tensors()}

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> GaussianTerm:
        """A copy on ``device`` and/or in ``dtype`` (``None`` keeps the current one)."""
        return GaussianTerm(self.precision.to(device, dtype),
                            self.shift.to(device=device, dtype=dtype))

    # -- algebra ------------------------------------------------------------------------------

    def promoted(self, structure: CovarianceStructure | str) -> GaussianTerm:
        """The same term stored with a richer structure (``diag < lowrank < full``)."""
        target = precision_class(structure)
        if target is type(self.precision):
            return self
        converted = target.convert(self.precision)
        if converted is None:
            raise InvalidInputError(f"cannot store a {self.structure} term as {target.structure}.")
        return GaussianTerm(converted, self.shift)

    def __add__(self, other: GaussianTerm) -> GaussianTerm:
        """Product of two Gaussian factors: natural parameters add (structure promoted)."""
        if not isinstance(other, GaussianTerm):
            return NotImplemented
        if other.dim != self.dim:
            raise InvalidInputError(f"cannot add terms of dimension {self.dim} and {other.dim}.")
        return GaussianTerm(self.precision.add(other.precision), self.shift + other.shift)

    def __sub__(self, other: GaussianTerm) -> GaussianTerm:
        """Division of Gaussian factors (natural parameters subtract). Low rank is densified."""
        if not isinstance(other, GaussianTerm):
            return NotImplemented
        if other.dim != self.dim:
            raise InvalidInputError(
                f"cannot subtract terms of dimension {self.dim} and {other.dim}."
            )
        return GaussianTerm(self.precision.subtract(other.precision), self.shift - other.shift)

    def without(self, prior: GaussianTerm) -> GaussianTerm:
        """The likelihood term ``self − prior`` of a posterior whose total is ``self``: like
        ``-``, but kept in this term's structure where that is exact (low rank minus a diagonal
        prior stays low rank)."""
        if prior.dim != self.dim:
            raise InvalidInputError(
                f"cannot subtract terms of dimension {self.dim} and {prior.dim}."
            )
        return GaussianTerm(self.precision.without(prior.precision), self.shift - prior.shift)

    def scaled(self, weight: float) -> GaussianTerm:
        """The term raised to the power ``weight ≥ 0`` (natural parameters times ``weight``)."""
        if weight < 0:
            raise InvalidInputError(f"a term can only be scaled by a weight ≥ 0; got {weight}.")
        w = float(weight)
        return GaussianTerm(self.precision.scale(w), self.shift * w)

    def precision_matrix(self) -> Tensor:
        """The precision as a dense ``(d, d)`` matrix (memory ``d²``)."""
        return self.precision.to_dense()

    def precision_diagonal(self) -> Tensor:
        """The diagonal of the precision, ``(d,)``."""
        return self.precision.diagonal()

    def matvec(self, vector: Tensor) -> Tensor:
        """``Λ v`` for ``v`` of shape ``(d,)`` or ``(d, k)``."""
        return self.precision.matmul(vector)

    def allclose(self, other: GaussianTerm, rtol: float = 1e-12, atol: float = 0.0) -> bool:
        """Whether two terms have the same natural parameters (compared densely if needed)."""
        if self.dim != other.dim or not torch.allclose(self.shift, other.shift, rtol, atol):
            return False
        return self.precision.allclose(other.precision, rtol, atol)


def gaussian_prior(
    shape: Sequence[int], precision: float = 1.0, mean: float = 0.0, *,
    dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
) -> GaussianTerm:
    """Isotropic prior ``N(mean, I / precision)`` over parameters of shape ``shape``."""
    return GaussianTerm.isotropic(math.prod(shape), precision, mean, dtype=dtype, device=device)


__all__ = ["GaussianTerm", "gaussian_prior"]
