"""The README's promise on dtypes (issue 26 asked whether it holds): ``fit_head``'s posteriors
return probabilities in the dtype of the features given to ``predict_proba``, float32 or
float64, whatever the dtype they were fitted in."""

import pytest
import torch

from inference import fit_head


@pytest.mark.parametrize("kind", ["laplace", "conjugate",
                                  # sampling fits take tens of seconds on 2 cores
                                  pytest.param("mfvi", marks=pytest.mark.slow),
                                  pytest.param("sgld", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fit_dtype", [torch.float32, torch.float64])
def test_probabilities_come_back_in_the_features_dtype(kind, fit_dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=generator, dtype=fit_dtype)
    y = torch.randint(0, 3, (120,), generator=generator)
    posterior = fit_head(kind, x, y, 3)
    for dtype in (torch.float32, torch.float64):
        probs = posterior.predict_proba(x[:5].to(dtype))
        assert probs.dtype == dtype, (kind, fit_dtype, dtype)
        assert probs.shape == (5, 3)
    numpy_probs = posterior.predict_proba(x[:5].to(torch.float32).numpy())
    assert numpy_probs.dtype == torch.float32
