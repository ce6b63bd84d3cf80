"""The run configuration: strict types, documented limits, devices, threads, model size."""

import re

import numpy as np
import pytest
import torch

from bayesfl.config import (
    MAX_BIN_CELLS,
    MAX_BINS,
    MAX_FEATURE_DIM,
    MAX_PARAMETERS,
    SimulationConfig,
    check_model_size,
    check_threads,
    default_threads,
    resolve_device,
    torch_threads,
)
from bayesfl.errors import ConfigError


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("rounds", "ten", r"rounds must be an integer, got 'ten' \(a string\)"),
        ("fraction", "half", r"fraction must be a number, got 'half' \(a string\)"),
        ("seed", 1e3, r"seed must be an integer, got 1000.0 \(a float\)"),
        ("clients", True, r"clients must be an integer, got True \(a boolean\)"),
        ("batched", "no", r"batched must be true or false, got 'no' \(a string\)"),
        ("batched", 0, r"batched must be true or false, got 0 \(an integer\)"),
        ("lr", True, r"lr must be a number, got True \(a boolean\)"),
        ("body", 200, r"body must be a non-empty string, got 200"),
        ("strategy", "", "strategy must be a non-empty string"),
        ("strategy_options", [("alpha", 1)], "strategy_options must be a mapping"),
        ("dataset_options", {1: 2}, "dataset_options must be a mapping"),
    ],
)
def test_values_of_the_wrong_type_are_refused_by_name(field, value, expected):
    with pytest.raises(ConfigError, match=expected):
        SimulationConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("seed", -5, "seed must be between 0 and 9,223,372,036,854,775,807, got -5"),
        ("seed", 2**63, "seed must be between 0"),
        ("clients", 0, "clients must be >= 1, got 0"),
        ("rounds", -1, "rounds must be >= 0"),
        ("feature_dim", 10**9, f"feature_dim must be between 1 and {MAX_FEATURE_DIM:,}, got "
                               "1,000,000,000"),
        ("n_bins", 10**10, f"n_bins must be between 1 and {MAX_BINS:,}, got 10,000,000,000"),
        ("batch_size", 0, "batch_size must be >= 1"),
        ("local_epochs", -1, "local_epochs must be >= 0"),
        ("lr", float("inf"), "lr must be a finite number > 0, got inf"),
        ("lr", float("nan"), "lr must be a finite number > 0, got nan"),
        ("lr", 1e10, "lr must be at most 1, got 1e+10: Adam moves every weight by about lr per "
                     "step"),
        ("lr", 1.5, "lr must be at most 1, got 1.5"),
        ("fraction", 0.0, "fraction must be a number in (0, 1]"),
        ("fraction", float("nan"), "fraction must be a number in (0, 1]"),
        ("test_fraction", 1.0, "test_fraction must be a number in (0, 1)"),
        ("device", "bogus", "unknown device 'bogus'; use cpu, cuda, cuda:N or mps"),
        ("device", "meta", "device 'meta' is not supported for runs"),
        ("body", " , ", "body must name at least one body spec"),
    ],
)
def test_values_out_of_range_are_refused_with_the_number(field, value, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        SimulationConfig(**{field: value})


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"n": "many"}, "dataset 'gaussian_mixture' option n must be an integer, got 'many' "
                        "(a string)"),
        ({"n": 300.0}, "option n must be an integer, got 300.0 (a float)"),
        ({"dim": True}, "option dim must be an integer, got True (a boolean)"),
        ({"num_classes": 1}, "option num_classes must be >= 2, got 1"),
        ({"separation": "far"}, "option separation must be a number, got 'far' (a string)"),
        ({"separation": -1}, "option separation must be a finite number >= 0, got -1.0"),
        ({"classes": 3}, "unknown option(s) ['classes'] for dataset 'gaussian_mixture'"),
    ],
)
def test_dataset_options_of_the_wrong_type_are_refused_before_anything_is_loaded(
        options, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        SimulationConfig(dataset="gaussian_mixture", dataset_options=options)
    # the same through simulate(), before a run directory is prepared or data generated
    from bayesfl.simulate import simulate

    with pytest.raises(ConfigError, match=re.escape(expected)):
        simulate("fedavg", dataset="gaussian_mixture", dataset_options=options)


def test_dataset_options_are_kept_as_given():
    config = SimulationConfig(dataset="gaussian-mixture", dataset_options={"n": np.int64(300),
                                                                           "separation": 3})
    assert config.dataset_options == {"n": 300, "separation": 3}  # fingerprints unchanged
    # a name that is not a known data set labels data passed in: its options are not checked
    assert SimulationConfig(dataset="custom", dataset_options={"n": "x"}).dataset == "custom"


def test_per_client_calibration_tables_are_bounded():
    clients = MAX_BIN_CELLS // MAX_BINS + 1
    with pytest.raises(ConfigError, match="clients x n_bins"):
        SimulationConfig(clients=clients, n_bins=MAX_BINS)
    SimulationConfig(clients=clients - 1, n_bins=MAX_BINS)  # at the limit: accepted


def test_valid_values_are_normalised_not_refused():
    config = SimulationConfig(clients=np.int64(5), lr=1, fraction=np.float32(0.5), seed=2**63 - 1,
                              feature_dim=MAX_FEATURE_DIM, n_bins=np.int32(15),
                              strategy_options={"alpha": 0.1})
    assert type(config.clients) is int and config.clients == 5
    assert type(config.lr) is float and config.lr == 1.0
    assert type(config.n_bins) is int
    assert config.fraction == 0.5 and config.seed == 2**63 - 1
    # an int and the equal float give the same configuration (and so the same fingerprint)
    assert SimulationConfig(lr=1).to_dict() == SimulationConfig(lr=1.0).to_dict()


def test_the_options_mapping_is_copied():
    options = {"alpha": 0.1}
    config = SimulationConfig(strategy_options=options)
    options["alpha"] = 5.0
    assert config.strategy_options == {"alpha": 0.1}


def test_an_unknown_strategy_is_refused_at_run_start_before_anything_is_loaded(tmp_path,
                                                                              monkeypatch):
    # the config names a strategy; the registry judges it, at run start (the config is below
    # the strategies: tests/test_imports.py)
    import importlib

    from bayesfl.engine.preflight import check_run_config

    simulate_module = importlib.import_module("bayesfl.simulate")  # the module, not simulate()

    config = SimulationConfig(strategy="fedsgd", strategy_options={"alpah": 1})
    with pytest.raises(ConfigError, match="unknown strategy 'fedsgd'"):
        check_run_config(config)
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['alpah'\] for strategy "
                                          r"'fedlog-c' \(did you mean 'alpha'\?\)"):
        check_run_config(SimulationConfig(strategy="fedlog-c", strategy_options={"alpah": 1}))
    with pytest.raises(ConfigError, match="unknown calibrate method 'platt'"):
        check_run_config(SimulationConfig(calibrate="platt"))

    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the strategy was checked")

    # the engine's Run loads the data for every transport (bayesfl.engine.run)
    monkeypatch.setattr(importlib.import_module("bayesfl.engine.run"), "load_dataset", no_data)
    with pytest.raises(ConfigError, match="unknown strategy 'fedsgd'"):
        simulate_module.simulate("fedsgd", out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_calibrate_that_is_not_a_string_is_refused_by_the_config():
    for bad in ("", "  ", 1, ["temperature"]):
        with pytest.raises(ConfigError, match="calibrate must be None or a method"):
            SimulationConfig(calibrate=bad)


def test_cpu_resolves_and_an_absent_gpu_is_a_config_error(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"CUDA is not available here.*use --device cpu"):
        resolve_device("cuda")


def test_a_gpu_index_beyond_the_machine_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="has 2 CUDA device"):
        resolve_device("cuda:3")


