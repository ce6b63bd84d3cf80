"""fit_head: one string swaps the inference method; every kind returns a Posterior."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.errors import InvalidInputError
from inference.factory import fit_head
from inference.options import HeadKind
from inference.posterior import Posterior
from tests.inference.ground_truth import single_intra_op_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

FAST_OPTIONS = {
    "conjugate": {},
    "laplace": {"prior_precision": 1.0},
    "mfvi": {"num_steps": 30},
    "sgld": {"num_samples": 10, "burn_in": 10, "thinning": 1},
}


def blobs(n: int = 90, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0.0], [-2.0, 1.0], [0.0, -2.0]])
    return centres[labels] + 0.5 * torch.randn(n, 2, generator=gen), labels


@pytest.mark.parametrize("kind", list(FAST_OPTIONS))
def test_every_feature_head_kind_fits_and_predicts(kind):
    x, y = blobs()
    post = fit_head(kind, x, y, 3, **FAST_OPTIONS[kind])
    assert isinstance(post, Posterior)
    probs = post.predict_proba(x)
    assert probs.shape == (90, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(90))
    assert (probs.argmax(-1) == y).float().mean() > 0.9  # separable blobs
    assert post.sample(4).shape == (4, 3, 3)


def test_kind_accepts_the_enum_and_any_case_and_num_classes_by_keyword():
    x, y = blobs()
    a = fit_head(HeadKind.LAPLACE, x, y, 3)
    b = fit_head("LAPLACE", x, y, num_classes=3)
    torch.testing.assert_close(a.mean, b.mean, atol=0, rtol=0)


def test_unknown_kind_lists_the_choices():
    x, y = blobs()
    with pytest.raises(InvalidInputError, match="'conjugate', 'laplace', 'subnet_laplace'"):
        fit_head("kron", x, y, 3)


def test_wrong_positional_arguments_name_the_calling_convention():
    x, y = blobs()
    with pytest.raises(InvalidInputError, match=r"\(features, labels, num_classes"):
        fit_head("mfvi", x, y)
    with pytest.raises(InvalidInputError, match=r"\(model, loader"):
        fit_head("subnet_laplace", x, y, 3)


def test_unknown_options_are_refused_by_the_fitting_function():
    x, y = blobs()
    with pytest.raises(TypeError):
        fit_head("laplace", x, y, 3, num_stepz=3)


def test_conjugate_kind_delegates_to_the_fedlog_head():
    from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics

    x, y = blobs()
    stats = SufficientStatistics.from_features(x, y, 3)
    post = fit_head("conjugate", x, y, 3, nu=2.0, feature_scale=1.0)
    torch.testing.assert_close(post.mean, ConjugatePosterior(ConjugatePrior(nu=2.0), stats).mean)
    chosen = fit_head("conjugate", x, y, 3, nu=2.0)  # default: the scale chosen by likelihood
    scale = chosen.feature_scale_selection.value
    reference = ConjugatePosterior(ConjugatePrior(nu=2.0), stats, feature_scale=scale)
    torch.testing.assert_close(chosen.mean, reference.mean, rtol=0, atol=0)


def test_subnet_laplace_kind_takes_a_model_and_a_loader():
    x, y = blobs()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3))
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(100):
        optimiser.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=30)
    post = fit_head("subnet_laplace", model, loader, subnet_size=10, prior_precision=1.0)
    assert isinstance(post, Posterior) and post.kind == "subnet_laplace"
    probs = post.predict_proba(x)
    assert probs.shape == (90, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(90), atol=1e-5, rtol=0)


def test_fit_head_runs_with_its_thread_count_and_restores_the_callers(monkeypatch):
    import inference.factory

    seen = []
    real = inference.factory.fitting_function

    def spy(kind):
        fit = real(kind)

        def recording(*args, **options):
            seen.append(torch.get_num_threads())
            return fit(*args, **options)
        return recording

    monkeypatch.setattr(inference.factory, "fitting_function", spy)
    phi = torch.randn(30, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(30) % 3
    before = torch.get_num_threads()
    fit_head("laplace", phi, y, 3, prior_precision=1.0, threads=1)
    monkeypatch.setattr("inference.threads.available_cores", lambda: 2)
    fit_head("laplace", phi, y, 3, prior_precision=1.0)  # default: half of 2 cores
    assert seen == [1, 1] and torch.get_num_threads() == before
    for bad in (0, 2.0, "2", True):
        with pytest.raises(InvalidInputError, match="threads must be"):
            fit_head("laplace", phi, y, 3, threads=bad)
