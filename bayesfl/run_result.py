"""The file a finished simulator run leaves for `bayesfl.load_run`: ``result.safetensors``.

``simulate(..., out=DIR)`` ends by writing `RESULT_NAME`
(`save_run_result`) beside ``summary.json``, ``metrics.jsonl`` and ``partition.json``;
`bayesfl.loaded_run` reads it back (`read_run_result`).

Schema (format `RESULT_FORMAT`, version `RESULT_VERSION`): a checkpoint file
(`bayesfl.checkpoint`: safetensors, written atomically, a SHA-256 of the meta and tensors,
no pickle) holding

======================  ======================================================================
``clients/<g>/ids``,    the clients' final states (personalised where the strategy
``clients/<g>/state/``  personalises: the states their predictions use), stacked as in the
``<name>``              run's checkpoint (`bayesfl.engine.state`): clients grouped by
                        their state's layout, group ``g``'s ids (int64) and each of its
                        tensors with one row per id
``server/<name>``       the final server state
``run/evaluation``      the final evaluation broadcast (`bayesfl.messages.encode`
                        bytes, uint8), from which clients predict after the last round
meta                    ``format``, ``version``, ``identity`` (the configuration with the
                        data's identity: what the run's checkpoint fingerprints), ``context``
                        (the strategy context: classes, feature width, input shape, bodies,
                        local training), ``clients`` (id, body spec, init seed each),
                        ``first_round``, ``personalized`` (ids), ``novel`` (ids),
                        ``body_factories`` (`bayesfl.bodies.body_provenance`),
                        ``client_groups`` (each group's state names, in the order of ``g``)
======================  ======================================================================

Version 2 stacks the clients' states; version 1 (bayesfl before 2026-11-28) held one tensor
per client and name, ``client/<k>/<name>``, and `bayesfl.load_run` looked up each
client's among all of them: quadratic in the clients (at 16,000 clients 99-105 s, now
1.7-2.3 s).
Both versions are read (`result_client_states`).

The file's fingerprint is `config_fingerprint` of ``identity``, the
same as the run's checkpoint's, so a reader can tell a finished run from one continued with
other settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayesfl.checkpoint import (
    MAX_META_BYTES,
    config_fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from bayesfl.config import SimulationConfig
from bayesfl.engine.state import client_states, stacked_client_tensors
from bayesfl.errors import BayesFLError, CheckpointError
from bayesfl.messages import encode, read_safetensors_metadata
from bayesfl.run_directory import RESULT_NAME

RESULT_FORMAT = "bayesfl-run-result"
RESULT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""The result versions this bayesfl reads (module docstring)."""
BROADCAST_TENSOR = "run/evaluation"


def run_identity(config: SimulationConfig, data_identity: dict[str, Any]) -> dict[str, Any]:
    """What a run's checkpoint fingerprints: the configuration with the data's identity
    (``novel_fraction`` left out when 0 and ``data_seed`` when None, as the simulator does, so
    older runs keep theirs)."""
    from bayesfl.engine.setup import run_identity as identity_of

    return identity_of(config, data_identity)


