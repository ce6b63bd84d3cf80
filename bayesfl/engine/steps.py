"""The steps of a round that do not depend on the transport: checking what the server
received, aggregating or keeping the previous state, evaluating the new state or reverting to
the previous one, and the run's summary.

A strategy's ``aggregate`` may fail, return a non-finite state, or return a state whose
evaluation fails (a poisoned upload can do each): no upload may stop the run, so each of these
keeps the previous state and says why (``aggregate_error`` in the round's record).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from bayesfl.config import SimulationConfig
from bayesfl.errors import BayesFLError
from bayesfl.evaluation import RoundEvaluation
from bayesfl.messages import Message, TensorSpec
from bayesfl.strategies.base import (
    RoundPlan,
    ServerState,
    ServerStrategy,
    StrategyConfig,
    derived_seed,
)
from calibration.errors import CalibrationError
from inference.errors import InferenceError

SERVER_SEED_KEY = 2**31 - 1
"""The "client id" of the server's own generator in round ``r``
(``derived_seed(seed, r, SERVER_SEED_KEY)``), drawn by ``aggregate``."""

T = TypeVar("T")


def non_finite_problem(state: ServerState) -> str | None:
    """The first server-state tensor holding NaN or Inf, described; None if all are finite.

    The floating tensors are checked together, one concatenation per dtype and device (a
    server state may hold a tensor per client: FedLog's cache of their latest statistics),
    and one by one only when that finds a non-finite value.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in state.values():
        if tensor.is_floating_point() or tensor.is_complex():
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor.reshape(-1))
    if all(bool(torch.isfinite(torch.cat(group)).all()) for group in groups.values()):
        return None
    for name, tensor in state.items():
        if (tensor.is_floating_point() or tensor.is_complex()) and \
                not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            return f"{name!r} has {bad} non-finite value(s) of {tensor.numel()}"
    return None


def server_state_problem(loaded: ServerState, fresh: ServerState) -> str | None:
    """How a resumed server state departs from ``fresh``, the state a new run of the same
    configuration starts from; None if it fits (a checkpoint's digest has no key, so a forged
    or buggy one is checked here rather than met by a shape error in the next round).

    Every tensor of the fresh state must be there with its dtype and shape (a tensor that starts
    empty may have grown along its empty axes: CoLearn's pool), and every floating tensor must
    be finite. Tensors a strategy adds as it runs (per-client ledgers and caches, momentum
    buffers) have no counterpart in the fresh state: `cached_upload_problem` checks the
    copies of uploads among them.
    """
    for name, start in fresh.items():
        if name not in loaded:
            return f"server tensor {name!r} is missing"
        tensor = loaded[name]
        if tensor.dtype != start.dtype:
            return f"server tensor {name!r} is {tensor.dtype}, this run's is {start.dtype}"
        grown = tensor.dim() == start.dim() and all(
            a == b or b == 0 for a, b in zip(tensor.shape, start.shape, strict=True))
        if not grown:
            return (f"server tensor {name!r} has shape {tuple(tensor.shape)}, this run's has "
                    f"{tuple(start.shape)}")
    problem = non_finite_problem(loaded)
    return None if problem is None else f"server tensor {problem}"


def cached_upload_problem(loaded: ServerState, schema: Mapping[str, TensorSpec],
                          num_clients: int) -> str | None:
    """The first server tensor named ``PREFIX/<client id>/<upload tensor>`` (a copy of a
    client's upload the strategy keeps, e.g. FedLog's latest statistics) whose client is not one
    of this run's or whose dtype or shape does not fit the upload schema; None if all fit."""
    for name, tensor in loaded.items():
        parts = name.split("/")
        if len(parts) != 3 or parts[2] not in schema:
            continue
        spec = schema[parts[2]]
        if not parts[1].isdigit() or int(parts[1]) >= num_clients:
            return f"server tensor {name!r} names no client of this run (0 to {num_clients - 1})"
        fits = tensor.dtype == spec.dtype and tensor.dim() == len(spec.shape) and all(
            want is None or size == want for size, want in zip(tensor.shape, spec.shape,
                                                               strict=True))
        if not fits:
            return (f"server tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, an "
                    f"upload's {parts[2]!r} is {spec.dtype} {tuple(spec.shape)}")
    return None


def round_view(strategy: StrategyConfig) -> dict[str, str]:
    """``{"round_view": ...}`` for a round record where the strategy evaluates rounds other
    than by its final predictive (`StrategyConfig.round_view`), else nothing."""
    return {} if strategy.round_view is None else {"round_view": strategy.round_view}


def screen_uploads(server: ServerStrategy, plan: RoundPlan,
                   received: Sequence[tuple[int, Message]],
                   reasons: dict[int, str]) -> list[Message]:
    """The uploads that pass `ServerStrategy.validate_uploads` (in the order received); the
    reason of each other one goes into ``reasons`` (client id -> reason)."""
    verdicts = server.validate_uploads(plan, [m for _, m in received],
                                       [cid for cid, _ in received])
    accepted: list[Message] = []
    for (cid, message), reason in zip(received, verdicts, strict=True):
        if reason is None:
            accepted.append(message)
        else:
            reasons[cid] = reason
    return accepted


