"""FedAvg full-network updates (FNU) vs FedAvg + FedPart on mnist-5k with the paper's ResNet-8.

The FedPart paper (spec fedpart.md, Table 1) reports, for ResNet-8 on CIFAR with R=2, F=5 and
40 clients, equal or better accuracy than FNU with 28% of its uplink and 73% of its (analytic)
compute. This bench measures the same three things here, in one process, against FedAvg FNU
run with the same seeds, data, body, local training and number of rounds:

* accuracy: best (max over rounds, the paper's "Best Acc.") and final mean client accuracy
  of the global model;
* uplink: the bytes every upload really had on the wire (safetensors, headers included);
* compute: the *measured* CPU time of local training (``seconds_local_updates_cpu``: every
  client's fit, one after another, one torch thread; the wall time, which grows when other
  processes share the machine, is printed beside it) and the *analytic* FLOPs
  (``flops_local``: forward over every layer, backward from the output down to the first
  trainable group, :mod:`bayesfl.flops`).

Setup, scaled to a 2-core machine (stated in the output): mnist-5k (5,000 real MNIST digits,
28x28; 80% training, split over 10 clients), IID and Dirichlet(1.0); ``resnet8:8-16-32`` (the
paper's ResNet-8 structure, stem + three BasicBlocks with BatchNorm and two conv shortcuts, at
1/8 of its widths: G = 10 layer groups with the head), feature_dim 32; Adam lr 3e-3, batch
32, one local epoch (paper: 8); schedule W = F = 2 warm-up / full rounds per cycle, R = 1
round per group, one cycle = 12 rounds (paper: F = 5, R = 2, 25-round cycles), so the
schedule's uplink fraction is (F + R) / (F + R G) = 3 / 12 = 0.25 (paper 7 / 25 = 0.28).
BatchNorm statistics: ``bn_stats="aggregate"`` for both (averaged with the group they belong
to; the evaluated global model has coherent statistics). 3 seeds; ``--quick``: 1 seed, IID.

Figures: accuracy against cumulative uplink bytes and against cumulative measured local
compute (seconds) and analytic FLOPs, mean over seeds, one panel row per partition, saved to
``bench/out/fedpart.png`` (the path is printed). The last line is JSON.

Usage: ``python bench/fedpart.py [--quick] [--seeds 3] [--cycles 1] [--out bench/out]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.simulate import simulate  # noqa: E402
from bayesfl.strategies import StrategyContext, make_strategy  # noqa: E402

BODY = "resnet8:8-16-32"
SCHEDULE = dict(warmup_rounds=2, full_rounds_per_cycle=2, rounds_per_group=1)
COMMON = dict(dataset="mnist-5k", clients=10, body=BODY, feature_dim=32, local_epochs=1,
              lr=3e-3, batch_size=32, test_fraction=0.2, progress=False, threads=1)
PAPER = {"bytes_ratio": 0.28, "compute_ratio": 0.73}
METHODS = {"FNU": ("fedavg", {}), "FedPart": ("fedpart", SCHEDULE)}


def rounds_of(cycles: int, groups: int = 10) -> int:
    w, f, r = (SCHEDULE[k] for k in ("warmup_rounds", "full_rounds_per_cycle",
                                     "rounds_per_group"))
    return w + r * groups + (cycles - 1) * (f + r * groups)


def run(method: str, partition: str, seed: int, rounds: int) -> dict:
    strategy, options = METHODS[method]
    result = simulate(strategy, partition=partition, rounds=rounds, seed=seed,
                      strategy_options=options,
                      **COMMON)
    m = result.metrics
    acc = [r["accuracy"] for r in m]
    return {"method": method, "partition": partition, "seed": seed,
            "accuracy": acc, "bytes": [r["bytes_up"] for r in m],
            "seconds": [r["seconds_local_updates_cpu"] for r in m],
            "wall": [r["seconds_local_updates"] for r in m],
            "flops": [r["flops_local"] for r in m],
            "best": max(acc), "final": acc[-1], "total_bytes": sum(r["bytes_up"] for r in m),
            "total_seconds": sum(r["seconds_local_updates_cpu"] for r in m),
            "total_wall": sum(r["seconds_local_updates"] for r in m),
            "total_flops": sum(r["flops_local"] for r in m)}


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


def plot(results: list[dict], partitions: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_keys = [("bytes", "cumulative uplink (MB)", 1e-6),
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
                x, y = mean_curves(runs, key)
                ax.plot([v * scale for v in x], y, style, ms=3, label=method)
            ax.set_xlabel(label)
            ax.set_ylabel("mean client accuracy")
            ax.set_title(f"{partition}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"FedAvg FNU vs FedAvg + FedPart, mnist-5k, {BODY}, 10 clients "
                 f"(mean over seeds)")
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
    parser.add_argument("--quick", action="store_true", help="1 seed, IID only")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [0] if args.quick else list(range(args.seeds))
    partitions = ["iid"] if args.quick else ["iid", "dirichlet:1.0"]
    rounds = rounds_of(args.cycles)
    context = StrategyContext(10, 32, rounds=rounds, input_shape=(1, 28, 28), bodies=(BODY,),
                              clients=10)
    print(make_strategy("fedpart", context, **SCHEDULE).describe())
    print(f"setup: mnist-5k (80% train), 10 clients, {BODY} (paper's ResNet-8 at 1/8 width), "
          f"{rounds} rounds = {args.cycles} cycle(s) of W=F=2, R=1 (paper: F=5, R=2, "
          f"C=5), 1 local epoch (paper 8), Adam 3e-3, batch 32, bn_stats=aggregate, "
          f"1 torch thread; seeds {seeds}")
    results = []
    start = time.perf_counter()
    for partition in partitions:
        for seed in seeds:
            for method in METHODS:  # interleaved: machine load hits both alike
                r = run(method, partition, seed, rounds)
                results.append(r)
                print(f"  {partition:<14} seed {seed} {method:<8} best {r['best']:.4f} final "
                      f"{r['final']:.4f} uplink {r['total_bytes'] / 1e6:7.2f} MB local "
                      f"{r['total_seconds']:6.1f} CPU s ({r['total_wall']:6.1f} wall s) "
                      f"{r['total_flops'] / 1e12:6.3f} TFLOP",
                      flush=True)
    print(f"\nelapsed {time.perf_counter() - start:.0f} s\n")
    print("| partition | method | best acc | final acc | uplink MB | local CPU s | TFLOP |")
    print("|---|---|---|---|---|---|---|")
    summary: dict[str, dict] = {}
    for partition in partitions:
        rows = {}
        for method in METHODS:
            rs = [r for r in results if r["method"] == method and r["partition"] == partition]
            rows[method] = rs
            print(f"| {partition} | {method} | {mean_sd([r['best'] for r in rs])} | "
                  f"{mean_sd([r['final'] for r in rs])} | "
                  f"{statistics.fmean(r['total_bytes'] for r in rs) / 1e6:.2f} | "
                  f"{statistics.fmean(r['total_seconds'] for r in rs):.1f} | "
                  f"{statistics.fmean(r['total_flops'] for r in rs) / 1e12:.3f} |")

        def ratio(key: str, rows: dict = rows) -> float:
            return (statistics.fmean(r[key] for r in rows["FedPart"])
                    / statistics.fmean(r[key] for r in rows["FNU"]))

        summary[partition] = {
            "bytes_ratio": ratio("total_bytes"),
            "compute_ratio_measured": ratio("total_seconds"),
            "compute_ratio_wall": ratio("total_wall"),
            "compute_ratio_flops": ratio("total_flops"),
            **{f"{m.lower()}_{k}": statistics.fmean(r[k] for r in rows[m])
               for m in METHODS for k in ("best", "final")}}
    print("\n| partition | bytes FedPart/FNU | compute (CPU s) | compute (wall s) | "
          "compute (FLOPs) |")
    print("|---|---|---|---|---|")
    for partition, s in summary.items():
        print(f"| {partition} | {s['bytes_ratio']:.3f} | {s['compute_ratio_measured']:.3f} | "
              f"{s['compute_ratio_wall']:.3f} | {s['compute_ratio_flops']:.3f} |")
    print(f"| paper (ResNet-8, Table 1) | {PAPER['bytes_ratio']:.2f} | - | - | "
          f"{PAPER['compute_ratio']:.2f} (analytic) |")
    print(f"schedule's uplink fraction (F+R)/(F+R*G) = {3 / 12:.3f} (before headers and "
          f"BatchNorm statistics)")
    path = args.out / "fedpart.png"
    plot(results, partitions, path)
    print(f"figure: {path}")
    first = summary[partitions[0]]
    out = {"bench": "fedpart", "dataset": "mnist-5k", "body": BODY, "rounds": rounds,
           "seeds": seeds, "bytes_ratio": first["bytes_ratio"],
           "compute_ratio_measured": first["compute_ratio_measured"],
           "compute_ratio_flops": first["compute_ratio_flops"],
           "paper_bytes_ratio": PAPER["bytes_ratio"], "paper_compute_ratio": PAPER["compute_ratio"],
           "per_partition": summary}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
