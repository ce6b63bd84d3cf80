"""Bodies: each spec builds and maps (B, *input_shape) to non-negative (B, feature_dim)."""

import pytest
import torch
from torch import nn

from bayesfl.bodies import BODY_KINDS, build_body, check_feature_dim, parse_body_spec
from bayesfl.errors import ConfigError
from tests.devices import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("spec", "input_shape"), [
    ("mlp", (64,)),
    ("mlp:200-200", (64,)),
    ("mlp:32", (1, 28, 28)),
    ("cnn:16-32", (64,)),          # digits: flat 64 reshaped to 1x8x8
    ("cnn:8", (28, 28)),           # a 2-D image gains a channel
    ("cnn:6-16", (3, 32, 32)),
    ("cnn:4-4-4-4-4", (1, 8, 8)),  # pooling stops once the map is one pixel wide
])
def test_each_spec_maps_a_batch_to_non_negative_features(spec, input_shape, device):
    torch.manual_seed(0)
    body = build_body(spec, input_shape, feature_dim=50).to(device)
    x = torch.randn(5, *input_shape, device=device)
    features = body(x)
    assert features.shape == (5, 50) and features.device.type == device
    assert (features >= 0).all()
    check_feature_dim(body, input_shape, 50)
    features.sum().backward()
    assert all(p.grad is not None for p in body.parameters())


def test_mlp_parameter_count_matches_the_layer_formula():
    body = build_body("mlp:200-100", (64,), feature_dim=50)
    expected = (64 * 200 + 200) + (200 * 100 + 100) + (100 * 50 + 50)
    assert sum(p.numel() for p in body.parameters()) == expected
    assert isinstance(body[-1], nn.ReLU)


def test_cnn_parameter_count_matches_the_layer_formula():
    body = build_body("cnn:16-32", (64,), feature_dim=50)  # 8x8 -> 4x4 -> 2x2
    expected = (1 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 2 * 2 * 50 + 50)
    assert sum(p.numel() for p in body.parameters()) == expected


def test_two_architectures_agree_on_feature_dim():
    bodies = [build_body("mlp:64", (64,), 20), build_body("cnn:8-16", (64,), 20)]
    x = torch.rand(3, 64)
    assert {tuple(b(x).shape) for b in bodies} == {(3, 20)}


@pytest.mark.parametrize("spec", ["transformer:3", "mlp:abc", "mlp:0", "mlp:10--20", "cnn",
                                  "cnn:", "cnn:-4", "", 7])
def test_bad_spec_is_a_config_error_listing_valid_forms(spec):
    with pytest.raises(ConfigError) as info:
        build_body(spec, (64,), 10)
    for form in BODY_KINDS.values():
        assert form in str(info.value)


def test_cnn_on_a_non_square_flat_input_is_a_config_error():
    with pytest.raises(ConfigError, match="use an mlp spec"):
        build_body("cnn:8", (40,), 10)


@pytest.mark.parametrize(("input_shape", "feature_dim"), [((0,), 10), ((64,), 0), ((), 10)])
def test_bad_shapes_are_config_errors(input_shape, feature_dim):
    with pytest.raises(ConfigError):
        build_body("mlp", input_shape, feature_dim)


def test_spec_parser_returns_kind_and_widths():
    assert parse_body_spec("MLP:200-200") == ("mlp", (200, 200))
    assert parse_body_spec("mlp") == ("mlp", ())
    assert parse_body_spec("cnn:16-32") == ("cnn", (16, 32))


def test_feature_dim_mismatch_is_detected():
    body = build_body("mlp:16", (64,), feature_dim=32)
    with pytest.raises(ConfigError, match=r"\(2, 32\), expected \(2, 50\)"):
        check_feature_dim(body, (64,), 50)


def test_a_body_that_rejects_the_input_shape_is_a_config_error():
    body = build_body("mlp", (64,), feature_dim=10)
    with pytest.raises(ConfigError, match="fails on inputs"):
        check_feature_dim(body, (30,), 10)


def test_check_feature_dim_restores_training_mode_and_handles_parameter_free_bodies():
    body = nn.Sequential(nn.Flatten(), nn.Dropout(0.5))
    body.train()
    check_feature_dim(body, (4,), 4)
    assert body.training
