"""The seeds of the client step (`bayesfl.client.step`), derived once for every transport.

Client ``c``'s generator of round ``r`` is seeded ``derived_seed(seed, r, c)``
(`fit_generators`, all clients of a round at once: `client_seeds`) and its
personalisation generator ``derived_seed(seed, PERSONALIZE_SEED_KEY, c)``
(`personalize_generator`), with `bayesfl.strategies.base.derived_seed`: a client
draws the same numbers in the simulator and on a Flower SuperNode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bayesfl.strategies.base import PERSONALIZE_SEED_KEY, derived_seed


def fit_generators(seed: int, round: int, client_ids: Sequence[int]) -> dict[int, torch.Generator]:
    """Each client's generator of round ``round``: seeded ``derived_seed(seed, round, c)``."""
    return {cid: torch.Generator().manual_seed(s)
            for cid, s in zip(client_ids, client_seeds(seed, round, client_ids), strict=True)}


def personalize_generator(seed: int, client_id: int) -> torch.Generator:
    """The generator client ``client_id`` personalises with:
    ``derived_seed(seed, PERSONALIZE_SEED_KEY, client_id)``."""
    return torch.Generator().manual_seed(derived_seed(seed, PERSONALIZE_SEED_KEY, client_id))


_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _POOL_SIZE = 0xCA01F9DD, 0x4973F715, 16, 4
_MASK32 = 2**32 - 1


def client_seeds(seed: int, round: int, client_ids: Sequence[int]) -> list[int]:
    """``[derived_seed(seed, round, c) for c in client_ids]`` (each client's seed of the round:
    `bayesfl.strategies.base.derived_seed`), computed for all clients at once.

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



__all__ = ["client_seeds", "fit_generators", "personalize_generator"]
