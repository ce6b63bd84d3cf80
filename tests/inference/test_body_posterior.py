"""BodyPosterior: a head posterior behind a network body, under the Posterior protocol
(mean, sample, predict_proba of inputs, to, state_dict / from_state_dict)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from inference.body_posterior import BodyPosterior
from inference.ensemble import EnsemblePosterior
from inference.errors import InvalidInputError
from inference.posterior import Posterior, check
from inference.posterior_file import save_posterior
from tests.devices import DEVICES

F64 = torch.float64


def body(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """(B, 6) -> (B, 4) features, with a buffer (batch norm's running statistics)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Tanh()).to(dtype)
    net.train()(torch.randn(32, 6, dtype=dtype))  # running statistics away from their init
    return net


def head() -> EnsemblePosterior:
    """20 draws of a 3-class head on 4 features (+ bias)."""
    return EnsemblePosterior(torch.randn(20, 3, 5, generator=torch.Generator().manual_seed(1),
                                         dtype=F64))


def posterior(dtype: torch.dtype = torch.float32, **options) -> BodyPosterior:
    return BodyPosterior(body(0, dtype), head(), "mc", input_shape=(6,), **options)


def inputs(n: int = 7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(2), dtype=dtype)


def test_it_is_a_posterior_over_the_head_that_predicts_from_inputs():
    post = posterior()
    assert isinstance(post, Posterior)
    report = check(post, inputs(), generator=torch.Generator().manual_seed(0))
    assert report["max_row_sum_error"] < 1e-12  # float64 averages of softmax rows
    assert torch.equal(post.mean, post.head.mean)
    x = inputs()
    features = post.body(x).double()
    assert torch.equal(post.features(x), features)
    assert torch.equal(post.predict_proba(x), post.head.predict_proba(features, method="mc"))
    assert torch.equal(post.predict_proba(x, method="map"),
                       post.head.predict_proba(features, method="map"))


@pytest.mark.parametrize("head_given", [EnsemblePosterior, "ensemble"])
def test_from_state_dict_predicts_exactly_what_the_posterior_predicts(head_given):
    post = posterior()
    given = body(seed=7)  # the architecture; its own values are replaced by the state's
    back = BodyPosterior.from_state_dict(post.state_dict(), body=given, head=head_given,
                                         method="mc")
    x = inputs()
    assert torch.equal(back.predict_proba(x), post.predict_proba(x))
    assert torch.equal(back.predict_proba(x, method="map"), post.predict_proba(x, method="map"))
    assert back.input_shape == (6,)
    # the given module is copied, not loaded in place
    assert not torch.equal(given[0].weight, post.body[0].weight)


def test_the_state_holds_the_head_the_body_and_the_input_shape():
    post = posterior()
    state = post.state_dict()
    assert set(state) == {"head.samples", "head.n_data", "body.0.weight", "body.0.bias",
                          "body.1.weight", "body.1.bias", "body.1.running_mean",
                          "body.1.running_var", "body.1.num_batches_tracked", "input_shape"}
    assert state["input_shape"].tolist() == [6]
    assert all(isinstance(v, torch.Tensor) for v in state.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_to_keeps_the_dtype_and_the_predictions(device, dtype):
    post = posterior(dtype)
    moved = post.to(device)
    assert next(moved.body.parameters()).dtype == dtype
    assert next(moved.body.parameters()).device.type == device
    assert next(post.body.parameters()).device.type == "cpu"  # a copy
    x = inputs(dtype=dtype)
    got = moved.predict_proba(x.to(device)).cpu()
    if device == "cpu":
        assert torch.equal(got, post.predict_proba(x))
    else:  # another device's kernels round differently
        torch.testing.assert_close(got, post.predict_proba(x), rtol=0, atol=1e-5)


def test_inputs_are_converted_to_the_body_dtype_and_checked():
    post = posterior()
    x = inputs()
    want = post.predict_proba(x)
    assert torch.equal(post.predict_proba(x.double().numpy()), want)
    assert torch.equal(post.predict_proba(x.tolist()), want)
    with pytest.raises(InvalidInputError, match=r"shape \(7, 5\) but the network takes \(B, 6\)"):
        post.predict_proba(np.zeros((7, 5)))


def test_a_body_that_refuses_an_unchecked_shape_raises_the_given_error():
    class ClientDataError(ValueError):
        pass

    post = BodyPosterior(body(), head(), "mc")  # no input shape: the body decides
    with pytest.raises(InvalidInputError, match=r"body cannot take inputs of shape \(7, 5\)"):
        post.predict_proba(np.zeros((7, 5)))
    post = BodyPosterior(body(), head(), "mc", input_error=ClientDataError)
    with pytest.raises(ClientDataError, match=r"body cannot take inputs of shape \(7, 5\)"):
        post.to("cpu").predict_proba(np.zeros((7, 5)))  # kept by to()


def test_defaults_apply_to_the_default_method_only():
    calls = []

    class Head(EnsemblePosterior):
        def predict_proba(self, inputs, method="mc", **options):
            calls.append((method, options))
            return super().predict_proba(inputs, method)

    post = BodyPosterior(body(), Head(head().samples), "mc", n_samples=4)
    post.predict_proba(inputs())
    post.predict_proba(inputs(), method="map")
    assert calls == [("mc", {"n_samples": 4}), ("map", {})]


def test_it_is_not_saved_as_a_file_its_head_is(tmp_path):
    # a file cannot rebuild a network: save_posterior refuses and names the head
    with pytest.raises(InvalidInputError, match=r"kind 'body'.*post\.head"):
        save_posterior(posterior(), tmp_path / "p")
    save_posterior(posterior().head, tmp_path / "head")


def test_a_state_that_does_not_fit_is_refused():
    state = posterior().state_dict()
    with pytest.raises(InvalidInputError, match=r"no head\.\* tensors"):
        BodyPosterior.from_state_dict({k: v for k, v in state.items()
                                       if not k.startswith("head.")},
                                      body=body(), head=EnsemblePosterior, method="mc")
    with pytest.raises(InvalidInputError, match=r"body\.\* tensors do not fit"):
        BodyPosterior.from_state_dict(state, body=nn.Sequential(nn.Linear(6, 5)),
                                      head=EnsemblePosterior, method="mc")
