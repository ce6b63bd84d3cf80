"""The precision interface: one small class per storage structure of a Gaussian's precision.

A Gaussian factor over ``θ ∈ R^d`` stores its precision ``Λ`` (symmetric, ``d x d``) in one
structure: diagonal (`diagonal`), dense (`full`),
low rank plus diagonal (`low_rank`), or any structure a subclass adds
(a Kronecker product, say), as laplace-torch has one curvature class per structure. Terms,
posteriors and aggregation (`term`, `posterior`,
`aggregation`) only call this interface; none of them branches on the
structure.

A structure is a frozen dataclass whose fields are its tensors (the names its state-dict keys
take) that subclasses `Precision`, sets the class attributes ``structure`` (its name,
which registers it) and ``richness`` (promotion order), and implements six methods:

- algebra, valid for any symmetric ``Λ``: ``dim``, `to_dense`,
  `scale`;
- factorised, valid when ``Λ`` is positive definite (computed in float64, cached on the
  instance): `solve`, `logdet`,
  `from_standard_normals` (the linear map ``T`` with ``T Tᵀ = Λ⁻¹`` that
  sampling applies to standard normals).

Everything else has a correct default built on those six (``matmul``, ``diagonal``,
``variance``, ``covariance``, the softmax head's ``head_logit_variance``, addition, subtraction,
moving between devices and dtypes), which a structure overrides where it knows a cheaper or
more exact way. Addition of two precisions is stored in the poorest registered structure that
holds both exactly (``diag < lowrank < full``), falling back to the dense one.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from functools import cached_property
from typing import Any, ClassVar, Self

import torch
from torch import Tensor

from inference.curvature import logit_covariance
from inference.errors import InvalidInputError
from inference.options import CovarianceStructure
from inference.posterior import draw_device

#: Registered structures by name (``str(cls.structure)``), in registration order.
_STRUCTURES: dict[str, type[Precision]] = {}


class Precision(ABC):
    """A symmetric ``d x d`` precision matrix in one storage structure (see the module doc).

    A precision on its own need not be positive definite (a likelihood term's, obtained by
    subtraction, may not be); the factorised methods need it to be and raise
    `NumericalError` otherwise. Results of the factorised methods are
    float64 on the precision's device, whatever its storage dtype.
    """

    #: The structure's name (a `CovarianceStructure` for the built-in ones).
    structure: ClassVar[CovarianceStructure | str]
    #: Promotion order: a sum is stored in a structure at least as rich as both summands.
    richness: ClassVar[int] = 1
    #: Whether equal precisions have equal tensors (then they are compared tensor by tensor).
    canonical: ClassVar[bool] = False
    #: Optional shape rules checked before construction, ``{tensor name: dims}``: ``"d"`` is the
    #: dimension, other letters are free but must agree where repeated (e.g. ``("d", "r")``).
    shapes: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "structure" in vars(cls):
            name = str(cls.structure).lower()
            existing = _STRUCTURES.get(name)
            if existing is not None and (existing.__module__, existing.__qualname__) != (
                    cls.__module__, cls.__qualname__):
                raise TypeError(f"precision structure {name!r} is already registered by "
                                f"{existing.__qualname__}; choose another name.")
            _STRUCTURES[name] = cls

    # -- what a structure must provide --------------------------------------------------------

    @property
    @abstractmethod
    def dim(self) -> int:
        """``d``, the size of the vector this precision is over."""

    @abstractmethod
    def to_dense(self) -> Tensor:
        """``Λ`` as a dense ``(d, d)`` matrix in the storage dtype (memory ``d²``)."""

    @abstractmethod
    def scale(self, weight: float) -> Self:
        """``weight · Λ`` for a float ``weight ≥ 0``, in this structure."""

    @abstractmethod
    def solve(self, rhs: Tensor) -> Tensor:
        """``Λ⁻¹ b`` for ``b`` of shape ``(d,)`` or ``(d, k)``, float64."""

    @abstractmethod
    def logdet(self) -> Tensor:
        """``log|Λ|``, a float64 scalar tensor."""

    @abstractmethod
    def from_standard_normals(self, *normals: Tensor) -> Tensor:
        """``(n, d)`` float64 draws of ``N(0, Λ⁻¹)`` from standard normals: a linear map ``T``
        applied to the blocks ``normals`` (float64, shapes ``(rows_i, n)`` for ``rows_i`` in
        `noise_shape`), with ``T Tᵀ = Λ⁻¹``."""

    # -- construction and storage -------------------------------------------------------------

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        """The names of the tensors this structure holds (its dataclass fields)."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def tensors(self) -> dict[str, Tensor]:
        """The tensors this precision holds, by name (the keys of its state dict)."""
        return {name: getattr(self, name) for name in self.tensor_names()}

    @classmethod
    def from_parts(cls, dim: int, parts: Mapping[str, Tensor | None]) -> Self:
        """The precision of dimension ``dim`` from named tensors (``None`` means absent),
        refusing missing or unexpected tensors and shapes that break `shapes`."""
        needed = cls.tensor_names()
        for name in dict.fromkeys([*parts, *needed]):
            if (parts.get(name) is not None) != (name in needed):
                state = "needs" if name in needed else "must not have"
                raise InvalidInputError(f"a {cls.structure} term {state} `{name}`.")
        present = {name: parts[name] for name in needed}
        cls._check_shapes(dim, present)
        precision = cls(**present)
        if precision.dim != dim:
            raise InvalidInputError(f"a {cls.structure} precision of dimension {precision.dim} "
                                    f"cannot go with a shift of dimension {dim}.")
        return precision

    @classmethod
    def _check_shapes(cls, dim: int, parts: Mapping[str, Tensor]) -> None:
        sizes: dict[str, int] = {"d": dim}
        for name, dims in cls.shapes.items():
            value = parts[name]
            shape = tuple(value.shape)
            fits = len(shape) == len(dims) and all(
                sizes.setdefault(symbol, size) == size for symbol, size in zip(dims, shape,
                                                                                strict=False))
            if not fits:
                shown = [str(dim) if symbol == "d" else symbol for symbol in dims]
                text = f"({shown[0]},)" if len(shown) == 1 else f"({', '.join(shown)})"
                raise InvalidInputError(f"`{name}` must have shape {text}; got {shape}.")

    @classmethod
    def zeros(cls, dim: int, *, dtype: torch.dtype = torch.float64,
              device: torch.device | str | None = None) -> Self:
        """The zero precision (no information) of dimension ``dim``, if the structure has one."""
        raise InvalidInputError(f"a {cls.structure} precision has no zero of its own; use "
                                "GaussianTerm.zeros(dim, 'diag') and add it.")

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.tensors().values())).dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> Self:
        """A copy on ``device`` and/or in ``dtype`` (``None`` keeps the current one)."""
        moved = {n: t.to(device=device, dtype=dtype) for n, t in self.tensors().items()}
        return type(self)(**moved)

    # -- algebra (any symmetric Λ) ------------------------------------------------------------

    def diagonal(self) -> Tensor:
        """The diagonal of ``Λ``, ``(d,)`` in the storage dtype."""
        return self.to_dense().diagonal()

    def matmul(self, vector: Tensor) -> Tensor:
        """``Λ v`` for ``v`` of shape ``(d,)`` or ``(d, k)``."""
        return self.to_dense() @ vector

    @classmethod
    def convert(cls, other: Precision) -> Self | None:
        """``other`` stored exactly in this structure, or ``None`` if it cannot be."""
        return other if type(other) is cls else None

    def _add_same(self, other: Self) -> Precision | None:
        """``self + other`` of the same structure, or ``None`` if the sum leaves it."""
        return None

    def _subtract_same(self, other: Self) -> Precision | None:
        """``self − other`` of the same structure, or ``None`` to subtract densely."""
        return None

    def add(self, other: Precision) -> Precision:
        """``Λ₁ + Λ₂`` (the product of two Gaussian factors), in the poorest registered
        structure at least as rich as both that holds both exactly (the dense one at last)."""
        floor = max(self.richness, other.richness)
        candidates = sorted((c for c in _STRUCTURES.values() if c.richness >= floor),
                            key=lambda c: c.richness)  # stable: registration order breaks ties
        for cls in candidates:
            a, b = cls.convert(self), cls.convert(other)
            total = None if a is None or b is None else a._add_same(b)
            if total is not None:
                return total
        return _dense_class()(self.to_dense() + other.to_dense())

    def subtract(self, other: Precision) -> Precision:
        """``Λ₁ − Λ₂`` (the quotient of two Gaussian factors): in the common structure where
        the structure says the difference stays in it (diagonal), else dense."""
        if type(other) is type(self):
            same = self._subtract_same(other)
            if same is not None:
                return same
        return _dense_class()(self.to_dense() - other.to_dense())

    def without(self, other: Precision) -> Precision:
        """``Λ − Λ_other`` where ``other`` is a prior's precision: like `subtract`, but a
        structure may keep itself where that is exact (low rank minus a diagonal prior)."""
        return self.subtract(other)

    def allclose(self, other: Precision, rtol: float = 1e-12, atol: float = 0.0) -> bool:
        """Whether two precisions are equal to a tolerance (tensor by tensor if the structure
        is canonical and shared, else densely)."""
        if type(other) is type(self) and self.canonical:
            return all(torch.allclose(a, b, rtol, atol) for a, b in
                       zip(self.tensors().values(), other.tensors().values(), strict=True))
        return torch.allclose(self.to_dense(), other.to_dense(), rtol, atol)

    # -- factorised (Λ positive definite; float64) --------------------------------------------

    def noise_shape(self) -> tuple[int, ...]:
        """Rows of the standard-normal blocks one batch of draws consumes, in drawing order."""
        return (self.dim,)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``(n, d)`` float64 draws of ``N(0, Λ⁻¹)`` on the precision's device; the normals
        are drawn on ``generator``'s device (so a CPU generator seeds a CUDA precision too)."""
        normals = [self._standard_normals(rows, n, generator) for rows in self.noise_shape()]
        return self.from_standard_normals(*normals)

    def _standard_normals(self, rows: int, n: int, generator: torch.Generator | None) -> Tensor:
        return torch.randn(rows, n, dtype=torch.float64, generator=generator,
                           device=draw_device(generator, self.device)).to(self.device)

    def covariance(self) -> Tensor:
        """Dense ``Λ⁻¹``, ``(d, d)`` float64 (meant for small ``d``)."""
        return self.solve(torch.eye(self.dim, dtype=torch.float64, device=self.device))

    def variance(self) -> Tensor:
        """The diagonal of ``Λ⁻¹``, ``(d,)`` float64."""
        return self.covariance().diagonal()

    def head_logit_variance(self, inputs: Tensor, num_classes: int) -> Tensor:
        """Variances ``x_bᵀ Σ_cc x_b`` of the logits ``f_bc = θ_c · x_b`` of a linear head whose
        parameters are laid out ``(C, P)`` row-major (``θ_c`` is row ``c``), for float64 inputs
        ``x (B, P)``: ``(B, C)`` float64.

        Default: from the per-class diagonal blocks ``Σ_cc (C, P, P)`` of the dense covariance,
        computed once per precision and cached.
        """
        memo = self._memo
        if ("class_blocks", num_classes) not in memo:
            width = self.dim // num_classes
            cov = self.covariance().reshape(num_classes, width, num_classes, width)
            blocks = torch.diagonal(cov, dim1=0, dim2=2).permute(2, 0, 1)
            memo["class_blocks", num_classes] = blocks
        blocks = memo["class_blocks", num_classes]
        return torch.einsum("bp,cpq,bq->bc", inputs, blocks, inputs).clamp_min(0.0)

    def head_logit_covariance(self, inputs: Tensor, num_classes: int) -> Tensor:
        """Covariances ``x_bᵀ Σ_ck x_b`` of the logits of each input across classes (layout
        as in `head_logit_variance`): ``(B, C, C)`` float64, whose diagonal is the
        variance.

        Default: from the dense covariance (computed once per precision and cached) by
        `inference.curvature.logit_covariance`, one GEMM per class over its blocks on and
        right of the diagonal (the lower triangle mirrored), not the einsum over the ``(C, P,
        C, P)`` view (S1's 250 test rows of a 1,010-parameter head: 20 -> 6 ms; issue 41).
        """
        memo = self._memo
        if "covariance" not in memo:
            memo["covariance"] = self.covariance()
        return logit_covariance(memo["covariance"], inputs, num_classes)

    @cached_property
    def _memo(self) -> dict[Any, Tensor]:
        """Derived quantities cached on this (immutable) precision."""
        return {}


