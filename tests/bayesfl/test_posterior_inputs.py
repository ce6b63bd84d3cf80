"""What a user hands a trained run: SimulationResult.predict_proba / posterior and
ClientPosterior take tensors, NumPy arrays and lists of any real dtype, and a bad client id or
batch is a ConfigError / DataError that says what to pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inference
from bayesfl.errors import BayesFLError, ConfigError, DataError
from bayesfl.simulate import simulate

# 6 clients of a 4-class Gaussian mixture in 10 dimensions, one round (as tests/bayesfl/
# test_simulate.py's SMALL)
SMALL = dict(
    dataset="gaussian_mixture", clients=6, partition="shards:2", rounds=1, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    dataset_options={"num_classes": 4, "dim": 10, "n": 480, "separation": 4.0},
)


@pytest.fixture(scope="module")
def result():
    return simulate("fedlog", **SMALL)


@pytest.fixture(scope="module")
def x(result):
    """Client 2's test inputs, float32 (10 features)."""
    return result.clients[2].data.test_x


def test_numpy_lists_and_float64_inputs_predict_what_the_float32_tensor_predicts(result, x):
    want = result.predict_proba(2, x)
    assert want.shape == (x.shape[0], 4) and want.dtype == torch.float64
    # float32 values are exact in float64 and come back exactly: the same numbers
    for given in (x.numpy(), x.double(), x.double().numpy(), x.tolist(), x.numpy().astype(">f4")):
        assert torch.equal(result.predict_proba(2, given), want)
    assert torch.equal(result.predict_proba(np.int64(2), x), want)


@pytest.mark.parametrize("client_id", [-1, 6, 2.0, True, "0", None, np.float64(1)])
def test_a_client_id_that_is_not_an_integer_in_range_is_a_config_error(result, x, client_id):
    with pytest.raises(ConfigError, match=r"client_id must be an integer in \[0, 6\)"):
        result.predict_proba(client_id, x)
    with pytest.raises(ConfigError, match="client_id"):
        result.posterior(client_id)


@pytest.mark.parametrize(("inputs", "message"), [
    (np.zeros((3, 9), dtype=np.float32), r"shape \(3, 9\) but this client's inputs have shape "
                                         r"\(B, 10\)"),
    (np.zeros(10), r"the shape of one input \(10,\); pass a batch \(B, 10\), e.g. x\[None\]"),
    (np.zeros((0, 10)), "non-empty batch"),
    (np.zeros((3, 10, 1)), r"shape \(3, 10, 1\)"),
    (np.full((3, 10), np.nan), "30 of the 30 values in (x|inputs) are NaN or infinite"),
    (np.full((3, 10), 1e300), r"beyond ±3.4e\+38, which overflow the client's torch.float32"),
    (np.array([["a"] * 10]), "strings"),
    (np.ones((3, 10), dtype=complex), "complex"),
    (np.ones((3, 10), dtype=bool), "booleans"),
    ([[1.0] * 10, [1.0] * 9], "not an array of numbers"),
    ("inputs.npy", "got a str"),
])
def test_bad_inputs_are_data_errors(result, inputs, message):
    with pytest.raises(DataError, match=message):
        result.predict_proba(2, inputs)
    posterior = result.posterior(2)
    with pytest.raises(DataError, match=message.replace(r"x\[None\]", r"inputs\[None\]")):
        posterior.predict_proba(inputs)


def test_the_posterior_takes_numpy_and_float64_inputs(result, x):
    posterior = result.posterior(np.int32(2))
    want = posterior.predict_proba(x, method="map")
    torch.testing.assert_close(want, result.strategy.predict(
        result.clients[2].config, result.client_state(2), result.evaluation_broadcast,
        x)["map_plugin"], rtol=0, atol=1e-12)
    assert torch.equal(posterior.predict_proba(x.double().numpy(), method="map"), want)
    assert torch.equal(posterior.to("cpu").predict_proba(x.numpy(), method="map"), want)


def test_a_client_posterior_without_an_input_shape_reports_what_the_body_refuses(result, x):
    posterior = result.posterior(2)
    posterior.input_shape = None  # as a strategy may build it: the body decides
    with pytest.raises(DataError, match=r"body cannot take inputs of shape \(3, 9\)"):
        posterior.predict_proba(np.zeros((3, 9)))
    assert posterior.predict_proba(x.numpy(), method="map").shape == (x.shape[0], 4)


def test_a_client_posterior_is_saved_through_its_head(result, x, tmp_path):
    posterior = result.posterior(2)
    with pytest.raises(inference.InvalidInputError, match=r"post\.head"):
        inference.save_posterior(posterior, tmp_path / "client.safetensors")
    inference.save_posterior(posterior.head, tmp_path / "head.safetensors")
    head = inference.load_posterior(tmp_path / "head.safetensors")
    features = posterior.features(x)
    assert torch.equal(head.predict_proba(features, method="map"),
                       posterior.head.predict_proba(features, method="map"))


def test_every_error_here_is_a_bayesfl_error(result):
    with pytest.raises(BayesFLError):
        result.predict_proba(2, np.zeros((3, 9)))
    with pytest.raises(BayesFLError):
        result.predict_proba(99, np.zeros((3, 10)))


def test_a_client_posterior_is_an_inference_body_posterior_that_round_trips(result, x):
    import bayesfl

    posterior = result.posterior(2)
    assert bayesfl.ClientPosterior is inference.BodyPosterior
    assert isinstance(posterior, inference.BodyPosterior)
    assert isinstance(posterior, inference.Posterior)
    # the state holds the head's and the body's tensors; the body's architecture and the head's
    # kind come back as arguments (a fresh network: its own values are replaced)
    back = inference.BodyPosterior.from_state_dict(
        posterior.state_dict(), body=result.strategy.template(result.clients[2].config.body),
        head=type(posterior.head), method=posterior.method, **posterior.defaults)
    assert torch.equal(back.predict_proba(x, method="map"),
                       posterior.predict_proba(x, method="map"))
    # the strategy's predictive ("mc" with its n_samples) from the same seeded draws
    assert torch.equal(back.predict_proba(x, generator=torch.Generator().manual_seed(1)),
                       posterior.predict_proba(x, generator=torch.Generator().manual_seed(1)))
    inference.check(posterior, x, generator=torch.Generator().manual_seed(0))