def all_rejected_message(round: int, rejections: Sequence[Mapping[str, Any]],
                         accepted: int) -> str | None:
    """The warning for a round in which uploads came back and every one was rejected
    (`UploadsRejectedWarning`), naming up to three distinct reasons;
    None when any upload was accepted or none came back."""
    if accepted or not rejections:
        return None
    reasons = list(dict.fromkeys(str(r["reason"]) for r in rejections))
    shown = "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    return (f"round {round}: all {len(rejections)} uploads were rejected, so the round kept "
            f"its state ({shown}). When every client fails the same check, the cause is "
            "usually shared: the body, the data or the strategy's options. Every rejection is "
            "listed under 'rejections' in metrics.jsonl (this warning is given once per run).")


def run_rejected_message(metrics: Sequence[Mapping[str, Any]]) -> str | None:
    """The warning for a run in which uploads came back and not one was accepted in any
    round (`UploadsRejectedWarning`, given at the end of the run, after
    `all_rejected_message`'s once-per-run round warning), naming up to three distinct
    reasons; None when any upload was accepted or none came back."""
    rejections = [r for m in metrics for r in m.get("rejections", [])]
    if not rejections or any(m.get("accepted", 0) for m in metrics):
        return None
    reasons = list(dict.fromkeys(str(r["reason"]) for r in rejections))
    shown = "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    return (f"every upload of the run was rejected ({len(rejections)} in {len(metrics)} "
            f"rounds: {shown}), so no round changed the server state and the run's figures "
            "are those of its initial state. Fix the shared cause (the body, the data, the "
            "strategy's options, or what alters the uploads on their way) and run it again; "
            "every rejection is listed under 'rejections' in summary.json.")


def aggregate_or_keep(server: ServerStrategy, state: ServerState, accepted: Sequence[Message],
                      round: int, seed: int) -> tuple[ServerState, str | None]:
    """``(new state, None)``, or ``(state, why it was kept)`` when ``aggregate`` fails or
    returns a state that is not finite. The server's generator of round ``round`` is
    ``derived_seed(seed, round, SERVER_SEED_KEY)`` on every transport."""
    try:
        generator = torch.Generator().manual_seed(derived_seed(seed, round, SERVER_SEED_KEY))
        new_state = server.aggregate(state, list(accepted), round, generator)
    except (BayesFLError, InferenceError) as err:
        return state, f"aggregation failed, previous state kept: {err}"
    problem = non_finite_problem(new_state)
    if problem is not None:
        return state, f"aggregate rejected, previous state kept: {problem}"
    return new_state, None


def evaluate_or_revert(state: ServerState, previous: ServerState,
                       evaluate: Callable[[ServerState], T]) -> tuple[ServerState, T, str | None]:
    """``evaluate(state)``; if that fails on a new aggregate, the previous state is evaluated
    and kept instead: ``(state kept, its evaluation, why it reverted or None)``.

    Raises:
        BayesFLError, InferenceError, CalibrationError: the evaluation of ``previous`` itself
            failed (the state that was evaluated fine last round: not an upload's doing).
    """
    try:
        return state, evaluate(state), None
    except (BayesFLError, InferenceError, CalibrationError) as err:
        if state is previous:
            raise
        return previous, evaluate(previous), (f"evaluation of the aggregate failed ({err}); "
                                              "previous state kept")


def build_summary(
    config: SimulationConfig,
    metrics: list[dict[str, Any]],
    last: RoundEvaluation,
    seconds: float,
) -> dict[str, Any]:
    """The summary dict: final-round metrics, the best evaluated round, byte totals and
    rejections over every round."""
    evaluated = [m for m in metrics if m.get("accuracy") is not None]  # evaluate-every
    training = [m for m in evaluated if m["round"] >= 1] or evaluated
    best = max(training, key=lambda m: m["accuracy"]) if training else None
    rejections = [{"round": m["round"], **rej} for m in metrics for rej in m["rejections"]]
    return {
        "strategy": config.strategy,
        "dataset": config.dataset,
        "partition": config.partition,
        "clients": config.clients,
        "rounds": config.rounds,
        "seed": config.seed,
        **({} if config.data_seed is None else {"data_seed": config.data_seed}),
        "body": config.body,
        **last.headline(),
        "per_client": last.per_client,
        "best_accuracy": best["accuracy"] if best else None,
        "best_round": best["round"] if best else None,
        "bytes_up": int(sum(m["bytes_up"] for m in metrics)),
        "bytes_down": int(sum(m["bytes_down"] for m in metrics)),
        "bytes_down_evaluation": int(sum(m.get("bytes_down_evaluation", 0) for m in metrics)),
        "floats_up": int(sum(m["floats_up"] for m in metrics)),
        "floats_down": int(sum(m["floats_down"] for m in metrics)),
        "rejected_uploads": len(rejections),
        "rejections": rejections,
        "seconds": seconds,
    }


def summary_extras(summary: dict[str, Any], *, novel: Sequence[int],
                   novel_evaluation: RoundEvaluation | None) -> None:
    """``summary["novel"]``: the novel clients' ids and figures (when there are any)."""
    if novel_evaluation is not None:
        summary["novel"] = {"clients": list(novel), **novel_evaluation.headline(),
                            "per_client": novel_evaluation.per_client}


__all__ = ["SERVER_SEED_KEY", "aggregate_or_keep", "build_summary", "cached_upload_problem",
           "evaluate_or_revert", "non_finite_problem", "round_view", "run_rejected_message",
           "screen_uploads",
           "server_state_problem", "summary_extras"]
