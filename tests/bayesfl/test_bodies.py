"""Bodies: each spec builds and maps (B, *input_shape) to non-negative (B, feature_dim)."""

import copy

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


@pytest.mark.parametrize(("spec", "input_shape", "feature_dim"), [
    ("resnet8", (3, 32, 32), 256),
    ("resnet8:8-16-32", (64,), 20),       # digits 8x8: maps are 1x1 from stage 2 on
    ("resnet8:8-16-32", (1, 28, 28), 32),
    ("lenet5", (1, 28, 28), 84),
    ("lenet5", (64,), 84),                # digits 8x8: 'same' padding
    ("lenet5", (3, 32, 32), 84),
    ("lg-cnn-mnist", (1, 28, 28), 50),
    ("lg-cnn-mnist", (64,), 50),
    ("lg-cnn-cifar", (3, 32, 32), 100),
])
def test_image_bodies_map_a_batch_to_non_negative_features(spec, input_shape, feature_dim):
    torch.manual_seed(0)
    body = build_body(spec, input_shape, feature_dim)
    features = body(torch.randn(4, *input_shape))
    assert features.shape == (4, feature_dim) and (features >= 0).all()
    check_feature_dim(body, input_shape, feature_dim)
    features.sum().backward()
    assert all(p.grad is not None for p in body.parameters())


def test_resnet8_has_the_fedpart_papers_group_sizes():
    # spec fedpart.md §1.2 table (CIFAR-10): conv + following BN per group, shortcut separate
    body = build_body("resnet8", (3, 32, 32), 256)
    sizes = {}
    for name, p in body.named_parameters():
        prefix = name.rsplit(".", 1)[0].replace("bn", "conv").replace("downsample.1",
                                                                      "downsample.0")
        sizes[prefix] = sizes.get(prefix, 0) + p.numel()
    assert list(sizes.values()) == [9_536, 36_992, 36_992, 73_984, 147_712, 8_448, 295_424,
                                    590_336, 33_280]
    assert sum(sizes.values()) + (256 * 10 + 10) == 1_235_274  # the paper's "about 1.235M"
    assert not isinstance(body.proj, nn.Linear) and len(list(body.proj.parameters())) == 0


def test_resnet8_projects_when_feature_dim_differs_from_the_last_width():
    body = build_body("resnet8:8-16-32", (64,), 20)
    assert isinstance(body.proj[0], nn.Linear) and body.proj[0].weight.shape == (20, 32)


@pytest.mark.parametrize(("spec", "input_shape", "flat"), [
    ("lenet5", (1, 28, 28), 16 * 4 * 4),   # 28 -> 24 -> 12 -> 8 -> 4 (valid convs)
    ("lenet5", (3, 32, 32), 16 * 5 * 5),   # classic LeNet-5: 400 features
    ("lenet5", (64,), 16 * 2 * 2),         # 8 -> 8 -> 4 -> 4 -> 2 ('same' padding)
])
def test_lenet5_parameter_count_matches_the_layer_formula(spec, input_shape, flat):
    channels = input_shape[0] if len(input_shape) == 3 else 1
    expected = ((channels * 6 * 25 + 6) + (6 * 16 * 25 + 16) + (flat * 120 + 120)
                + (120 * 84 + 84))
    assert sum(p.numel() for p in build_body(spec, input_shape, 84).parameters()) == expected


@pytest.mark.parametrize(("spec", "input_shape", "feature_dim", "last_two"), [
    ("lg-cnn-mnist", (1, 28, 28), 50, 16_560),   # spec fedlog.md: "LG-FedAvg 2" = 16560
    ("lg-cnn-cifar", (3, 32, 32), 100, 13_110),  # CIFAR10 "LG-FedAvg 2" = 13110
])
def test_lg_fedavg_cnns_share_the_papers_two_layer_sizes(spec, input_shape, feature_dim,
                                                         last_two):
    linears = [m for m in build_body(spec, input_shape, feature_dim).modules()
               if isinstance(m, nn.Linear)]
    last = linears[-1].weight.numel() + linears[-1].bias.numel()
    assert last + (feature_dim * 10 + 10) == last_two


