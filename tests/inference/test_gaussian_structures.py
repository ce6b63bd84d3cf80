"""Every precision structure against its dense reference, and a structure added by subclassing.

Each storage structure of a Gaussian's precision is one `Precision` subclass and the
posterior only calls that interface. The reference for every method is the dense matrix the
test builds itself from the structure's raw tensors, handled with ``torch.linalg`` (``inv``,
``slogdet``, ``solve``).

Tolerance: 1e-12 relative (largest error over the largest reference entry). The matrices are
built well conditioned (condition number below ~20), so float64 Cholesky, Woodbury and
eigendecomposition results agree with the dense inverse to about cond · d · 2⁻⁵³ ≈ 1e-14; a wrong
formula (a transposed factor, a missing Woodbury term, a prior counted twice) is off by O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import (
    DiagonalPrecision,
    FullPrecision,
    GaussianPosterior,
    GaussianTerm,
    LowRankPrecision,
    Precision,
    combine,
    gaussian_prior,
)
from inference.gaussian.precision import columns
from inference.options import PredictiveMethod

F64 = torch.float64
C, P = 3, 4  # a (C, P) softmax head over m = P - 1 features: d = 12
D = C * P


@dataclass(frozen=True, eq=False)
class KroneckerPrecision(Precision):
    """``Λ = left ⊗ right + delta · I``: a K-FAC curvature of a ``(C, P)`` head plus an
    isotropic prior, added without touching `inference.gaussian` (only the six abstract
    methods, and where it knows better: which precisions it holds and how two of them add).

    ``left (C, C)`` and ``right (P, P)`` symmetric positive semi-definite, ``delta ()``.
    Factorised by the eigendecompositions ``left = Qa diag(a) Qaᵀ``, ``right = Qb diag(b) Qbᵀ``:
    ``Λ = (Qa ⊗ Qb) diag(a_i b_j + δ) (Qa ⊗ Qb)ᵀ``.
    """

    left: Tensor
    right: Tensor
    delta: Tensor

    structure: ClassVar[str] = "kron"
    shapes: ClassVar[dict[str, tuple[str, ...]]] = {
        "left": ("a", "a"), "right": ("b", "b"), "delta": ()}

    @property
    def dim(self) -> int:
        return self.left.shape[0] * self.right.shape[0]

    def to_dense(self) -> Tensor:
        eye = torch.eye(self.dim, dtype=self.left.dtype, device=self.left.device)
        return torch.kron(self.left, self.right) + self.delta * eye

    def scale(self, weight: float) -> KroneckerPrecision:
        return KroneckerPrecision(self.left * weight, self.right, self.delta * weight)

    @classmethod
    def convert(cls, other: Precision) -> KroneckerPrecision | None:
        """An isotropic diagonal ``δ I`` (a typical prior) is a zero Kronecker part plus ``δ``."""
        if isinstance(other, DiagonalPrecision) and bool((other.diag == other.diag[0]).all()):
            zeros = other.diag.new_zeros
            return cls(zeros(1, 1), zeros(other.dim, other.dim), other.diag[0].clone())
        return super().convert(other)

    def _add_same(self, other: KroneckerPrecision) -> KroneckerPrecision | None:
        """Closed only when one Kronecker part is zero (a prior plus a curvature)."""
        for zero, kept in ((self, other), (other, self)):
            if not zero.left.any() or not zero.right.any():
                return KroneckerPrecision(kept.left, kept.right, self.delta + other.delta)
        return None

    @cached_property
    def _eigen(self) -> tuple[Tensor, Tensor, Tensor]:
        a, qa = torch.linalg.eigh(self.left.to(F64))
        b, qb = torch.linalg.eigh(self.right.to(F64))
        spectrum = a[:, None] * b[None, :] + self.delta.to(F64)  # (C, P) eigenvalues of Λ
        if not bool((spectrum > 0).all()):
            raise NumericalError("the Kronecker precision is not positive definite.")
        return qa, qb, spectrum

    def solve(self, rhs: Tensor) -> Tensor:
        qa, qb, spectrum = self._eigen
        b, column = columns(rhs)
        v = b.reshape(qa.shape[0], qb.shape[0], -1)
        v = torch.einsum("ci,cpk,pj->ijk", qa, v, qb) / spectrum[..., None]
        x = torch.einsum("ic,cpk,jp->ijk", qa, v, qb).reshape(self.dim, -1)
        return x[:, 0] if column else x

    def logdet(self) -> Tensor:
        return torch.log(self._eigen[2]).sum()

    def from_standard_normals(self, *normals: Tensor) -> Tensor:
        (eps,) = normals  # z = (Qa ⊗ Qb) diag(s)^-½ ε has covariance Λ⁻¹
        qa, qb, spectrum = self._eigen
        e = eps.reshape(qa.shape[0], qb.shape[0], -1) / spectrum.sqrt()[..., None]
        return torch.einsum("ic,cpn,jp->ijn", qa, e, qb).reshape(self.dim, -1).T


# -- structures with their dense references built independently -----------------------------


def spd(n: int, gen: torch.Generator) -> Tensor:
    """A symmetric positive-definite matrix with eigenvalues in about [1, 3]."""
    a = torch.randn(n, n, generator=gen, dtype=F64)
    return a @ a.T / (2 * n) + torch.eye(n, dtype=F64)


def structure_and_dense(name: str, seed: int = 0) -> tuple[Precision, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if name == "diag":
        diag = 1 + torch.rand(D, generator=gen, dtype=F64)
        return DiagonalPrecision(diag), torch.diag(diag)
    if name == "full":
        dense = spd(D, gen)
        return FullPrecision(dense), dense.clone()
    if name.startswith("lowrank"):
        rank = int(name.removeprefix("lowrank"))
        diag = 1 + torch.rand(D, generator=gen, dtype=F64)
        factor = 0.3 * torch.randn(D, rank, generator=gen, dtype=F64)
        return LowRankPrecision(diag, factor), torch.diag(diag) + factor @ factor.T
    left, right, delta = spd(C, gen), spd(P, gen), torch.tensor(0.5, dtype=F64)
    reference = torch.kron(left, right) + 0.5 * torch.eye(D, dtype=F64)
    return KroneckerPrecision(left, right, delta), reference


STRUCTURES = ["diag", "full", "lowrank0", "lowrank3", "kron"]


def assert_relative(actual: Tensor, expected: Tensor, rtol: float = 1e-12) -> None:
    """``max|actual − expected| ≤ rtol · max|expected|`` (see the module docstring)."""
    assert actual.shape == expected.shape
    error = float((actual - expected).abs().max())
    assert error <= rtol * float(expected.abs().max()), (error, float(expected.abs().max()))


def head_jacobian(x: Tensor) -> Tensor:
    """``(B, C, d)`` Jacobian of the logits ``f_c = θ_c · x`` for a ``(C, P)`` row-major θ."""
    return torch.einsum("ck,bp->bckp", torch.eye(C, dtype=F64), x).reshape(len(x), C, D)


# -- the interface ------------------------------------------------------------------------------


def test_a_structure_needs_exactly_six_methods():
    """What a new structure must write (everything else has a default built on these)."""
    assert Precision.__abstractmethods__ == {
        "dim", "to_dense", "scale", "solve", "logdet", "from_standard_normals"}


@pytest.mark.parametrize("name", STRUCTURES)
def test_algebra_equals_the_dense_matrix(name):
    precision, dense = structure_and_dense(name)
    v = torch.randn(D, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    assert precision.dim == D
    assert_relative(precision.to_dense(), dense)
    assert_relative(precision.diagonal(), dense.diagonal())
    assert_relative(precision.matmul(v), dense @ v)
    assert_relative(precision.matmul(v[:, 0]), dense @ v[:, 0])
    assert_relative(precision.scale(2.5).to_dense(), 2.5 * dense)


@pytest.mark.parametrize("name", STRUCTURES)
def test_solve_logdet_variance_and_covariance_equal_the_dense_inverse(name):
    precision, dense = structure_and_dense(name)
    rhs = torch.randn(D, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    covariance = torch.linalg.inv(dense)
    assert_relative(precision.solve(rhs), torch.linalg.solve(dense, rhs))
    assert_relative(precision.solve(rhs[:, 1]), torch.linalg.solve(dense, rhs[:, 1]))
    assert_relative(precision.logdet(), torch.linalg.slogdet(dense)[1])
    assert_relative(precision.covariance(), covariance)
    assert_relative(precision.variance(), covariance.diagonal())


@pytest.mark.parametrize("name", STRUCTURES)
def test_the_sampling_map_has_exactly_the_covariance(name):
    """Draws are ``T ε`` for standard normals ``ε``; feeding the identity as ``ε`` gives ``T``
    itself, and ``T Tᵀ`` must be the covariance exactly (no Monte Carlo)."""
    precision, dense = structure_and_dense(name)
    rows = precision.noise_shape()
    identity = torch.eye(sum(rows), dtype=F64)
    transform = precision.from_standard_normals(*identity.split(list(rows)))  # (Σ rows, d)
    assert_relative(transform.T @ transform, torch.linalg.inv(dense))


@pytest.mark.parametrize("name", STRUCTURES)
def test_sample_applies_the_map_to_normals_drawn_block_by_block(name):
    precision, _ = structure_and_dense(name)
    draws = precision.sample(6, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    normals = [torch.randn(rows, 6, generator=gen, dtype=F64) for rows in precision.noise_shape()]
    assert draws.shape == (6, D) and draws.dtype == F64
    assert torch.equal(draws, precision.from_standard_normals(*normals))


@pytest.mark.parametrize("name", STRUCTURES)
def test_head_logit_moments_equal_the_jacobian_quadratic_form(name):
    precision, dense = structure_and_dense(name)
    x = torch.randn(7, P, generator=torch.Generator().manual_seed(4), dtype=F64)
    jac = head_jacobian(x)
    expected = jac @ torch.linalg.inv(dense) @ jac.transpose(1, 2)  # (B, C, C)
    assert_relative(precision.head_logit_covariance(x, C), expected)
    assert_relative(precision.head_logit_variance(x, C), expected.diagonal(dim1=1, dim2=2))


@pytest.mark.parametrize("name", STRUCTURES)
def test_moving_to_float32_and_back_keeps_the_structure(name):
    precision, dense = structure_and_dense(name)
    moved = precision.to(dtype=torch.float32)
    assert type(moved) is type(precision) and moved.dtype == torch.float32
    # float32 storage: one rounding of each tensor, relative 2⁻²⁴ ≈ 6e-8 (plus sums for dense)
    assert_relative(moved.to(dtype=F64).to_dense(), dense, rtol=1e-6)


# -- promotion: sums and differences --------------------------------------------------------------


def isotropic(value: float = 2.0) -> DiagonalPrecision:
    return DiagonalPrecision(torch.full((D,), value, dtype=F64))


@pytest.mark.parametrize(("first", "second", "structure"), [
    ("diag", "diag", DiagonalPrecision),
    ("diag", "lowrank3", LowRankPrecision),
    ("lowrank3", "diag", LowRankPrecision),
    ("lowrank0", "lowrank3", LowRankPrecision),
    ("diag", "full", FullPrecision),
    ("lowrank3", "full", FullPrecision),
    ("full", "full", FullPrecision),
    ("kron", "diag", FullPrecision),  # a diagonal that is not isotropic leaves Kronecker
    ("kron", "kron", FullPrecision),  # two Kronecker curvatures do not add to one
    ("kron", "lowrank3", FullPrecision),
])
def test_a_sum_is_stored_in_the_poorest_structure_that_holds_both(first, second, structure):
    a, dense_a = structure_and_dense(first, seed=0)
    b, dense_b = structure_and_dense(second, seed=1)
    total = a.add(b)
    assert type(total) is structure
    assert_relative(total.to_dense(), dense_a + dense_b)


def test_an_isotropic_prior_added_to_a_kronecker_curvature_stays_kronecker():
    kron, dense = structure_and_dense("kron")
    for total in (kron.add(isotropic()), isotropic().add(kron)):
        assert type(total) is KroneckerPrecision
        assert_relative(total.to_dense(), dense + 2.0 * torch.eye(D, dtype=F64))


@pytest.mark.parametrize("name", STRUCTURES)
def test_differences_are_exact_and_keep_the_structure_only_where_it_holds(name):
    precision, dense = structure_and_dense(name)
    prior = isotropic(0.5)
    difference = precision.subtract(prior)
    assert type(difference) is (DiagonalPrecision if name == "diag" else FullPrecision)
    assert_relative(difference.to_dense(), dense - 0.5 * torch.eye(D, dtype=F64))
    likelihood = precision.without(prior)  # low rank minus a diagonal prior stays low rank
    kept = name in ("diag", "lowrank0", "lowrank3")
    assert type(likelihood) is (type(precision) if kept else FullPrecision)
    assert_relative(likelihood.to_dense(), dense - 0.5 * torch.eye(D, dtype=F64))


def test_allclose_compares_the_matrices_whatever_their_storage():
    low, dense = structure_and_dense("lowrank3")
    assert low.allclose(FullPrecision(dense)) and FullPrecision(dense).allclose(low)
    assert not low.allclose(low.scale(1.0 + 1e-9))
    assert isotropic().allclose(isotropic()) and not isotropic().allclose(isotropic(2.1))


# -- a structure added by subclassing, used by the unchanged posterior ---------------------------


def kronecker_and_dense_posteriors(seed: int = 0) -> tuple[GaussianPosterior, GaussianPosterior]:
    """The same posterior twice: a Kronecker likelihood term, and its dense copy."""
    gen = torch.Generator().manual_seed(seed)
    left, right = spd(C, gen), spd(P, gen)
    shift = torch.randn(D, generator=gen, dtype=F64)
    prior = gaussian_prior((C, P), precision=0.8, mean=0.1)
    kron = GaussianTerm(KroneckerPrecision(left, right, torch.tensor(0.0, dtype=F64)), shift)
    dense = GaussianTerm("full", shift, dense=torch.kron(left, right))
    return (GaussianPosterior(prior, kron, (C, P), n_data=5),
            GaussianPosterior(prior, dense, (C, P), n_data=5))


def test_a_new_structure_runs_the_whole_posterior_without_touching_it():
    post, reference = kronecker_and_dense_posteriors()
    assert type(post.natural.precision) is KroneckerPrecision  # the prior went into delta
    assert str(post.structure) == "kron" and "structure=kron" in repr(post)
    x = torch.randn(9, P - 1, generator=torch.Generator().manual_seed(5), dtype=F64)
    assert_relative(post.mean, reference.mean)
    assert_relative(post.marginal_variance(), reference.marginal_variance())
    assert_relative(post.covariance(), reference.covariance())
    assert_relative(post.log_det_precision(), reference.log_det_precision())
    for ours, theirs in zip(post.logit_moments(x), reference.logit_moments(x), strict=True):
        assert_relative(ours, theirs)
    for method in PredictiveMethod:
        if method is not PredictiveMethod.MC:
            assert_relative(post.predict_proba(x, method), reference.predict_proba(x, method))
    draws = post.sample(4, generator=torch.Generator().manual_seed(6))
    offsets = post.natural.precision.sample(4, torch.Generator().manual_seed(6))
    assert_relative(draws.reshape(4, D) - post.flat_mean, offsets)


def test_a_new_structure_round_trips_through_a_state_dict_and_combines():
    post, reference = kronecker_and_dense_posteriors()
    state = post.state_dict()
    assert {"likelihood.left", "likelihood.right", "likelihood.delta"} <= set(state)
    loaded = GaussianPosterior.from_state_dict(state)
    assert type(loaded.likelihood.precision) is KroneckerPrecision
    assert torch.equal(loaded.mean, post.mean)
    other, other_reference = kronecker_and_dense_posteriors(seed=1)
    combined = combine([post, other])  # two Kronecker curvatures: stored densely
    assert type(combined.likelihood.precision) is FullPrecision
    assert_relative(combined.mean, combine([reference, other_reference]).mean)


def test_a_new_structure_is_checked_by_its_shape_rules_and_tensor_names():
    shift = torch.zeros(D, dtype=F64)
    square = torch.eye(C, dtype=F64)
    with pytest.raises(InvalidInputError, match=r"a kron term needs `delta`"):
        GaussianTerm("kron", shift, left=square, right=torch.eye(P, dtype=F64))
    with pytest.raises(InvalidInputError, match=r"`right` must have shape \(b, b\)"):
        GaussianTerm("kron", shift, left=square, right=torch.ones(P, 2, dtype=F64),
                     delta=torch.tensor(1.0, dtype=F64))
    with pytest.raises(InvalidInputError, match=r"dimension 9 cannot go with a shift of dim"):
        GaussianTerm("kron", shift, left=square, right=square, delta=torch.tensor(1.0, dtype=F64))
    with pytest.raises(InvalidInputError, match=r"must be one of.*'kron'"):
        GaussianTerm("kronecker", shift)
