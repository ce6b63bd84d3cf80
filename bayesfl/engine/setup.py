"""What every transport derives from a run's configuration: the clients' data, the strategy
context, which clients take part in a round and which are novel (held out of training).

The simulator and the Flower ServerApp and ClientApp call the same functions, so the same
configuration and seed give the same clients, partitions, samples and strategy on any
transport.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bayesfl.calibration_spec import DEFAULT_HELD_OUT_FRACTION, parse_calibrate
from bayesfl.client.seeds import client_seeds
from bayesfl.config import SimulationConfig, check_model_size
from bayesfl.conformal_spec import parse_conformal
from bayesfl.data.clients import ClientData, make_clients
from bayesfl.data.datasets import Dataset
from bayesfl.errors import ConfigError
from bayesfl.holdout import hold_out
from bayesfl.strategies.base import StrategyContext
from bayesfl.training import LocalTraining


@dataclass
class RunSetup:
    """What both halves of a run derive from its configuration and data (`run_setup`).

    Attributes:
        client_data: every client's data, in client order.
        held_out: client id -> its held-out calibration data (``calibrate`` only).
        calibration: the parsed ``calibrate`` step, or None.
        context: the `StrategyContext` both halves build the strategy from.
    """

    client_data: list[ClientData]
    held_out: dict[int, Any]
    calibration: Any
    context: StrategyContext
    conformal: Any = None
    """the parsed ``conformal`` step (`bayesfl.conformal.parse_conformal`), or None;
    it shares ``held_out`` with ``calibrate``."""
    held_out_fraction: float = 0.0


def run_identity(config: SimulationConfig, data: Any) -> dict[str, Any]:
    """What a run's checkpoint and its nodes are fingerprinted by: the configuration and the
    data's identity (runs without novel clients leave ``novel_fraction`` out, so their
    fingerprints are those of versions before it existed; so do runs without a ``data_seed``:
    [`to_dict`][bayesfl.config.SimulationConfig.to_dict] leaves it out)."""
    identity = {**config.to_dict(), "data": data}
    if config.novel_fraction == 0:
        del identity["novel_fraction"]
    return identity


def run_setup(config: SimulationConfig, dataset: Dataset, device: torch.device) -> RunSetup:
    """The clients' data and the strategy context of a run (every transport
    calls it, so all build the same clients and strategy from the same config).

    The data side (partition, test split, ``calibrate`` hold-out) draws from
    ``config.data_rng_seed``; the strategy context (model initialisation) from ``config.seed``.
    """
    check_model_size(config, tuple(dataset.input_shape))  # before any body is built
    client_data = make_clients(dataset, config.clients, config.partition,
                               seed=config.data_rng_seed, test_fraction=config.test_fraction)
    # calibrate: every client holds out part of its training data, before any training
    calibration = parse_calibrate(config.calibrate)
    conformal = parse_conformal(config.conformal)
    held_out = {}
    fraction = 0.0
    if calibration is not None or conformal is not None:
        fraction = (DEFAULT_HELD_OUT_FRACTION if calibration is None
                    else calibration.held_out_fraction)
        client_data, held_out = hold_out(client_data, fraction, config.data_rng_seed)
    # a batch larger than every client's training set is full-batch training: clamping it
    # bounds the batched schedule (clients x batch) by the data, whatever was asked for
    largest = max(d.num_train for d in client_data)
    training = LocalTraining(epochs=config.local_epochs, lr=config.lr,
                             batch_size=max(1, min(config.batch_size, largest)))
    context = StrategyContext(
        num_classes=dataset.num_classes, feature_dim=config.feature_dim,
        training=training, rounds=config.rounds, device=device, seed=config.seed,
        input_shape=tuple(dataset.input_shape), bodies=tuple(config.body_specs),
        clients=config.clients)
    return RunSetup(client_data, held_out, calibration, context, conformal, fraction)



def sample_clients(num_clients: int, fraction: float, seed: int, round: int) -> list[int]:
    """The sorted client ids taking part in ``round``: all when ``fraction == 1`` or in the
    init round 0, else ``max(1, round(fraction * num_clients))`` drawn without replacement."""
    if fraction >= 1.0 or round == 0:
        return list(range(num_clients))
    k = max(1, int(round_half_up(fraction * num_clients)))
    rng = np.random.default_rng([seed, round, 7])
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


def novel_clients(num_clients: int, fraction: float, seed: int) -> list[int]:
    """The sorted ids of the novel clients: none for ``fraction == 0``, else
    ``max(1, round(fraction * num_clients))`` drawn without replacement from the seed.

    Raises:
        ConfigError: the fraction leaves no client to train.
    """
    if fraction <= 0:
        return []
    k = max(1, round_half_up(fraction * num_clients))
    if k >= num_clients:
        raise ConfigError(f"novel_fraction {fraction} holds out {k} of {num_clients} clients: "
                          "none would be left to train; use a smaller fraction or more clients")
    rng = np.random.default_rng([seed, 17])
    return sorted(int(i) for i in rng.choice(num_clients, size=k, replace=False))


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx)
def round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


__all__ = ["RunSetup", "client_seeds", "novel_clients", "round_half_up", "run_identity",
           "run_setup", "sample_clients"]