def test_model_size_is_counted_without_allocating_and_bounded():
    config = SimulationConfig(clients=20, body="mlp:200", feature_dim=50)
    # 64 -> 200 -> 50: (64 * 200 + 200) + (200 * 50 + 50) per client
    assert check_model_size(config, (64,)) == 20 * (64 * 200 + 200 + 200 * 50 + 50)
    mixed = SimulationConfig(clients=3, body="mlp:4,mlp:2-2", feature_dim=1)
    assert check_model_size(mixed, (3,)) == 2 * (3 * 4 + 4 + 4 + 1) + (3 * 2 + 2 + 2 * 2 + 2
                                                                       + 2 + 1)
    huge = SimulationConfig(clients=20, body="mlp:1000000000", feature_dim=50)
    with pytest.raises(ConfigError, match=f"more than the limit {MAX_PARAMETERS:,}"):
        check_model_size(huge, (64,))


def test_threads_default_and_bounds(monkeypatch):
    monkeypatch.setattr("inference.threads.available_cores", lambda: 2)
    assert default_threads() == 1
    monkeypatch.setattr("inference.threads.available_cores", lambda: 16)
    assert default_threads() == 4
    assert check_threads(None) == 4 and check_threads(3) == 3
    for bad, message in [(0, "between 1 and"), (True, "an integer"), (2.0, "an integer")]:
        with pytest.raises(ConfigError, match=f"threads must be {message}"):
            check_threads(bad)


def test_torch_threads_are_restored_after_the_block():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
