"""What every transport derives from a run's configuration: the clients' data, the strategy
context, which clients take part in a round and which are novel (held out of training).

The simulator and the Flower ServerApp and ClientApp call the same functions, so the same
configuration and seed give the same clients, partitions, samples and strategy on any
transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bayesfl.calibrate import DEFAULT_HELD_OUT_FRACTION, hold_out, parse_calibrate
from bayesfl.config import SimulationConfig, check_model_size
from bayesfl.conformal import parse_conformal
from bayesfl.data.clients import ClientData, make_clients
from bayesfl.data.datasets import Dataset
from bayesfl.errors import ConfigError
from bayesfl.strategies.base import StrategyContext
from bayesfl.training import LocalTraining


@dataclass
class RunSetup:
    """What both halves of a run derive from its configuration and data (:func:`run_setup`).

    Attributes:
        client_data: every client's data, in client order.
        held_out: client id -> its held-out calibration data (``calibrate`` only).
        calibration: the parsed ``calibrate`` step, or None.
        context: the :class:`StrategyContext` both halves build the strategy from.
    """

    client_data: list[ClientData]
    held_out: dict[int, Any]
    calibration: Any
    context: StrategyContext
    conformal: Any = None
    """the parsed ``conformal`` step (:func:`bayesfl.conformal.parse_conformal`), or None;
    it shares ``held_out`` with ``calibrate``."""
    held_out_fraction: float = 0.0


def run_identity(config: SimulationConfig, data: Any) -> dict[str, Any]:
    """What a run's checkpoint and its nodes are fingerprinted by: the configuration and the
    data's identity (runs without novel clients leave ``novel_fraction`` out, so their
    fingerprints are those of versions before it existed; so do runs without a ``data_seed``:
    :meth:`~bayesfl.config.SimulationConfig.to_dict` leaves it out)."""
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
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _POOL_SIZE = 0xCA01F9DD, 0x4973F715, 16, 4
_MASK32 = 2**32 - 1


def client_seeds(seed: int, round: int, client_ids: Sequence[int]) -> list[int]:
    """``[derived_seed(seed, round, c) for c in client_ids]`` (each client's seed of the round:
    :func:`bayesfl.strategies.base.derived_seed`), computed for all clients at once.

    ``derived_seed`` hashes its words with numpy's ``SeedSequence``, ~25 us a call: half a
    second a round at 16,000 clients. The words of the clients differ only in the last (their
    ids), so here ``SeedSequence``'s mixing runs once over a vector of clients, step by step
    as numpy runs it on one (the tests check it against ``derived_seed``).
    """
    n = len(client_ids)
    u32 = np.uint32

    def words(value: int) -> list[int]:  # SeedSequence's 32-bit words of a non-negative int
        out = [value & _MASK32]
        while value > _MASK32:
            value >>= 32
            out.append(value & _MASK32)
        return out

    ids = (np.asarray(client_ids, dtype=np.int64) % 2**32).astype(u32)
    columns = [np.full(n, w, dtype=u32) for w in words(int(seed)) + words(int(round) % 2**32)]
    columns.append(ids)
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ u32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * u32(hash_const)
        return value ^ (value >> u32(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return result ^ (result >> u32(_XSHIFT))

    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as SeedSequence's does
        zero = np.zeros(n, dtype=u32)
        pool = [hashmix(columns[i] if i < len(columns) else zero) for i in range(_POOL_SIZE)]
        for src in range(_POOL_SIZE):
            for dst in range(_POOL_SIZE):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        for src in range(_POOL_SIZE, len(columns)):
            for dst in range(_POOL_SIZE):
                pool[dst] = mix(pool[dst], hashmix(columns[src]))
        state, hash_b = [], _INIT_B
        for i in range(2):  # generate_state(2)
            value = pool[i % _POOL_SIZE] ^ u32(hash_b)
            hash_b = (hash_b * _MULT_B) & _MASK32
            value = value * u32(hash_b)
            state.append((value ^ (value >> u32(_XSHIFT))).astype(np.uint64))
    seeds = ((state[0] << np.uint64(31)) ^ state[1]) & np.uint64(2**63 - 1)
    return [int(s) for s in seeds]


def round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


__all__ = ["RunSetup", "client_seeds", "novel_clients", "round_half_up", "run_identity",
           "run_setup", "sample_clients"]
