"""The posterior protocol, the kind registry, safetensors save/load and the self-check."""

from __future__ import annotations

import pytest
import torch

from inference.ensemble import EnsemblePosterior
from inference.errors import InvalidInputError, NumericalError
from inference.gaussian import GaussianPosterior, GaussianTerm, gaussian_prior
from inference.posterior import Posterior, check, load_posterior, posterior_class, save_posterior
from tests.conftest import DEVICES

F64 = torch.float64


def head_posterior(structure: str = "full") -> GaussianPosterior:
    gen = torch.Generator().manual_seed(0)
    d = 2 * 4
    a = torch.randn(d, d, generator=gen, dtype=F64)
    shift = torch.randn(d, generator=gen, dtype=F64)
    lik = (GaussianTerm("full", shift, dense=a @ a.T) if structure == "full"
           else GaussianTerm("diag", shift, diag=(a**2).sum(1)))
    return GaussianPosterior(gaussian_prior((2, 4), 1.0), lik, (2, 4), n_data=5)


def ensemble_posterior() -> EnsemblePosterior:
    return EnsemblePosterior(torch.randn(30, 2, 4, dtype=F64,
                                         generator=torch.Generator().manual_seed(0)), n_data=5)


@pytest.mark.parametrize("make", [head_posterior, ensemble_posterior])
def test_posteriors_satisfy_the_protocol(make):
    post = make()
    assert isinstance(post, Posterior)
    draws = post.sample(6, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (6, *post.mean.shape)
    probs = post.predict_proba(torch.randn(5, 3, dtype=F64))
    assert probs.shape == (5, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=F64))


@pytest.mark.parametrize("make", [head_posterior, ensemble_posterior])
def test_save_and_load_round_trip_with_safetensors(tmp_path, make):
    post = make()
    path = tmp_path / "post.safetensors"
    save_posterior(post, path)
    loaded = load_posterior(path)
    assert type(loaded) is type(post)
    x = torch.randn(4, 3, dtype=F64)
    torch.testing.assert_close(loaded.predict_proba(x), post.predict_proba(x), atol=0, rtol=0)
    torch.testing.assert_close(loaded.mean, post.mean, atol=0, rtol=0)
    assert not (tmp_path / "post.safetensors.tmp").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_load_onto_a_device(tmp_path, device):
    save_posterior(head_posterior().to(device), tmp_path / "p.safetensors")
    assert load_posterior(tmp_path / "p.safetensors", device=device).mean.device.type == device


def test_unknown_kind_and_foreign_files_are_rejected(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown posterior kind"):
        posterior_class("no_such_kind")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(InvalidInputError, match="no `kind`"):
        load_posterior(tmp_path / "foreign.safetensors")


def test_registry_knows_the_builtin_kinds():
    assert posterior_class("gaussian") is GaussianPosterior
    assert posterior_class("ensemble") is EnsemblePosterior


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_check_passes_a_correct_posterior(structure):
    report = check(head_posterior(structure), inputs=torch.randn(5, 3, dtype=F64),
                   generator=torch.Generator().manual_seed(0))
    assert report["sample_variance_rel_error"] < 0.15
    assert report["max_row_sum_error"] < 1e-12


def test_check_catches_a_sampler_that_disagrees_with_the_covariance():
    class BrokenSampler(GaussianPosterior):  # draws with twice the standard deviation
        def sample(self, n, generator=None):
            return self.mean + 2 * (super().sample(n, generator) - self.mean)

    good = head_posterior()
    broken = BrokenSampler(good.prior, good.likelihood, good.shape)
    with pytest.raises(NumericalError, match="sampler and the covariance disagree"):
        check(broken, generator=torch.Generator().manual_seed(0))


def test_ensemble_rejects_probit_and_non_finite_samples():
    post = ensemble_posterior()
    with pytest.raises(InvalidInputError, match="'mc' or 'map'"):
        post.predict_proba(torch.randn(2, 3, dtype=F64), method="probit")
    with pytest.raises(InvalidInputError, match="NaN"):
        EnsemblePosterior(torch.full((2, 2, 4), float("nan")))


def test_a_conjugate_posterior_saves_and_loads_by_its_kind(tmp_path):
    from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics

    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(40) % 2
    post = ConjugatePosterior(ConjugatePrior(), SufficientStatistics.from_features(x, y, 2))
    save_posterior(post, tmp_path / "c.safetensors")
    loaded = load_posterior(tmp_path / "c.safetensors")
    assert type(loaded) is ConjugatePosterior
    torch.testing.assert_close(loaded.predict_proba(x), post.predict_proba(x))
