"""Benchmark: calibration metrics on 1,000,000 x 100 float32 probabilities against netcal.

Ours (input validation included in every call):
  * separate: ``ece`` + ``mce`` + ``brier``, three calls, each validating the array;
  * combined: one ``evaluate`` call (accuracy, ECE, MCE, Brier, NLL in one sweep).
Peer: netcal's ``ECE(bins=15).measure`` + ``MCE(bins=15).measure`` on the same numpy array.
Also shown: ``evaluate`` with the native kernel turned off (``BAYESFL_NATIVE=0``, the torch
sweep that CUDA tensors and machines without a C compiler use), and the floor of one read.

The three contenders run interleaved, round after round, and each keeps its best time, so a
burst of load on the shared machine hits all of them alike. Prints a table, then one JSON line.

The record, with its provenance (`bench.run_cache.append_result`: commit, date, machine,
seeds, torch version, threads, load average before and after), is appended to ``--out``
(default ``bench/results/calibration.jsonl``; ``--out ''`` stores nothing); the published
table is ``calibration`` of ``bench/published_tables.py``.

Targets (issue 2): at least 10x faster than netcal with three separate calls, at least 20x with
one combined call.

Usage: python bench/calibration.py [--rows N] [--classes K] [--rounds R] [--threads T]
[--out bench/results/calibration.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.run_cache import append_result
from calibration import native_sweep
from calibration.metrics import brier, ece, evaluate, mce


def make_predictions(rows: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax of scaled Gaussian logits (float32) and labels that agree with argmax ~60%."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, generator=generator) * 3.0
    probs = torch.softmax(logits, dim=1)
    del logits
    agree = torch.rand(rows, generator=generator) < 0.6
    labels = torch.where(agree, probs.argmax(1), torch.randint(0, classes, (rows,),
                                                               generator=generator))
    return probs.numpy(), labels.numpy()


def timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bins", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the machine is shared; 0: "
                        "torch's choice, one per core)")
    parser.add_argument("--out", default="bench/results/calibration.jsonl",
                        help="append the JSON record here ('' for nowhere)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    from netcal.metrics import ECE, MCE

    probs, labels = make_predictions(args.rows, args.classes, seed=0)
    bins = args.bins

    def netcal_pair():
        return ECE(bins=bins).measure(probs, labels), MCE(bins=bins).measure(probs, labels)

    def ours_separate():
        return ece(probs, labels, bins), mce(probs, labels, bins), brier(probs, labels)

    def ours_combined():
        return evaluate(probs, labels, bins)

    def ours_combined_torch_sweep():
        setting = os.environ.get("BAYESFL_NATIVE")
        os.environ["BAYESFL_NATIVE"] = "0"
        try:
            return evaluate(probs, labels, bins)
        finally:
            if setting is None:
                del os.environ["BAYESFL_NATIVE"]
            else:
                os.environ["BAYESFL_NATIVE"] = setting

    contenders = {"netcal ECE+MCE": netcal_pair, "ours ece+mce+brier (3 calls)": ours_separate,
                  "ours evaluate (1 call)": ours_combined,
                  "ours evaluate, torch sweep": ours_combined_torch_sweep}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results: dict[str, object] = {}
    ours_combined()  # warm-up (thread pool, allocator)
    for _ in range(args.rounds):
        for name, function in contenders.items():
            seconds, results[name] = timed(function)
            times[name].append(seconds)

    # The floor: one read of the array (a plain sum), which no validating metric can beat.
    tensor = torch.from_numpy(probs)
    floor_s = min(timed(tensor.sum)[0] for _ in range(args.rounds))

    best = {name: min(values) for name, values in times.items()}
    netcal_ece, netcal_mce = results["netcal ECE+MCE"]
    combined = results["ours evaluate (1 call)"]
    ratio_separate = best["netcal ECE+MCE"] / best["ours ece+mce+brier (3 calls)"]
    ratio_combined = best["netcal ECE+MCE"] / best["ours evaluate (1 call)"]

    kind = native_sweep.variant()
    lib = native_sweep.library(kind) if kind else None
    kernel = "off" if lib is None else f"{kind}, " + (
        "AVX-512 float32 path" if lib.bfl_sweep_variant() else "portable loops")
    print(f"calibration metrics on {args.rows:,} x {args.classes} float32 probabilities, "
          f"{bins} bins, {torch.get_num_threads()} threads, best of {args.rounds} rounds; "
          f"native sweep: {kernel}")
    print(f"{'contender':32s} {'best s':>9s} {'median s':>9s} {'speed-up':>9s}")
    for name, values in times.items():
        print(f"{name:32s} {best[name]:9.4f} {statistics.median(values):9.4f} "
              f"{best['netcal ECE+MCE'] / best[name]:8.1f}x")
    print(f"{'floor: one read (probs.sum())':32s} {floor_s:9.4f}")
    print(f"ECE ours {combined['ece']:.9f} netcal {netcal_ece:.9f} "
          f"(|diff| {abs(combined['ece'] - netcal_ece):.1e}); "
          f"MCE |diff| {abs(combined['mce'] - netcal_mce):.1e}")
    result = {
        "bench": "calibration", "rows": args.rows, "classes": args.classes, "bins": bins,
        "rounds": args.rounds, "times_s": times,
        "netcal_s": round(best["netcal ECE+MCE"], 4),
        "separate_s": round(best["ours ece+mce+brier (3 calls)"], 4),
        "combined_s": round(best["ours evaluate (1 call)"], 4), "floor_s": round(floor_s, 4),
        "combined_torch_sweep_s": round(best["ours evaluate, torch sweep"], 4),
        "native_sweep": kernel,
        "ratio_separate": round(ratio_separate, 2), "ratio_combined": round(ratio_combined, 2),
        "ece_abs_diff_vs_netcal": abs(combined["ece"] - netcal_ece),
        "mce_abs_diff_vs_netcal": abs(combined["mce"] - netcal_mce),
    }
    print(json.dumps(append_result(args.out, result, seeds=[0], load_before=load_before)))


if __name__ == "__main__":
    main()