@pytest.mark.parametrize("spec", ["resnet8:8-16", "resnet8:8-16-32-64", "lenet5:3",
                                  "lg-cnn-mnist:10"])
def test_fixed_architectures_reject_wrong_sizes(spec):
    with pytest.raises(ConfigError, match="malformed"):
        build_body(spec, (64,), 10)


def test_stacked_training_of_a_batchnorm_body_equals_training_each_client():
    # train_stacked falls back to train_plain per client for running statistics; the two
    # paths are the same computation, so the results agree bitwise
    from bayesfl.strategies.networks import ClassifierNet, cross_entropy_per_sample
    from bayesfl.training import LocalTraining, train_plain, train_stacked
    torch.manual_seed(0)
    net = ClassifierNet(build_body("resnet8:4-8-8", (64,), 8), 8, 3)
    xs = [torch.randn(12, 64), torch.randn(7, 64)]
    ys = [torch.randint(0, 3, (12,)), torch.randint(0, 3, (7,))]
    config = LocalTraining(epochs=2, batch_size=5)
    params = [{n: p.detach().clone() for n, p in net.named_parameters()} for _ in xs]
    buffers = [{n: b.clone() for n, b in net.named_buffers()} for _ in xs]
    train_stacked(net, params, buffers, xs, ys, cross_entropy_per_sample, config,
                  generators=[torch.Generator().manual_seed(k) for k in range(2)])
    for k, (x, y) in enumerate(zip(xs, ys, strict=True)):
        alone = copy.deepcopy(net)
        train_plain(alone, x, y, cross_entropy_per_sample, config,
                    generator=torch.Generator().manual_seed(k))
        for n, v in alone.state_dict().items():
            assert torch.equal(v, {**params[k], **buffers[k]}[n]), n
    assert not torch.equal(buffers[0]["body.pre_bn.running_mean"],
                           net.state_dict()["body.pre_bn.running_mean"])


# ---- your own body: a factory of a torch.nn.Module ----------------------------------------
from bayesfl.bodies import (  # noqa: E402 - this section's own imports
    body_provenance,
    body_spec,
    qualified_name,
    register_body,
    registered_bodies,
    unregister_body,
)


def small_body() -> nn.Module:
    """A user's body for (64,) inputs and feature_dim 8 (importable by its qualified name)."""
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU())


@pytest.fixture
def registry():
    """Names registered by a test are forgotten after it."""
    before = set(registered_bodies())
    yield
    for name in set(registered_bodies()) - before:
        unregister_body(name)


def test_a_registered_factory_is_a_body_spec_called_once_per_body(registry):
    calls = []

    def factory():
        calls.append(1)
        return small_body()

    assert register_body("mynet", factory) == "mynet"
    assert parse_body_spec("mynet") == ("mynet", ())
    first, second = build_body("mynet", (64,), 8), build_body("mynet", (64,), 8)
    assert len(calls) == 2 and first is not second  # a fresh module per client
    assert first(torch.rand(5, 64)).shape == (5, 8)
    assert registered_bodies()["mynet"] == qualified_name(factory)


def test_a_callable_body_is_registered_under_its_qualified_name(registry):
    spec = body_spec(small_body)
    assert spec == f"{__name__}:small_body"  # this module, however pytest imported it
    assert body_spec([small_body, "mlp:20"]) == f"{spec},mlp:20"
    assert build_body(spec, (64,), 8)(torch.zeros(1, 64)).shape == (1, 8)
    provenance = body_provenance(f"{spec},mlp:20")
    assert list(provenance) == [spec]  # the built-in spec needs no record
    assert provenance[spec]["importable"] is True


def test_a_lambda_is_recorded_as_not_importable_and_named_in_the_error_of_a_new_process(registry):
    spec = body_spec(lambda: small_body())
    assert "<lambda>" in spec and body_provenance(spec)[spec]["importable"] is False
    unregister_body(spec)  # as in a new process
    with pytest.raises(ConfigError, match="register it here first"):
        build_body(spec, (64,), 8)


