"""Time and memory per round of the simulator at 16,000 clients, split by step.

The setting is issue 28's: FedLog at ``feature_scale=1`` (the paper's s, FedLog's default when
issue 28 set this bench's target) on MNIST-1D (10 generated samples per client, so 160,000 for
16,000 clients), ``shards:2``, one shared ``mlp:100`` body with 32 features, 1 local epoch of
Adam (batch 10, lr 1e-3), 2 training rounds after FedLog's round 0, checkpoints on (a run
directory in a temporary folder), batched clients, 1 torch thread. Since issue 40 FedLog's
default is ``feature_scale="heldout"``, which scores each client's held-out slice at every
scale of a grid: at 1,000 clients it cost 3.5x the CPU seconds of a round (0.90 against 0.25,
2226352 against its parent, measured side by side on 2026-11-28). 1a04357 scores a round's
clients on the grid in one batched pass and draws each client's held-out split once: 1.01 ->
0.63 CPU s a round at 1,000 clients (interleaved runs, same figures), 19.1 -> 9.7 at 16,000
(6.8 at ``feature_scale=1``; separate runs at load 6-9); ``--feature-scale heldout`` measures
it.

Per round it prints the wall time and its split:

* ``local training``: the clients' fit (vmapped training, their statistics), less encoding;
* ``evaluation``: every client's evaluation of the new state and the merge of their
  calibration accumulators;
* ``messages``: encoding every upload, then decoding and validating it on receipt (every
  upload is a real serialized message, counted in bytes and checked against the schema and
  FedLog's invariants);
* ``aggregation``: the server's aggregate;
* ``checkpoint``: writing the run's checkpoint (server state, every client's state,
  metrics) atomically;
* ``other``: the rest (sampling, the broadcast, the round record);
* ``CPU s``: the process's CPU seconds over the round (after round 0): on a machine shared
  with other work the wall times stretch, the CPU time much less.

The total of a round after round 0 runs from the end of the previous round to the end of this
one (checkpoint included); round 0's total is its record's seconds plus its checkpoint.
Peak RSS is the run's process's maximum resident set (each run is its own process).

Peer, measured in the same invocation: the same run at 4,000 clients (40,000 samples). Its
rounds do the same work per client, so ``scaling = round(16,000) / round(4,000)`` is 4.0 when
the simulator's cost is linear in the clients and above 4 where per-client overheads grow
with the population (e.g. a per-round pass over a ledger of all clients).

After the rounds it times the finished run's tail: writing ``result.safetensors`` (at the
run's end) and reading the run back with `bayesfl.load_run` (with its ``load_run
scaling`` against the peer: 4.0 for x4 clients when linear, 16 if it were quadratic, as
before the result file's version 2). Peak RSS is taken before the run is read back.

Generating MNIST-1D takes 0.2-1 ms a sample by machine (35 s to 3 minutes for 160,000); the
data root keeps sets of 1,000 samples or more (`bayesfl.data.datasets`), and
``--data-cache DIR`` keeps the arrays in ``DIR`` (a ``.pt`` file of two tensors written by
this bench) for the next invocation.

Each run's PyTorch backs its large tensors with transparent huge pages, as the ``bayesfl``
command does (`bayesfl.cli.use_huge_pages`); ``--huge-pages off`` measures without.

The record, with its provenance (`bench.run_cache.append_result`: commit, date, machine,
seeds, torch version, threads, load average before and after), is appended to ``--out``
(default ``bench/results/simulate_scale.jsonl``; ``--out ''`` stores nothing); the published
table is ``simulate_scale`` of ``bench/published_tables.py``. Target (issue 28): at most 8 s a
round after round 0 at 16,000 clients.

Usage: ``python bench/simulate_scale.py [--clients 16000] [--peer-clients 4000]
[--data-cache DIR] [--huge-pages on|off] [--out bench/results/simulate_scale.jsonl]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.cli import HUGE_PAGES_VARIABLE  # noqa: E402 - after the path fix above

SAMPLES_PER_CLIENT = 10
ROUNDS = 2
SPLIT = ("local_training", "evaluation", "messages", "aggregation", "checkpoint", "other")


def load_data(num_samples: int, cache: Path | None):
    """MNIST-1D with ``num_samples`` samples (seed 0), from ``cache`` when it holds them."""
    import torch

    from bayesfl.data.datasets import Dataset, load_dataset

    path = None if cache is None else cache / f"mnist1d_{num_samples}.pt"
    if path is not None and path.exists():
        arrays = torch.load(path, weights_only=True)  # this bench's own file: two tensors
        return Dataset("mnist1d", arrays["x"], arrays["y"], 10, (arrays["x"].shape[1],))
    data = load_dataset("mnist1d", seed=0, num_samples=num_samples)
    if path is not None:
        cache.mkdir(parents=True, exist_ok=True)
        torch.save({"x": data.x, "y": data.y}, path)
    return data


def feature_scale_option(text: str) -> float | str:
    """``--feature-scale``: a number (FedLog's fixed s) or a rule's name (``heldout``,
    ``evidence``)."""
    try:
        return float(text)
    except ValueError:
        return text


def run_one(clients: int, cache: Path | None, feature_scale: float | str = 1.0) -> dict:
    """One run in this process (``--child``): per-round split and peak RSS."""
    import importlib

    import torch

    # the module (``bayesfl.simulate`` as an attribute is the function of that name)
    simulator = importlib.import_module("bayesfl.simulate")
    torch.set_num_threads(1)
    data = load_data(SAMPLES_PER_CLIENT * clients, cache)
    checkpoint_seconds: dict[int, float] = {}
    # the run's checkpoint is written by the engine (bayesfl.engine.run.Run.checkpoint)
    engine = importlib.import_module("bayesfl.engine.run")
    save_round = engine.save_round

    def timed_save_round(path, **kwargs):  # the run's checkpoint write, timed
        t = time.perf_counter()
        pending = save_round(path, **kwargs)
        checkpoint_seconds[kwargs["round"]] = time.perf_counter() - t
        return pending  # its fsync and rename, waited for before the next checkpoint

    engine.save_round = timed_save_round
    results = importlib.import_module("bayesfl.run_result")
    save_run_result = results.save_run_result
    result_seconds: list[float] = []

    def timed_save_run_result(*args, **kwargs):  # the run's result file, written at its end
        t = time.perf_counter()
        path = save_run_result(*args, **kwargs)
        result_seconds.append(time.perf_counter() - t)
        return path

    results.save_run_result = timed_save_run_result
    ends: dict[int, float] = {}
    cpu_ends: dict[int, float] = {}

    def round_done(r: int, _: dict) -> None:
        ends[r], cpu_ends[r] = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        result = simulator.simulate(
            "fedlog", strategy_options={"feature_scale": feature_scale},
            dataset="mnist1d", clients=clients, partition="shards:2",
            rounds=ROUNDS, seed=0, body="mlp:100", feature_dim=32, local_epochs=1,
            batch_size=10, lr=1e-3, progress=False, data=data,
            dataset_options={"num_samples": SAMPLES_PER_CLIENT * clients}, threads=1,
            out=Path(out) / "run", round_callback=round_done)
        # the peak of the run itself, before the finished run is read back beside it
        peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        t = time.perf_counter()
        loaded = importlib.import_module("bayesfl.loaded_run").load_run(Path(out) / "run")
        load_seconds = time.perf_counter() - t
        assert len(loaded.clients) == clients
        del loaded
    rounds = []
    for m in result.metrics:
        r = m["round"]
        checkpoint = checkpoint_seconds[r]
        total = (ends[r] - ends[r - 1]) if r - 1 in ends else m["seconds"] + checkpoint
        encoding = m["seconds_upload_encoding"]
        split = {
            "local_training": m["seconds_local_updates"] - encoding,
            "evaluation": m["seconds_evaluation"],
            "messages": encoding + m["seconds_receipt"],
            "aggregation": m["seconds_aggregation"],
            "checkpoint": checkpoint,
        }
        split["other"] = total - sum(split.values())
        # CPU seconds of the process over the round (rounds after round 0): the work itself,
        # which other processes sharing the machine do not stretch as they do the wall time
        cpu = cpu_ends[r] - cpu_ends[r - 1] if r - 1 in cpu_ends else float("nan")
        rounds.append({"round": r, "total": total, **split, "cpu": cpu})
    return {"clients": clients, "rounds": rounds, "peak_rss_gb": peak_rss_gb,
            "save_result_s": result_seconds[0], "load_run_s": load_seconds,
            "accuracy": result.summary["accuracy"], "ece": result.summary["ece"],
            "bytes_up": result.summary["bytes_up"], "feature_scale": feature_scale}


def run_child(clients: int, cache: Path | None, huge_pages: bool, feature_scale: str = "1"
              ) -> dict:
    command = [sys.executable, __file__, "--child", "--clients", str(clients),
               "--feature-scale", feature_scale]
    if cache is not None:
        command += ["--data-cache", str(cache)]
    # the child's PyTorch reads the switch at its first allocation: set it in its environment
    # (what the bayesfl command does for itself, bayesfl.cli.use_huge_pages)
    env = {**os.environ, HUGE_PAGES_VARIABLE: "1" if huge_pages else "0"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the run at {clients} clients failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def show(run: dict) -> None:
    print(f"\n{run['clients']:,} clients: peak RSS {run['peak_rss_gb']:.2f} GB, final accuracy "
          f"{run['accuracy']:.4f}, ECE {run['ece']:.4f}")
    print("| round | total s | " + " | ".join(SPLIT).replace("_", " ") + " | CPU s |")
    print("|---" * (len(SPLIT) + 3) + "|")
    for r in run["rounds"]:
        print(f"| {r['round']} | {r['total']:.2f} | "
              + " | ".join(f"{r[k]:.2f}" for k in SPLIT) + f" | {r['cpu']:.2f} |")


def after_round_0(run: dict) -> list[dict]:
    return [r for r in run["rounds"] if r["round"] >= 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=16_000)
    parser.add_argument("--peer-clients", type=int, default=4_000)
    parser.add_argument("--data-cache", type=Path, default=None)
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="back large tensors with transparent huge pages, as the bayesfl "
                             "command does (default on)")
    parser.add_argument("--feature-scale", default="1",
                        help="FedLog's feature_scale (default 1: issue 28's setting; "
                        "'heldout' is FedLog's default since issue 40)")
    parser.add_argument("--out", default="bench/results/simulate_scale.jsonl",
                        help="append the JSON record here ('' for nowhere)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.clients, args.data_cache,
                                 feature_scale_option(args.feature_scale))))
        return
    import torch

    from bench.run_cache import append_result

    torch.set_num_threads(1)  # the runs are children with one thread; recorded as such
    load_before = os.getloadavg()
    print(f"FedLog (feature_scale {args.feature_scale}), MNIST-1D ({SAMPLES_PER_CLIENT} samples "
          "per client, shards:2), mlp:100 -> 32 "
          f"features, 1 local epoch, {ROUNDS} rounds after round 0, checkpoints on, batched, "
          f"1 torch thread, huge pages {args.huge_pages}; each run in its own process")
    huge_pages = args.huge_pages == "on"
    peer = run_child(args.peer_clients, args.data_cache, huge_pages, args.feature_scale)
    main_run = run_child(args.clients, args.data_cache, huge_pages, args.feature_scale)
    for run in (peer, main_run):
        show(run)
    worst = max(r["total"] for r in after_round_0(main_run))
    mean = statistics.fmean(r["total"] for r in after_round_0(main_run))
    peer_mean = statistics.fmean(r["total"] for r in after_round_0(peer))
    cpu = statistics.fmean(r["cpu"] for r in after_round_0(main_run))
    scaling = mean / peer_mean
    factor = args.clients / args.peer_clients
    print(f"\nthe finished run: its result file written in {main_run['save_result_s']:.2f} s "
          f"and read back by bayesfl.load_run in {main_run['load_run_s']:.2f} s at "
          f"{args.clients:,} clients; {peer['save_result_s']:.2f} s and "
          f"{peer['load_run_s']:.2f} s at {args.peer_clients:,} (load_run scaling "
          f"{main_run['load_run_s'] / peer['load_run_s']:.2f} for x{factor:g} clients)")
    print(f"\n{args.clients:,} clients: {mean:.2f} s per round after round 0 (slowest "
          f"{worst:.2f} s; {cpu:.2f} CPU s), peak RSS {main_run['peak_rss_gb']:.2f} GB; "
          f"{args.peer_clients:,} clients: {peer_mean:.2f} s; scaling {scaling:.2f} "
          f"(x{factor:g} clients; equal means linear)")
    result = {
        "bench": "simulate_scale", "clients": args.clients, "peer_clients": args.peer_clients,
        "seconds_per_round": mean, "slowest_round": worst, "cpu_seconds_per_round": cpu,
        "split": {k: statistics.fmean(r[k] for r in after_round_0(main_run)) for k in SPLIT},
        "peak_rss_gb": main_run["peak_rss_gb"], "peer_seconds_per_round": peer_mean,
        "peer_peak_rss_gb": peer["peak_rss_gb"], "scaling": scaling,
        "accuracy": main_run["accuracy"], "huge_pages": huge_pages,
        "save_result_s": main_run["save_result_s"], "load_run_s": main_run["load_run_s"],
        "peer_save_result_s": peer["save_result_s"], "peer_load_run_s": peer["load_run_s"],
        "rounds": main_run["rounds"], "peer_rounds": peer["rounds"],
        "feature_scale": feature_scale_option(args.feature_scale)}
    print(json.dumps(append_result(args.out, result, seeds=[0], load_before=load_before)))


if __name__ == "__main__":
    main()