def save_run_result(run_dir: str | Path, result: Any) -> Path:
    """Write ``result``'s final states to ``run_dir / RESULT_NAME`` (module docstring) and
    return the path; `bayesfl.load_run` reads it back. ``simulate(out=...)`` calls it
    last. ``result`` is the `SimulationResult` it returns (typed
    ``Any``: this module must not import the simulator, which imports it).

    Raises:
        CheckpointError: the write failed (nothing half-written is left).
    """
    path = Path(run_dir) / RESULT_NAME
    stacked, client_groups = stacked_client_tensors(
        {c.client_id: result.client_state(c.client_id) for c in result.clients})
    tensors = {**{f"server/{k}": v for k, v in result.state.items()}, **stacked}
    tensors[BROADCAST_TENSOR] = torch.from_numpy(
        np.frombuffer(encode(result.evaluation_broadcast), dtype=np.uint8).copy())
    context = result.strategy.context
    from bayesfl.bodies import body_provenance

    meta = {
        "format": RESULT_FORMAT,
        "version": RESULT_VERSION,
        "identity": run_identity(result.config, result.summary["data"]),
        "context": {
            "num_classes": context.num_classes, "feature_dim": context.feature_dim,
            "training": dataclasses.asdict(context.training), "rounds": context.rounds,
            "seed": context.seed, "input_shape": list(context.input_shape),
            "bodies": list(context.bodies), "clients": context.clients},
        "clients": [{"client_id": c.client_id, "body": c.config.body,
                     "init_seed": c.config.init_seed} for c in result.clients],
        "first_round": result.metrics[0]["round"] if result.metrics
        else result.config.rounds + 1,
        "personalized": sorted(result.personalized),
        "novel": list(result.novel),
        "body_factories": body_provenance(result.config.body),
        "client_groups": client_groups,
    }
    save_checkpoint(path, tensors, meta, fingerprint=config_fingerprint(meta["identity"]))
    return path


def header_metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of the file ``path``, reading only its header (bounded)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_META_BYTES + 2**20:
            raise ValueError(f"a header of {size:,} bytes is larger than any bayesfl file's")
        f.seek(0)
        return read_safetensors_metadata(f.read(8 + size), max_header_bytes=size)


def read_run_result(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and meta of ``path``, checked to be this format and version."""
    corrupt = f"{path} is corrupt or not a bayesfl run result ({{}}); run it again with --force"
    try:
        fingerprint = header_metadata(path).get("bayesfl.fingerprint")
    except (OSError, ValueError, RecursionError, BayesFLError) as err:
        raise CheckpointError(corrupt.format(_one_line(err))) from err
    if not isinstance(fingerprint, str):
        raise CheckpointError(corrupt.format("no fingerprint in its metadata"))
    try:
        tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    except CheckpointError as err:
        raise CheckpointError(corrupt.format(_one_line(err))) from err
    if meta.get("format") != RESULT_FORMAT:
        raise CheckpointError(corrupt.format(f"format {meta.get('format')!r}"))
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has format version {meta.get('version')!r}; this bayesfl reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: load it with the bayesfl version that "
            "wrote it (its manifest.json names it) or run it again with --force")
    needed = ("identity", "context", "clients")
    if any(not isinstance(meta.get(k), dict | list) for k in needed) or \
            config_fingerprint(meta["identity"]) != fingerprint:
        raise CheckpointError(corrupt.format("its meta does not match its fingerprint"))
    meta["fingerprint"] = fingerprint
    return tensors, meta


_V1_CLIENT_PREFIX = "client/"
"""Where a version 1 result kept client ``k``'s tensor ``name``: ``client/<k>/<name>``."""


def result_client_states(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                         client_ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Each client's saved state (name -> tensor) of a result read by `read_run_result`,
    by client id, for ``client_ids`` (the clients its meta lists), in one pass over the
    tensors whatever the version (module docstring).

    Raises:
        ValueError: the states do not hold exactly ``client_ids`` (a version 2 file: see
            `bayesfl.engine.state.client_states`; version 1: a ``client/`` tensor of
            an id not listed).
    """
    if meta.get("version") != 1:
        return client_states(tensors, meta, client_ids)
    states: dict[int, dict[str, torch.Tensor]] = {cid: {} for cid in client_ids}
    for key, value in tensors.items():
        if not key.startswith(_V1_CLIENT_PREFIX):
            continue
        cid, _, name = key[len(_V1_CLIENT_PREFIX):].partition("/")
        if not cid.isdigit() or int(cid) not in states or not name:
            raise ValueError(f"tensor {key!r} is not the state of a client of this run")
        states[int(cid)][name] = value
    return states


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."




__all__ = [
    "BROADCAST_TENSOR",
    "READABLE_VERSIONS",
    "RESULT_FORMAT",
    "RESULT_VERSION",
    "header_metadata",
    "read_run_result",
    "result_client_states",
    "run_identity",
    "save_run_result",
]
