"""The one checkpoint format of a run, whatever its transport.

A checkpoint (`bayesfl.checkpoint.save_checkpoint`: safetensors, atomic, fingerprinted)
holds, after round ``r``:

* ``server/<name>``: the server state;
* ``clients/<g>/ids`` and ``clients/<g>/state/<name>``: the states of the clients the
  transport holds (the simulator holds all of them; a Flower ServerApp none: its clients'
  states live on their SuperNodes), stacked: the clients are grouped by their state's
  layout (names, shapes, dtypes; clients with an empty state form a group of ids alone),
  group ``g``'s client ids in ``ids`` (int64) and each of its tensors in one tensor whose
  row ``i`` is client ``ids[i]``'s. At 16,000 clients that is 4 tensors instead of 64,000:
  the write's per-tensor work (header, offsets, digest calls) was most of its CPU time;
* ``rng/torch``: the global torch RNG state (uint8);
* `METRICS_TENSOR`: ``metrics.jsonl`` as it stood after round ``r`` (uint8), from which a
  resumed run rebuilds the file and the summary;

and its metadata: ``format`` (`CHECKPOINT_FORMAT`), ``round``, ``first_round``,
``seconds`` (elapsed run time), ``config`` (the run's identity, data included),
``server_keys``, ``client_groups`` (each group's state names, in the order of ``g``) and
``transport``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayesfl.checkpoint import PendingWrite, save_checkpoint
from bayesfl.engine.steps import cached_upload_problem, server_state_problem
from bayesfl.errors import CheckpointError
from bayesfl.stacked_rows import held_bytes, stack_rows
from bayesfl.strategies.base import ClientState, ServerState, ServerStrategy
from bayesfl.strategies.robust import declared_ledger_problem

METRICS_TENSOR = "run/metrics.jsonl"
"""Checkpoint tensor holding ``metrics.jsonl`` as bytes."""
CHECKPOINT_FORMAT = 3
"""2: carries metrics.jsonl, the data identity and the first round; 3: the clients' states
stacked per layout group (``clients/<g>/...``) instead of one tensor per client and name."""
CLIENTS_PREFIX = "clients/"
"""Where the stacked client states live in a checkpoint (module docstring)."""


def save_round(path: Path, *, round: int, first_round: int, seconds: float,
               identity: Mapping[str, Any], fingerprint: str, state: ServerState,
               clients: Mapping[int, ClientState], metrics_text: bytes | bytearray,
               transport: str, durable_in_background: bool = False,
               keep_spare: bool = False) -> PendingWrite:
    """Write the checkpoint of round ``round`` to ``path`` atomically (module docstring);
    ``durable_in_background``: its fsync and rename go on in a thread, ended by the returned
    write's ``wait()``; ``keep_spare``: the replaced checkpoint is overwritten by the next
    (`bayesfl.checkpoint.save_checkpoint`)."""
    stacked, client_groups = stacked_client_tensors(clients)
    tensors = {**{f"server/{k}": v for k, v in state.items()}, **stacked}
    tensors["rng/torch"] = torch.get_rng_state()
    tensors[METRICS_TENSOR] = torch.from_numpy(
        np.frombuffer(bytes(metrics_text), dtype=np.uint8).copy())
    meta = {"format": CHECKPOINT_FORMAT, "round": round, "first_round": first_round,
            "seconds": seconds, "config": dict(identity), "server_keys": sorted(state),
            "client_groups": client_groups, "transport": transport}
    return save_checkpoint(path, tensors, meta, fingerprint=fingerprint,
                           durable_in_background=durable_in_background, keep_spare=keep_spare)


def stacked_client_tensors(clients: Mapping[int, ClientState]
                           ) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """The clients' states as a file's tensors, stacked per layout group (module docstring:
    ``clients/<g>/ids`` and ``clients/<g>/state/<name>``), and the meta's ``client_groups``
    (each group's state names), which `client_states` reads back."""
    tensors: dict[str, torch.Tensor] = {}
    groups = stack_client_states(clients)
    for g, (ids, stacked) in enumerate(groups):
        tensors[f"{CLIENTS_PREFIX}{g}/ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors.update({f"{CLIENTS_PREFIX}{g}/state/{k}": v for k, v in stacked.items()})
    return tensors, [sorted(stacked) for _, stacked in groups]


def stack_client_states(
        clients: Mapping[int, ClientState], *, copy: bool = False,
) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """The clients' states grouped by layout (state names, shapes and dtypes, in the order
    the clients come), each group as (its client ids, each name's states stacked along a new
    first dimension, row ``i`` being ``ids[i]``'s). Stacking copies bits (``torch.stack``) or,
    unless ``copy``, views them where they already lie stacked (`stack_rows`: the rows a
    batched fit gave its clients, or a resumed run's), so `client_states` gives back
    each state exactly."""
    by_layout: dict[tuple, tuple[list[int], list[ClientState]]] = {}
    for cid, client_state in clients.items():
        layout = tuple((k, tuple(v.shape), v.dtype, v.device)
                       for k, v in sorted(client_state.items()))
        ids, states = by_layout.setdefault(layout, ([], []))
        ids.append(int(cid))
        states.append(client_state)
    return [(ids, {k: stack_rows([s[k] for s in states], copy=copy)
                  for k in sorted(states[0])})
            for ids, states in by_layout.values()]


def compact_client_states(
        clients: Mapping[int, ClientState], *, slack: float = 2.0) -> dict[int, ClientState]:
    """The clients' states, restacked when the memory they keep alive is more than ``slack``
    times their own bytes (else the same state objects).

    A batched fit leaves each client's trained tensors as row views of its round's stack
    (`bayesfl.stacked_rows`): with every client trained every round, the stacks the states
    hold are exactly the states; with a fraction sampled, a client not trained since keeps its
    last round's whole stack alive, and those stacks would add up over the rounds. Restacking
    copies every layout group's tensors into one new stack per name and gives each client its
    row: the states then hold their own bytes once (and the next checkpoint writes those stacks
    without a copy). ``slack`` bounds the memory the states hold at ``slack`` times their size
    and makes the restacking rare (a round trains a fraction ``f`` of the clients: one restack
    every ``~(slack - 1) / f`` rounds).
    """
    own, held = held_bytes(t for state in clients.values() for t in state.values())
    if held <= slack * own:
        return dict(clients)
    out: dict[int, ClientState] = {}
    for ids, stacked in stack_client_states(clients, copy=True):  # every client, every name
        for i, cid in enumerate(ids):
            out[cid] = {k: v[i] for k, v in stacked.items()}
    return {cid: out[cid] for cid in clients}


def client_states(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                  client_ids: list[int]) -> dict[int, ClientState]:
    """The clients' states of a checkpoint (written by `save_round`), by client id:
    each a row of its group's stacked tensors (a view, no copy).

    Raises:
        ValueError: the groups do not hold exactly ``client_ids``, each once (an id missing,
            unknown or repeated), a group's ids are not an int64 vector, one of its tensors is
            missing or has not one row per id, or a ``clients/`` tensor belongs to no group.
    """
    groups = meta.get("client_groups")
    if not isinstance(groups, list) or not all(
            isinstance(names, list) and all(isinstance(k, str) for k in names)
            for names in groups):
        raise ValueError(f"client_groups {groups!r} is not a list of lists of state names")
    expected = {f"{CLIENTS_PREFIX}{g}/ids" for g in range(len(groups))} | {
        f"{CLIENTS_PREFIX}{g}/state/{k}" for g, names in enumerate(groups) for k in names}
    stray = sorted(k for k in tensors if k.startswith(CLIENTS_PREFIX) and k not in expected)
    if stray:
        raise ValueError(f"tensor {stray[0]!r} belongs to no client group")
    states: dict[int, ClientState] = {}
    repeated: set[int] = set()
    for g, names in enumerate(groups):
        name = f"{CLIENTS_PREFIX}{g}/ids"
        ids = _tensor(tensors, name)
        if ids.dtype != torch.int64 or ids.ndim != 1:
            raise ValueError(f"{name} is {ids.dtype} of shape {tuple(ids.shape)}, not an int64 "
                             "vector")
        rows = {}
        for k in names:
            stacked = _tensor(tensors, f"{CLIENTS_PREFIX}{g}/state/{k}")
            if stacked.ndim == 0 or stacked.shape[0] != len(ids):
                raise ValueError(f"{CLIENTS_PREFIX}{g}/state/{k} has "
                                 f"{stacked.shape[0] if stacked.ndim else 'no'} rows for the "
                                 f"group's {len(ids)} client ids")
            rows[k] = stacked
        for i, cid in enumerate(ids.tolist()):
            if cid in states:
                repeated.add(cid)
            states[cid] = {k: stacked[i] for k, stacked in rows.items()}
    wanted = set(client_ids)
    missing, unknown = sorted(wanted - set(states)), sorted(set(states) - wanted)
    if missing or unknown or repeated:
        parts = [f"{what} {ids[:5]}{' ...' if len(ids) > 5 else ''}" for what, ids in (
            ("missing", missing), ("unknown", unknown), ("repeated", sorted(repeated))) if ids]
        raise ValueError("its client ids do not match this run's clients ("
                         + "; ".join(parts) + ")")
    return states


def restored_client_states(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                           initial: Mapping[int, ClientState], device: torch.device
                           ) -> dict[int, ClientState]:
    """The states of the clients ``initial`` names from a checkpoint (`client_states`),
    on ``device``, each checked against its initial state: the same names, shapes and dtypes
    (a client's state keeps its layout across rounds).

    Raises:
        ValueError: as `client_states`, or a state whose layout differs.
    """
    saved = client_states(tensors, meta, list(initial))
    for cid, state in initial.items():
        layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        if {k: (tuple(v.shape), v.dtype) for k, v in saved[cid].items()} != layout:
            raise ValueError(f"client {cid}'s tensors differ from its layout")
    return {cid: {k: v.to(device) for k, v in saved[cid].items()} for cid in initial}


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"tensor {name!r} is missing")
    return tensors[name]


@dataclass
class SavedRound:
    """A checkpoint's contents, checked (`restore_round`).

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
                  first_round: int, rounds: int, server: ServerStrategy, fresh: ServerState,
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
            state, server.upload_schema(fresh, min(last + 1, rounds)), num_clients)
            or declared_ledger_problem(state, num_clients))
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


__all__ = ["CHECKPOINT_FORMAT", "CLIENTS_PREFIX", "METRICS_TENSOR", "SavedRound", "client_states",
           "compact_client_states", "foreign_message", "restore_round",
           "restored_client_states", "save_round",
           "stack_client_states", "stacked_client_tensors"]
