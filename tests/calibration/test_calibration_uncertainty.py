"""Uncertainty scores and the entropy split of posterior draws against direct numpy formulas."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration import (
    InvalidInputError,
    entropy_decomposition,
    max_probability,
    ood_scores,
    predictive_entropy,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ORACLE_TOL = 1e-12


def numpy_entropy(p):
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)


def random_draws(rng, s, n, c, concentration, zeros):
    draws = rng.dirichlet(np.ones(c) * concentration, size=(s, n))
    if zeros:  # exact zeros (e.g. saturated softmax in float32), rows renormalised
        draws[draws < 0.05] = 0.0
        draws[..., 0] += draws.sum(-1) == 0
        draws /= draws.sum(-1, keepdims=True)
    return draws


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), s=st.integers(1, 12), n=st.integers(1, 40),
       c=st.integers(2, 8), concentration=st.sampled_from([0.05, 0.5, 1.0, 50.0]),
       zeros=st.booleans())
def test_entropy_split_equals_numpy_and_adds_up(seed, s, n, c, concentration, zeros):
    rng = np.random.default_rng(seed)
    draws = random_draws(rng, s, n, c, concentration, zeros)
    total, aleatoric, epistemic = entropy_decomposition(draws)
    mean = draws.mean(0)
    np.testing.assert_allclose(total.numpy(), numpy_entropy(mean), rtol=0, atol=ORACLE_TOL)
    np.testing.assert_allclose(aleatoric.numpy(), numpy_entropy(draws).mean(0), rtol=0,
                               atol=ORACLE_TOL)
    np.testing.assert_allclose(epistemic.numpy(),
                               numpy_entropy(mean) - numpy_entropy(draws).mean(0), rtol=0,
                               atol=ORACLE_TOL)
    np.testing.assert_allclose((aleatoric + epistemic).numpy(), total.numpy(), rtol=0,
                               atol=ORACLE_TOL)
    assert bool((epistemic >= 0).all())
    assert total.dtype == aleatoric.dtype == epistemic.dtype == torch.float64
    assert total.shape == (n,)


def test_identical_draws_have_no_epistemic_part():
    rng = np.random.default_rng(0)
    row = rng.dirichlet(np.ones(10), size=50)
    draws = np.repeat(row[None], 7, axis=0)
    total, aleatoric, epistemic = entropy_decomposition(draws)
    # 0 up to the rounding of the mean over draws; values rounded below zero are clamped
    assert bool((epistemic >= 0).all()) and float(epistemic.max()) < 1e-15
    np.testing.assert_allclose(total.numpy(), aleatoric.numpy(), rtol=0, atol=ORACLE_TOL)
    _, _, single = entropy_decomposition(row[None])
    assert bool((single == 0).all())


def test_disagreeing_one_hot_draws_are_all_epistemic():
    draws = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # (S=2, N=1, C=2)
    total, aleatoric, epistemic = entropy_decomposition(draws)
    assert aleatoric.item() == 0.0
    assert total.item() == pytest.approx(np.log(2), abs=ORACLE_TOL)
    assert epistemic.item() == pytest.approx(np.log(2), abs=ORACLE_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scores_of_each_kind(device, dtype):
    rng = np.random.default_rng(2)
    draws = torch.tensor(rng.dirichlet(np.ones(5), size=(4, 30)), dtype=dtype, device=device)
    mean = draws.double().mean(0)
    total, aleatoric, epistemic = entropy_decomposition(draws)
    assert total.device.type == device
    torch.testing.assert_close(ood_scores(draws, "entropy"), total, rtol=0, atol=1e-12)
    torch.testing.assert_close(ood_scores(draws, "mutual_information"), epistemic)
    torch.testing.assert_close(ood_scores(draws, "expected_entropy"), aleatoric)
    torch.testing.assert_close(ood_scores(draws, "max_prob"), -mean.amax(1))
    probs = draws[0]
    expected = numpy_entropy(probs.double().cpu().numpy())
    np.testing.assert_allclose(ood_scores(probs).cpu().numpy(), expected, rtol=0,
                               atol=ORACLE_TOL)
    np.testing.assert_allclose(predictive_entropy(probs).cpu().numpy(), expected, rtol=0,
                               atol=ORACLE_TOL)
    torch.testing.assert_close(ood_scores(probs, "max_prob"), -max_probability(probs))
    assert bool((max_probability(probs) == probs.double().amax(1)).all())


@pytest.mark.parametrize("probs, kwargs, match", [
    (np.zeros((0, 3)), {}, "empty"),
    (np.full((2, 3), 0.5), {}, "sum to 1"),
    (np.array([[0.5, np.nan], [0.5, 0.5]]), {}, "NaN or Inf"),
    (np.array([[1.5, -0.5], [0.5, 0.5]]), {}, "negative"),
    (np.ones((2, 1)), {}, "C >= 2"),
    (np.full(4, 0.25), {}, "shape"),
    (np.full((2, 2), 0.5), {"kind": "mutual_information"}, "posterior draws"),
    (np.full((2, 2), 0.5), {"kind": "variance"}, "kind must be one of"),
    (np.array([["a", "b"]]), {}, "text"),
])
def test_invalid_inputs_say_what_to_do(probs, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        ood_scores(probs, **kwargs)


def test_invalid_draws():
    with pytest.raises(InvalidInputError, match=r"\(S, N, C\)"):
        entropy_decomposition(np.full((3, 2), 0.5))
    draws = np.full((2, 3, 2), 0.5)
    draws[1, 2] = [0.7, 0.7]
    with pytest.raises(InvalidInputError, match=r"row \(1, 2\).*sums to 1.4"):
        entropy_decomposition(draws)


def test_mutual_information_stays_finite_when_the_mean_of_subnormal_draws_underflows():
    # one draw gives a class 1e-323 (subnormal), the others 0: the mean over 32 draws underflows
    # to 0, and log(p / mean) must not become inf (p_sc / S <= mean bounds it by log S)
    draws = torch.zeros(32, 1, 3, dtype=torch.float64)
    draws[:, 0, 0] = 1.0
    draws[0, 0, 1] = 1e-323
    assert draws.mean(0)[0, 1] == 0.0
    score = ood_scores(draws, kind="mutual_information")
    assert torch.isfinite(score).all() and 0.0 <= float(score[0]) < 1e-300