def test_a_package_module_attribute_spec_imports_the_factory(registry):
    body = build_body(f"{__name__}:small_body", (64,), 8)
    assert isinstance(body, nn.Sequential)
    with pytest.raises(ConfigError, match="register_body"):
        build_body(f"{__name__}:no_such_factory", (64,), 8)


def test_a_script_factory_of_another_process_says_how_to_register_it():
    with pytest.raises(ConfigError, match=r"register_body\('__main__:make_body', make_body\)"):
        build_body("__main__:make_body", (64,), 8)


def test_a_module_instance_or_a_non_callable_is_refused_as_a_factory(registry):
    with pytest.raises(ConfigError, match="module instance"):
        body_spec(small_body())
    with pytest.raises(ConfigError, match="zero-argument callable"):
        register_body("x", 3)


@pytest.mark.parametrize("name", ["", "a,b", "my net", "mlp", "CNN:mine"])
def test_a_registered_name_must_be_one_spec_and_not_a_built_in(name, registry):
    with pytest.raises(ConfigError, match="body name"):
        register_body(name, small_body)


def fails():
    raise RuntimeError("no weights file")


class Wide(nn.Module):
    def forward(self, x):
        return torch.relu(x[:, :5])


@pytest.mark.parametrize(("factory", "message"), [
    (fails, "raised RuntimeError: no weights file"),
    (lambda: "not a module", "returned a str, not a torch.nn.Module"),
    (lambda: nn.Sequential(nn.Linear(64, 8), nn.ReLU()).double(), "float64 parameters"),
    (lambda: nn.Sequential(nn.Linear(32, 8), nn.ReLU()), "fails on inputs of shape"),
    (Wide, r"output for a batch of 2 is \(2, 5\), expected \(2, 8\)"),
    (lambda: nn.Linear(64, 8), "negative features"),
    (lambda: nn.Sequential(nn.Linear(64, 8), nn.Tanh()), "end the module in a ReLU"),
])
def test_a_factory_that_fails_a_built_in_check_is_a_config_error_naming_it(factory, message,
                                                                            registry):
    register_body("user-net", factory)
    with pytest.raises(ConfigError, match=message) as info:
        build_body("user-net", (64,), 8)
    assert "body factory 'user-net'" in str(info.value)


def test_a_factory_must_build_the_same_architecture_every_call(registry):
    widths = iter([16, 32])

    def drifting():
        return nn.Sequential(nn.Linear(64, next(widths)), nn.ReLU())

    register_body("drift", drifting)
    build_body("drift", (64,), 16)
    with pytest.raises(ConfigError, match="different architecture"):
        build_body("drift", (64,), 16)
    register_body("drift", small_body)  # a new factory starts a new architecture record
    assert build_body("drift", (64,), 8)(torch.zeros(1, 64)).shape == (1, 8)


def test_a_user_body_counts_against_the_parameter_budget_without_being_allocated(registry):
    from bayesfl.config import MAX_PARAMETERS, SimulationConfig, check_model_size

    hidden = MAX_PARAMETERS // 100  # 72 weights per unit: 0.72 budgets per client, on meta only
    register_body("huge", lambda: nn.Sequential(nn.Linear(64, hidden), nn.ReLU(),
                                                nn.Linear(hidden, 8), nn.ReLU()))
    config = SimulationConfig(body="huge", clients=2, feature_dim=8)
    with pytest.raises(ConfigError, match="more than the limit"):
        check_model_size(config, (64,))
    register_body("mine", small_body)
    assert check_model_size(SimulationConfig(body="mine", clients=3, feature_dim=8),
                            (64,)) == 3 * (64 * 16 + 16 + 16 * 8 + 8)


def test_a_factory_in_the_working_directory_is_found_as_the_console_script_runs(tmp_path,
                                                                                monkeypatch):
    # `bayesfl run --body mymodels:make` from the folder holding mymodels.py: a console script
    # does not put that folder on sys.path
    (tmp_path / "cwd_bodies_26.py").write_text(
        "from torch import nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(64, 8), nn.ReLU())\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path
                                     if p not in ("", str(tmp_path))])
    assert build_body("cwd_bodies_26:make", (64,), 8)(torch.zeros(1, 64)).shape == (1, 8)
