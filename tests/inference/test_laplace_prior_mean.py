"""A Laplace head's prior centred on a given head (a tensor ``prior_mean``), as a federated
client uses it with its federation's global head (bayesfl's ``head=laplace``)."""

from __future__ import annotations

import pytest
import torch

import inference
from inference.errors import InvalidInputError
from inference.laplace_head import fit_laplace_head

F64 = torch.float64


def data(n: int = 90, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=F64)
    y = torch.randint(3, (n,), generator=gen)
    return x, y


@pytest.mark.parametrize("approximation", ["laplace", "variational"])
def test_a_constant_tensor_prior_mean_is_the_same_prior_as_the_number(approximation):
    x, y = data()
    number = fit_laplace_head(x, y, 3, prior_mean=0.3, approximation=approximation)
    tensor = fit_laplace_head(x, y, 3, prior_mean=torch.full((3, 5), 0.3, dtype=F64),
                              approximation=approximation)
    assert tensor.prior_selection.value == pytest.approx(number.prior_selection.value,
                                                         rel=1e-9)
    torch.testing.assert_close(tensor.mean, number.mean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(tensor.natural.precision_matrix(),
                               number.natural.precision_matrix(), rtol=1e-9, atol=1e-10)


def test_the_posterior_is_centred_on_the_prior_head_under_a_strong_prior():
    x, y = data()
    centre = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=F64) * 2
    strong = fit_laplace_head(x, y, 3, prior_mean=centre, prior_precision=1e6)
    assert (strong.mean - centre).abs().max() < 1e-3
    # the prior term is N(centre, I / λ): its shift is λ centre
    torch.testing.assert_close(strong.prior.shift, 1e6 * centre.reshape(-1))


def test_the_evidence_prefers_a_prior_centred_where_the_data_point():
    """A prior centred on the head the labels were drawn from earns more evidence (a larger
    chosen λ) than one centred at zero."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(200, 4, generator=gen, dtype=F64)
    truth = torch.randn(3, 5, generator=gen, dtype=F64) * 2
    logits = torch.cat([torch.ones(200, 1, dtype=F64), x], 1) @ truth.T
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
    centred = fit_laplace_head(x, y, 3, prior_mean=truth, approximation="laplace")
    zero = fit_laplace_head(x, y, 3, approximation="laplace")
    assert centred.prior_selection.value > 10 * zero.prior_selection.value


def test_fit_head_passes_a_tensor_prior_mean_through_its_option_check():
    x, y = data()
    centre = torch.full((3, 5), -0.2, dtype=F64)
    via_factory = inference.fit_head("laplace", x, y, 3, prior_mean=centre, threads=1)
    direct = fit_laplace_head(x, y, 3, prior_mean=centre)
    torch.testing.assert_close(via_factory.mean, direct.mean, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.zeros(3, 4), torch.zeros(16), torch.zeros(3, 5,
                                                                               dtype=torch.int64),
                                 torch.full((3, 5), float("nan"))])
def test_a_tensor_prior_mean_of_the_wrong_size_or_not_finite_is_refused(bad):
    x, y = data()
    with pytest.raises(InvalidInputError, match="prior_mean"):
        fit_laplace_head(x, y, 3, prior_mean=bad, prior_precision=1.0)
