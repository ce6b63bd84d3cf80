"""FedAvg full-network updates (FNU) vs FedAvg + FedPart on mnist-5k with the paper's ResNet-8.

The FedPart paper (spec fedpart.md, Table 1: ResNet-8 on CIFAR-10/100 and Tiny-ImageNet,
R = 2, F = 5, 40 clients) reports 28% of FNU's uplink and 73% of its (analytic) compute;
for *FedAvg* its FedPart accuracy is equal to or better than FNU's at every cycle count
(+3.7 points on Tiny-ImageNet after 5 cycles), but not for the other algorithms it wraps:
on CIFAR-10 FedPart loses to FNU for MOON at every C and for FedProx at C >= 2 (and with
ResNet-18, Table 2, on CIFAR-10 at every C). This bench measures the FedAvg case here, in
one process per run, against FedAvg FNU run with the same seeds, data, body, local training
and number of rounds:

* accuracy: best (max over rounds, the paper's "Best Acc.") and final mean client accuracy
  of the global model;
* communication: the bytes every upload and every broadcast really had on the wire
  (safetensors, headers included), per client, up and down;
* compute: the *measured* CPU time of local training (``seconds_local_updates_cpu``: every
  client's fit, one after another, one torch thread; the wall time, which grows when other
  processes share the machine, is printed beside it) and the *analytic* FLOPs
  (``flops_local``: forward over every layer, backward from the output down to the first
  trainable group, `bayesfl.flops`).

Setup (stated in the output): mnist-5k (5,000 real MNIST digits, 28x28; 80% training, split
over 10 clients; the paper: CIFAR, 40 clients), IID and Dirichlet(1.0);
``resnet8:8-16-32`` (the paper's ResNet-8 structure, stem + three BasicBlocks with BatchNorm
and two conv shortcuts, at 1/8 of its widths: G = 10 layer groups with the head),
feature_dim 32; Adam (``--lr``, the paper's 1e-3 by default), batch 32, ``--epochs`` local
epochs (the paper's 8 by default); the paper's schedule by default: ``--warmup 5`` FNU
rounds, then ``--cycles 5`` cycles of ``--full 5`` FNU rounds (the first cycle's are the
warm-up) and R = ``--per-group 2`` rounds per group: 5 + 20 + 4 x 25 = 125 rounds, uplink
fraction (F + R) / (F + R G) = 7 / 25 = 0.28. BatchNorm statistics:
``bn_stats="aggregate"`` for both (averaged with the group they belong to; the evaluated
global model has coherent statistics). 3 seeds; ``--quick``: 1 seed, IID, one short cycle.

Figures: accuracy against cumulative uplink bytes and against cumulative measured local
compute (seconds) and analytic FLOPs, mean over seeds, one panel row per partition, saved to
``bench/out/fedpart.png`` (the path is printed). The last line is JSON.

Usage: ``python bench/fedpart.py [--quick] [--seeds 3] [--partitions iid,dirichlet:1.0]
[--cycles 5] [--epochs 8] [--cache bench/results/fedpart.jsonl] [--budget SECONDS]
[--jobs K] [--out bench/out]``; ``--cache``: one JSON line per finished run, keyed by its
settings (`bench.run_cache`), so an interrupted bench continues where it stopped.
``docs/seeds.md`` says what of the protocol was run and what it cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.simulate import simulate  # noqa: E402
from bayesfl.strategies import StrategyContext, make_strategy  # noqa: E402
from bench.run_cache import provenance, run_cached  # noqa: E402

BODY = "resnet8:8-16-32"
GROUPS = 10  # resnet8: stem, 3 blocks x (2 convs + shortcut where it has one), head
COMMON = dict(dataset="mnist-5k", clients=10, body=BODY, feature_dim=32, batch_size=32,
              test_fraction=0.2, progress=False, threads=1)
PAPER = {"bytes_ratio": 0.28, "compute_ratio": 0.73}
METHODS = ("FNU", "FedPart")


def rounds_of(schedule: dict, cycles: int, groups: int = GROUPS) -> int:
    """Rounds of ``cycles`` cycles: the warm-up, the first sweep, then (F + R G) each."""
    w, f, r = (schedule[k] for k in ("warmup_rounds", "full_rounds_per_cycle",
                                     "rounds_per_group"))
    return w + r * groups + (cycles - 1) * (f + r * groups)


def run(method: str, partition: str, seed: int, rounds: int, epochs: int, lr: float,
        schedule: dict) -> dict:
    """One run's per-round curves (accuracy, bytes up and down, CPU and wall seconds of
    local training, analytic FLOPs) and their totals."""
    strategy, options = ("fedavg", {}) if method == "FNU" else ("fedpart", schedule)
    result = simulate(strategy, partition=partition, rounds=rounds, seed=seed,
                      strategy_options=options, local_epochs=epochs, lr=lr, **COMMON)
    m = result.metrics
    acc = [r["accuracy"] for r in m]
    return {"method": method, "partition": partition, "seed": seed,
            "accuracy": acc, "bytes": [r["bytes_up"] for r in m],
            "bytes_down": [r["bytes_down"] for r in m],
            "total_bytes_down": sum(r["bytes_down"] for r in m),
            "seconds": [r["seconds_local_updates_cpu"] for r in m],
            "wall": [r["seconds_local_updates"] for r in m],
            "flops": [r["flops_local"] for r in m],
            "best": max(acc), "final": acc[-1], "total_bytes": sum(r["bytes_up"] for r in m),
            "total_seconds": sum(r["seconds_local_updates_cpu"] for r in m),
            "total_wall": sum(r["seconds_local_updates"] for r in m),
            "total_flops": sum(r["flops_local"] for r in m),
            "protocol": {**{k: v for k, v in COMMON.items() if k != "progress"},
                         "rounds": rounds, "local_epochs": epochs, "lr": lr, **schedule},
            **provenance()}


def cumulative(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def mean_curves(runs: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs = [cumulative(r[key]) for r in runs]
    n = len(xs[0])
    return ([statistics.fmean(x[i] for x in xs) for i in range(n)],
            [statistics.fmean(r["accuracy"][i] for r in runs) for i in range(n)])


def plot(results: list[dict], partitions: list[str], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_keys = [("bytes", "cumulative uplink, all clients (MB)", 1e-6),
                 ("seconds", "cumulative measured local training (CPU s)", 1.0),
                 ("flops", "cumulative analytic local FLOPs (TFLOP)", 1e-12)]
    fig, axes = plt.subplots(len(partitions), 3, figsize=(14, 4 * len(partitions)),
                             squeeze=False)
    for row, partition in enumerate(partitions):
        for col, (key, label, scale) in enumerate(axes_keys):
            ax = axes[row][col]
            for method, style in (("FNU", "o-"), ("FedPart", "s-")):
                runs = [r for r in results if r["method"] == method
                        and r["partition"] == partition]
                if not runs:
                    continue
                x, y = mean_curves(runs, key)
                ax.plot([v * scale for v in x], y, style, ms=3, label=method)
            ax.set_xlabel(label)
            ax.set_ylabel("mean client accuracy")
            ax.set_title(f"{partition}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, IID only, W = F = 2, R = 1, 1 cycle, 1 local epoch")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--partitions", default="iid,dirichlet:1.0")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--full", type=int, default=5, help="FNU rounds per cycle (F)")
    parser.add_argument("--per-group", type=int, default=2, help="rounds per group (R)")
    parser.add_argument("--epochs", type=int, default=8, help="local epochs (paper: 8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam lr (paper: 1e-3)")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--budget", type=float, default=float("inf"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    partitions = args.partitions.split(",")
    schedule = dict(warmup_rounds=args.warmup, full_rounds_per_cycle=args.full,
                    rounds_per_group=args.per_group)
    cycles, epochs = args.cycles, args.epochs
    if args.quick:
        seeds, partitions, cycles, epochs = [0], ["iid"], 1, 1
        schedule = dict(warmup_rounds=2, full_rounds_per_cycle=2, rounds_per_group=1)
    rounds = rounds_of(schedule, cycles)
    context = StrategyContext(10, 32, rounds=rounds, input_shape=(1, 28, 28), bodies=(BODY,),
                              clients=10)
    print(make_strategy("fedpart", context, **schedule).describe())
    setup = (f"mnist-5k (80% train), 10 clients, {BODY} (paper's ResNet-8 at 1/8 width), "
             f"{rounds} rounds = warm-up {schedule['warmup_rounds']} + {cycles} cycle(s) of "
             f"F={schedule['full_rounds_per_cycle']}, R={schedule['rounds_per_group']} "
             f"(paper: warm-up 5, F=5, R=2, C=5), {epochs} local epoch(s) (paper 8), "
             f"Adam {args.lr:g} (paper 1e-3), batch 32, bn_stats=aggregate, 1 torch thread")
    print(f"setup: {setup}; seeds {seeds}")

    def key(method: str, partition: str, seed: int) -> str:
        return (f"{method}|{partition}|{seed}|rounds={rounds}|E={epochs}|lr={args.lr:g}|"
                f"W={schedule['warmup_rounds']}|F={schedule['full_rounds_per_cycle']}|"
                f"R={schedule['rounds_per_group']}")

    # partition-major, methods interleaved: machine load hits both alike
    tasks = [(key(method, partition, seed), run,
              (method, partition, seed, rounds, epochs, args.lr, schedule))
             for seed in seeds for partition in partitions for method in METHODS]
    start = time.perf_counter()
    done = run_cached(tasks, args.cache, jobs=args.jobs, budget=args.budget,
                      label=lambda k, r: (f"best {r['best']:.4f} final {r['final']:.4f} "
                                          f"uplink {r['total_bytes'] / 1e6:.2f} MB local "
                                          f"{r['total_seconds']:.0f} CPU s"))
    results = [done[t[0]] for t in tasks if t[0] in done]
    print(f"\nelapsed {time.perf_counter() - start:.0f} s\n")
    print("| partition | method | best acc | final acc | uplink MB (all clients) | "
          "downlink MB (all clients) | local CPU s | TFLOP | seeds |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary: dict[str, dict] = {}
    for partition in partitions:
        rows = {}
        for method in METHODS:
            rs = [r for r in results if r["method"] == method and r["partition"] == partition]
            rows[method] = rs
            if not rs:
                continue
            print(f"| {partition} | {method} | {mean_sd([r['best'] for r in rs])} | "
                  f"{mean_sd([r['final'] for r in rs])} | "
                  f"{statistics.fmean(r['total_bytes'] for r in rs) / 1e6:.2f} | "
                  f"{statistics.fmean(r['total_bytes_down'] for r in rs) / 1e6:.2f} | "
                  f"{statistics.fmean(r['total_seconds'] for r in rs):.1f} | "
                  f"{statistics.fmean(r['total_flops'] for r in rs) / 1e12:.3f} | {len(rs)} |")
        if not (rows["FNU"] and rows["FedPart"]):
            continue

        def ratio(key: str, rows: dict = rows) -> float:
            return (statistics.fmean(r[key] for r in rows["FedPart"])
                    / statistics.fmean(r[key] for r in rows["FNU"]))

        summary[partition] = {
            "bytes_ratio": ratio("total_bytes"),
            "bytes_down_ratio": ratio("total_bytes_down"),
            "compute_ratio_measured": ratio("total_seconds"),
            "compute_ratio_wall": ratio("total_wall"),
            "compute_ratio_flops": ratio("total_flops"),
            **{f"{m.lower()}_{k}": statistics.fmean(r[k] for r in rows[m])
               for m in METHODS for k in ("best", "final")}}
    print("\n| partition | uplink FedPart/FNU | downlink FedPart/FNU | compute (CPU s) | "
          "compute (wall s) | compute (FLOPs) |")
    print("|---|---|---|---|---|---|")
    for partition, s in summary.items():
        print(f"| {partition} | {s['bytes_ratio']:.3f} | {s['bytes_down_ratio']:.3f} | "
              f"{s['compute_ratio_measured']:.3f} | {s['compute_ratio_wall']:.3f} | "
              f"{s['compute_ratio_flops']:.3f} |")
    print(f"| paper (ResNet-8, Table 1) | {PAPER['bytes_ratio']:.2f} | - | - | - | "
          f"{PAPER['compute_ratio']:.2f} (analytic) |")
    f, r = schedule["full_rounds_per_cycle"], schedule["rounds_per_group"]
    print(f"schedule's uplink fraction per cycle (F+R)/(F+R*G) = "
          f"{(f + r) / (f + r * GROUPS):.3f} (before headers and BatchNorm statistics)")
    if results:
        path = args.out / "fedpart.png"
        plot(results, partitions, path, f"FedAvg FNU vs FedAvg + FedPart: {setup} "
                                        f"(mean over seeds)")
        print(f"figure: {path}")
    first = summary.get(partitions[0], {})
    out = {"bench": "fedpart", "dataset": "mnist-5k", "body": BODY, "rounds": rounds,
           "epochs": epochs, "lr": args.lr, "schedule": schedule, "seeds": seeds,
           "bytes_ratio": first.get("bytes_ratio"),
           "compute_ratio_measured": first.get("compute_ratio_measured"),
           "compute_ratio_flops": first.get("compute_ratio_flops"),
           "paper_bytes_ratio": PAPER["bytes_ratio"], "paper_compute_ratio": PAPER["compute_ratio"],
           "per_partition": summary}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