def columns(rhs: Tensor) -> tuple[Tensor, bool]:
    """``rhs`` as float64 columns ``(d, k)``, and whether it was a single vector ``(d,)``."""
    b = rhs.to(torch.float64)
    column = b.ndim == 1
    return (b[:, None] if column else b), column


def precision_class(structure: CovarianceStructure | str | type[Precision]) -> type[Precision]:
    """The registered `Precision` subclass for a structure name (case-insensitive)."""
    if isinstance(structure, type) and issubclass(structure, Precision):
        return structure
    if isinstance(structure, str) and structure.lower() in _STRUCTURES:
        return _STRUCTURES[structure.lower()]
    choices = ", ".join(repr(name) for name in _STRUCTURES)
    raise InvalidInputError(f"CovarianceStructure must be one of {choices}; got {structure!r}.")


def precision_class_for_tensors(names: Iterable[str]) -> type[Precision]:
    """The structure a state's tensor names describe: the one sharing the most names with them
    (fewest missing, then the richer); diagonal if none shares a name, so that the error names
    what a diagonal term needs."""
    given = set(names)

    def score(cls: type[Precision]) -> tuple[int, int, int]:
        needed = set(cls.tensor_names())
        return len(needed & given), -len(needed - given), cls.richness

    best = max(_STRUCTURES.values(), key=score)
    return best if score(best)[0] > 0 else precision_class(CovarianceStructure.DIAG)


def _dense_class() -> type[Precision]:
    """The dense structure every precision converts to (registered by its module)."""
    return precision_class(CovarianceStructure.FULL)


__all__ = ["Precision", "columns", "precision_class", "precision_class_for_tensors"]
