"""NetworkGaussian: a Gaussian over every parameter of a network, under the Posterior protocol
(mean, sample, predict_proba, to, state_dict / from_state_dict, posterior files)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from inference.errors import InvalidInputError
from inference.network_gaussian import NetworkGaussian, flatten, parameter_layout, unflatten
from inference.posterior import Posterior, check
from inference.posterior_file import load_posterior, save_posterior
from tests.devices import DEVICES

F64 = torch.float64


def network(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def posterior(dtype: torch.dtype = torch.float32, rank: int = 2, **options) -> NetworkGaussian:
    """A posterior around ``network(0)``'s values: (P = 43) mean, spread 0.1, a rank-2 factor."""
    net = network(0, dtype)
    mean = flatten(dict(net.named_parameters()), parameter_layout(net)).detach()
    gen = torch.Generator().manual_seed(1)
    variance = torch.rand(mean.shape, generator=gen, dtype=dtype) * 0.01
    factor = 0.05 * torch.randn(rank, mean.shape[0], generator=gen, dtype=dtype) if rank else None
    return NetworkGaussian(net, mean, variance, factor, input_shape=(4,), **options)


def inputs(n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(2), dtype=dtype)


def draws_of(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_it_is_a_posterior_and_passes_the_self_check():
    post = posterior()
    assert isinstance(post, Posterior)
    # the self-check compares the draws' variance with marginal_variance() (diagonal + the
    # factor's column sums of squares), on 4000 draws, within its Monte Carlo tolerance
    report = check(post, inputs(), generator=draws_of())
    assert report["max_row_sum_error"] < 1e-12  # float64 softmax averages
    torch.testing.assert_close(post.marginal_variance(),
                               post.variance + post.factor.square().sum(0))


def test_flatten_and_unflatten_are_inverse_in_registration_order():
    net = network()
    layout = parameter_layout(net)
    assert [name for name, _ in layout] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    flat = flatten(dict(net.named_parameters()), layout)
    assert flat.shape == (43,)  # 4 * 5 + 5 + 5 * 3 + 3
    back = unflatten(torch.stack([flat, 2 * flat]), layout)
    for name, p in net.named_parameters():
        assert torch.equal(back[name][0], p) and torch.equal(back[name][1], 2 * p)


def test_the_map_predictive_is_the_network_at_the_mean():
    post = posterior()
    x = inputs()
    want = torch.softmax(network(0)(x).double(), -1)  # the mean is network(0)'s values
    assert torch.equal(post.predict_proba(x, method="map"), want)


@pytest.mark.parametrize("method", ["mc", "map"])
def test_from_state_dict_predicts_exactly_what_the_posterior_predicts(method):
    post = posterior(method=method, n_samples=5)
    # a network of the same architecture with other values: only its architecture is used
    back = NetworkGaussian.from_state_dict(post.state_dict(), model=network(seed=9))
    assert (back.method, back.n_samples, back.input_shape) == (method, 5, (4,))
    assert torch.equal(back.mean, post.mean) and torch.equal(back.factor, post.factor)
    x = inputs()
    assert torch.equal(back.predict_proba(x, generator=draws_of()),
                       post.predict_proba(x, generator=draws_of()))
    assert torch.equal(back.sample(3, draws_of()), post.sample(3, draws_of()))


def test_a_mean_field_posterior_has_no_factor_in_its_state():
    post = posterior(rank=0)
    assert "factor" not in post.state_dict()
    back = NetworkGaussian.from_state_dict(post.state_dict(), model=network())
    assert back.factor is None
    assert torch.equal(back.predict_proba(inputs(), generator=draws_of()),
                       post.predict_proba(inputs(), generator=draws_of()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_to_keeps_the_dtype_and_the_predictions(device, dtype):
    post = posterior(dtype)
    moved = post.to(device)
    assert moved.mean.dtype == dtype and moved.mean.device.type == device
    assert next(moved.model.parameters()).dtype == dtype
    assert post.mean.device.type == "cpu"  # a copy: the original is not moved
    x = inputs(dtype=dtype)
    # the draws are made on the CPU generator's device whatever the posterior's: the same draws
    got = moved.predict_proba(x.to(device), generator=draws_of()).cpu()
    want = post.predict_proba(x, generator=draws_of())
    if device == "cpu":
        assert torch.equal(got, want)
    else:  # another device's kernels round differently; float32 networks agree to ~1e-6
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_posterior_file_round_trip_binds_the_network_back(tmp_path):
    post = posterior()
    save_posterior(post, tmp_path / "net.safetensors")
    loaded = load_posterior(tmp_path / "net.safetensors")
    assert isinstance(loaded, NetworkGaussian) and torch.equal(loaded.mean, post.mean)
    assert loaded.sample(2, draws_of()).shape == (2, 43)
    with pytest.raises(InvalidInputError, match=r"holds no network.*bind\(model\)"):
        loaded.predict_proba(inputs())
    bound = loaded.bind(network(seed=5))
    assert torch.equal(bound.predict_proba(inputs(), generator=draws_of()),
                       post.predict_proba(inputs(), generator=draws_of()))


def test_inputs_are_converted_to_the_network_dtype_and_checked():
    post = posterior()
    x = inputs()
    want = post.predict_proba(x, method="map")
    assert torch.equal(post.predict_proba(x.double().numpy(), method="map"), want)
    assert torch.equal(post.predict_proba(x.tolist(), method="map"), want)
    with pytest.raises(InvalidInputError, match=r"shape \(6, 3\) but the network takes \(B, 4\)"):
        post.predict_proba(np.zeros((6, 3)))
    with pytest.raises(InvalidInputError, match="NaN or infinite"):
        post.predict_proba(np.full((2, 4), np.nan))


def test_a_given_input_boundary_replaces_the_default():
    class ClientInputError(ValueError):
        pass

    def refuse(value, *, input_shape, dtype, device, name):
        raise ClientInputError(f"{name}: shaped {input_shape}, {dtype}")

    post = posterior(prepare=refuse)
    with pytest.raises(ClientInputError, match=r"inputs: shaped \(4,\), torch.float32"):
        post.predict_proba(inputs())
    assert post.to("cpu").prepare is refuse  # kept by to() and passed to from_state_dict
    assert NetworkGaussian.from_state_dict(post.state_dict(), network(),
                                           prepare=refuse).prepare is refuse


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: {**a, "variance": -a["variance"]}, "finite and non-negative"),
    (lambda a: {**a, "variance": a["variance"][:-1]}, r"mean and variance must be \(P,\)"),
    (lambda a: {**a, "factor": a["factor"][:, :-1]}, r"factor must be \(r, 43\)"),
    (lambda a: {**a, "method": "probit"}, "method must be one of"),
    (lambda a: {**a, "model": nn.Linear(4, 3)}, "the network has 15 parameters but the posterior"
                                                " is over 43"),
])
def test_inconsistent_arguments_are_refused(change, message):
    post = posterior()
    args = {"model": post.model, "mean": post.mean, "variance": post.variance,
            "factor": post.factor, "method": "mc"}
    with pytest.raises(InvalidInputError, match=message):
        NetworkGaussian(**change(args))


def test_a_state_that_is_not_a_network_gaussian_is_refused():
    state = posterior().state_dict()
    with pytest.raises(InvalidInputError, match=r"lacks \['n_samples'\]"):
        NetworkGaussian.from_state_dict({k: v for k, v in state.items() if k != "n_samples"})
    with pytest.raises(InvalidInputError, match=r"'method' must index"):
        NetworkGaussian.from_state_dict({**state, "method": torch.tensor(7)})
    with pytest.raises(InvalidInputError, match=r"'method' must be an integer scalar"):
        NetworkGaussian.from_state_dict({**state, "method": torch.tensor(0.0)})
