"""The posterior protocol, the kind registry, safetensors save/load and the self-check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.ensemble import EnsemblePosterior
from inference.errors import InvalidInputError, NumericalError, PosteriorFileError
from inference.gaussian import GaussianPosterior, GaussianTerm, gaussian_prior
from inference.posterior import Posterior, check, posterior_class
from inference.posterior_file import load_posterior, save_posterior
from tests.devices import DEVICES

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


def conjugate_posterior():
    from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics

    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(40) % 2
    return ConjugatePosterior(ConjugatePrior(), SufficientStatistics.from_features(x, y, 2))


def subnet_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()  # P = 26


def subnet_posterior():
    from inference.subnet import SubnetLaplacePosterior, flat_trainable_parameters

    model = subnet_model()
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(5, 5, generator=gen, dtype=F64)
    return SubnetLaplacePosterior(flat_trainable_parameters(model).detach(),
                                  torch.tensor([0, 4, 9, 17, 25]), a @ a.T,
                                  torch.full((5,), 2.0, dtype=F64), model=model, n_data=7)


def lowrank_posterior() -> GaussianPosterior:  # includes a (d, 0) factor and an empty term
    return GaussianPosterior(gaussian_prior((2, 4), 1.0), GaussianTerm.zeros(8, "lowrank"),
                             (2, 4))


MAKERS = {
    "gaussian_full": head_posterior,
    "gaussian_diag": lambda: head_posterior("diag"),
    "gaussian_lowrank": lowrank_posterior,
    "ensemble": ensemble_posterior,
    "conjugate": conjugate_posterior,
    "subnet_laplace": subnet_posterior,
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_posteriors_satisfy_the_protocol(name):
    post = MAKERS[name]()
    assert isinstance(post, Posterior) and isinstance(post.kind, str)
    draws = post.sample(6, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (6, *post.mean.shape)
    probs = post.predict_proba(torch.randn(5, 3, dtype=F64))
    assert probs.shape == (5, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=F64))
    assert post.to("cpu").mean.device.type == "cpu"
    with pytest.raises(InvalidInputError, match="positive int"):
        post.sample(0)


@pytest.mark.parametrize("name", list(MAKERS))
def test_save_and_load_round_trip_with_safetensors(tmp_path, name):
    post = MAKERS[name]()
    path = tmp_path / "post.safetensors"
    save_posterior(post, path)
    loaded = load_posterior(path)
    assert type(loaded) is type(post) and loaded.kind == post.kind
    state, loaded_state = post.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for key, value in state.items():  # bit-exact, dtypes included
        assert torch.equal(loaded_state[key], value) and loaded_state[key].dtype == value.dtype
    if name == "subnet_laplace":  # a saved file holds tensors only: bind the network again
        loaded = loaded.bind(subnet_model())
    x = torch.randn(4, 3, dtype=F64)
    torch.testing.assert_close(loaded.predict_proba(x), post.predict_proba(x), atol=0, rtol=0)
    torch.testing.assert_close(loaded.mean, post.mean, atol=0, rtol=0)
    torch.testing.assert_close(loaded.sample(3, generator=torch.Generator().manual_seed(2)),
                               post.sample(3, generator=torch.Generator().manual_seed(2)),
                               atol=0, rtol=0)
    assert not (tmp_path / "post.safetensors.tmp").exists()


def test_save_writes_tensors_that_share_memory(tmp_path):
    prior = gaussian_prior((2, 4), 1.0)
    post = GaussianPosterior(prior, prior, (2, 4))  # prior.* and likelihood.* are one storage
    save_posterior(post, tmp_path / "shared.safetensors")
    loaded = load_posterior(tmp_path / "shared.safetensors")
    torch.testing.assert_close(loaded.natural.diag, torch.full((8,), 2.0, dtype=F64))


@pytest.mark.parametrize("device", DEVICES)
def test_load_onto_a_device(tmp_path, device):
    save_posterior(head_posterior().to(device), tmp_path / "p.safetensors")
    assert load_posterior(tmp_path / "p.safetensors", device=device).mean.device.type == device


def test_unknown_kind_and_foreign_files_are_rejected(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown posterior kind"):
        posterior_class("no_such_kind")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(PosteriorFileError, match="no `kind`"):
        load_posterior(tmp_path / "foreign.safetensors")


def test_registry_knows_the_builtin_kinds():
    from inference.conjugate import ConjugatePosterior
    from inference.subnet import SubnetLaplacePosterior

    assert posterior_class("gaussian") is GaussianPosterior
    assert posterior_class("ensemble") is EnsemblePosterior
    assert posterior_class("conjugate") is ConjugatePosterior
    assert posterior_class("subnet_laplace") is SubnetLaplacePosterior


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
