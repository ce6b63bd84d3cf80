"""The one checkpoint format of a run, whatever its transport.

A checkpoint (:func:`bayesfl.checkpoint.save_checkpoint`: safetensors, atomic, fingerprinted)
holds, after round ``r``:

* ``server/<name>``: the server state;
* ``client/<id>/<name>``: the states of the clients the transport holds (the simulator holds
  all of them; a Flower ServerApp none: its clients' states live on their SuperNodes);
* ``rng/torch``: the global torch RNG state (uint8);
* :data:`METRICS_TENSOR`: ``metrics.jsonl`` as it stood after round ``r`` (uint8), from which a
  resumed run rebuilds the file and the summary;

and its metadata: ``format`` (:data:`CHECKPOINT_FORMAT`), ``round``, ``first_round``,
``seconds`` (elapsed run time), ``config`` (the run's identity, data included),
``server_keys`` and ``transport``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayesfl.checkpoint import save_checkpoint
from bayesfl.engine.steps import cached_upload_problem, server_state_problem
from bayesfl.errors import CheckpointError
from bayesfl.strategies.base import ClientState, ServerState, Strategy

METRICS_TENSOR = "run/metrics.jsonl"
"""Checkpoint tensor holding ``metrics.jsonl`` as bytes."""
CHECKPOINT_FORMAT = 2
"""2: carries metrics.jsonl, the data identity and the first round."""


def save_round(path: Path, *, round: int, first_round: int, seconds: float,
               identity: Mapping[str, Any], fingerprint: str, state: ServerState,
               clients: Mapping[int, ClientState], metrics_text: bytes | bytearray,
               transport: str) -> None:
    """Write the checkpoint of round ``round`` to ``path`` atomically (module docstring)."""
    tensors = {f"server/{k}": v for k, v in state.items()}
    for cid, client_state in clients.items():
        tensors.update({f"client/{cid}/{k}": v for k, v in client_state.items()})
    tensors["rng/torch"] = torch.get_rng_state()
    tensors[METRICS_TENSOR] = torch.from_numpy(
        np.frombuffer(bytes(metrics_text), dtype=np.uint8).copy())
    meta = {"format": CHECKPOINT_FORMAT, "round": round, "first_round": first_round,
            "seconds": seconds, "config": dict(identity), "server_keys": sorted(state),
            "transport": transport}
    save_checkpoint(path, tensors, meta, fingerprint=fingerprint)


@dataclass
class SavedRound:
    """A checkpoint's contents, checked (:func:`restore_round`).

    Attributes:
        round: the last complete round.
        seconds: elapsed run time up to it.
        state: the server state (on the run's device).
        rng: the global torch RNG state to restore.
        metrics: ``metrics.jsonl`` as it stood (bytes).
        tensors: every tensor of the file (the client states are read by the transport).
    """

    round: int
    seconds: float
    state: ServerState
    rng: torch.Tensor
    metrics: bytes
    tensors: dict[str, torch.Tensor]


def foreign_message(path: Path) -> str:
    """The start of the error of a checkpoint this run cannot have written (``{}``: why)."""
    return (f"checkpoint {path} was not written by this run ({{}}); delete it or start the "
            "run again with --force (force=True)")


def restore_round(path: Path, tensors: dict[str, torch.Tensor], meta: Mapping[str, Any], *,
                  first_round: int, rounds: int, server: Strategy, fresh: ServerState,
                  num_clients: int, device: torch.device) -> SavedRound:
    """The run's server state, RNG and metrics from a loaded checkpoint, checked against what
    this run can have written (format, round, elapsed time, the fresh state's layout, the
    cached uploads' schema).

    Raises:
        CheckpointError: it holds a round or state this run cannot have written.
    """
    last = meta.get("round")
    foreign = foreign_message(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(foreign.format(f"format {meta.get('format')!r}, this version "
                                             f"writes {CHECKPOINT_FORMAT}"))
    if isinstance(last, bool) or not isinstance(last, int) or not first_round <= last <= rounds:
        raise CheckpointError(foreign.format(f"its round is {last!r}, outside this run's "
                                             f"rounds {first_round} to {rounds}"))
    seconds = meta.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not 0 <= seconds < float("inf"):
        raise CheckpointError(foreign.format(f"elapsed seconds {seconds!r}"))
    try:
        state = {k: tensors[f"server/{k}"].to(device) for k in meta["server_keys"]}
        problem = (server_state_problem(state, fresh) or cached_upload_problem(
            state, server.upload_schema(fresh, min(last + 1, rounds)), num_clients))
        if problem is not None:
            raise ValueError(problem)
        rng = tensors["rng/torch"]
        log = tensors[METRICS_TENSOR]
        if rng.dtype != torch.uint8 or log.dtype != torch.uint8 or log.ndim != 1:
            raise ValueError("rng/metrics tensors are not byte vectors")
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(foreign.format(f"it does not hold this run's state: "
                                             f"{err}")) from err
    return SavedRound(last, float(seconds), state, rng, log.numpy().tobytes(), tensors)


__all__ = ["CHECKPOINT_FORMAT", "METRICS_TENSOR", "SavedRound", "foreign_message",
           "restore_round", "save_round"]
