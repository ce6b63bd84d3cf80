"""Bench: a Flower round against the embedded simulator's round for the same work.

The same experiment (FedLog on digits, 3 clients, iid, seed 0, one torch thread everywhere)
runs in the simulator and on a Flower deployment on 127.0.0.1 (a SuperLink and three
SuperNodes, `bayesfl.flower.local.LocalFederation`), evaluating after every round on
both. A Flower round is one ``train.round`` message per client: it evaluates the previous
round's state and fits; its record's wall time runs from the round's start to its aggregate
(the simulator's round: fit, aggregate, evaluate; the simulator runs once before and once
after the Flower run, and its round is the median over both).

Each training round's wall time is split along its critical path, the message whose reply came
last, from the round's timeline (``metrics.jsonl``, ``flower.timeline``:
`bayesfl.flower.protocol.round_timeline`; every stamp is taken on this machine's clock):

* ``before push``: the server samples, configures and encodes the round;
* ``pull+spawn``: the message waits for its SuperNode's next pull (the hard-coded 3 s sleep
  after an empty pull: the node that replied last in the previous round pulled right after its
  reply, found nothing and slept, so the server's poll, aggregation and checkpoint between two
  rounds are hidden in that sleep), then the SuperExec's task poll (0.2 s under
  `LocalFederation`) starts ``flwr-clientapp``;
* ``flower start``: that process starting Python, importing Flower's command, pulling the task
  and the FAB (about 4 KiB: ``examples/flower_app``'s four files), installing the FAB,
  importing the app (and Flower calling it);
* ``handler``: bayesfl's step, split into ``import`` (torch and the bayesfl modules it needs),
  ``setup`` (data set, partition, strategy), ``eval+fit`` (the training work the simulator does
  too) and ``save+enc`` (the client state kept, the upload encoded);
* ``reply``: the ClientApp pushing its reply to the SuperNode, the SuperNode's 0.5 s wait for
  it, its push to the SuperLink and the ServerApp's 0.2 s poll;
* ``after``: decoding, validating and aggregating the uploads, the evaluation broadcast;
* ``cpu``: the critical message's process's CPU seconds (Flower's start included). The three
  nodes' processes start within the same few seconds and share this machine's cores, so
  ``flower start`` and ``import`` in the run are longer than the same steps measured on their
  own after the run (``process alone``, ``import alone``: medians of three fresh interpreters).

Flower's floor (printed with its figure): the 3 s sleep and a fresh process with Flower's
command per message, which no supported Flower 1.41 API avoids; a ClientApp that trains with
torch also imports torch in every message.

Before anything runs, the bench byte-compiles bayesfl, inference and calibration
(``compileall``), as ``pip install`` does: in an editable checkout under
``PYTHONDONTWRITEBYTECODE=1`` (set on the development machine) every ClientApp process would
otherwise compile the ~130 modules it imports from source again (about 0.4-0.9 s a message);
``--no-compile`` skips that to measure it. The load average (``os.getloadavg``) before and after
is printed with the figures.

The record, with its provenance (`bench.run_cache.append_result`: commit, date, machine,
seeds, torch version, threads, load average before and after), is appended to ``--out``
(default ``bench/results/flower.jsonl``; ``--out ''`` stores nothing); the published table is
``flower`` of ``bench/published_tables.py``. Target (issue 28): a Flower round within 8x of the
simulator's round, with the same pooled ECE.

Usage: ``python bench/flower.py [--rounds 3] [--strategy fedlog] [--no-compile]
[--out bench/results/flower.jsonl]``. Last line: JSON.
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: the repository root goes there instead
ROOT = Path(__file__).resolve().parents[1]
if Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402

from bayesfl.flower.local import LocalFederation  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bench.run_cache import append_result  # noqa: E402

PULL_SLEEP = 3.0
"""A SuperNode's hard-coded sleep after an empty pull (flwr 1.41
``supernode/start_client_internal.py``): every round waits it once, since a node that has
just replied pulls before the server has the next round's message."""

EXPERIMENT = {"dataset": "digits", "clients": 3, "partition": "iid", "seed": 0}


def _fresh_seconds(code: str, repeats: int = 3) -> float:
    """Median over ``repeats`` fresh interpreters of the seconds ``code`` prints."""
    runs = [float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True, cwd=ROOT).stdout.split()[-1])
            for _ in range(repeats)]
    return statistics.median(runs)


# what flwr-clientapp imports before it loads the app (its console script's module)
FLOWER_COMMAND = "flwr.supernode.cli"


def flower_process_seconds(repeats: int = 3) -> float:
    """A fresh interpreter starting and importing Flower's ``flwr-clientapp`` command (the
    wall time of the process as its parent sees it)."""
    return _fresh_seconds(
        "import subprocess, sys, time; t = time.perf_counter(); "
        f"subprocess.run([sys.executable, '-c', 'import {FLOWER_COMMAND}'], check=True); "
        "print(time.perf_counter() - t)", repeats)


def clientapp_import_seconds(repeats: int = 3) -> float:
    """After Flower's command: importing the ClientApp and the modules its handler needs."""
    return _fresh_seconds(
        f"import time, {FLOWER_COMMAND}; t = time.perf_counter(); "
        "from bayesfl.flower.client_app import import_step_modules; import_step_modules(); "
        "print(time.perf_counter() - t)", repeats)


SPLIT = ("before_push", "pull_and_spawn", "flower_start", "import", "setup", "evaluate_and_fit",
         "save_and_encode", "reply", "after_last_reply", "rest")
"""A round's split (module docstring), in the order of its critical path; ``rest`` is what the
others leave of the round's wall time (the handler's own bookkeeping and the server's after the
timeline's end), so the parts add up to the wall time."""


def round_split(record: dict) -> dict:
    """The split of a Flower round's ``metrics.jsonl`` record along its critical path (its
    ``flower.timeline``): the `SPLIT` parts in seconds, ``wall``, ``round``, ``client``
    (whose message it followed) and ``cpu`` (its process's CPU seconds).

    Raises:
        ValueError: the record has no timeline (no reply carried the ClientApp's stamps).
    """
    timeline = record.get("flower", {}).get("timeline")
    if not timeline:
        raise ValueError(f"round {record.get('round')}'s record has no flower.timeline")
    parts = timeline.get("handler_parts", {})

    def part(*names: str, within: dict = timeline) -> float:
        return float(sum(within.get(n, 0.0) for n in names))

    row = {"round": record["round"], "wall": record["seconds"], "client": timeline["client"],
           "cpu": timeline.get("cpu", math.nan),
           "before_push": part("before_push"),
           # the stamp between the two (Flower's delivered_at) does not reach a ClientApp
           "pull_and_spawn": part("pull_wait+spawn", "pull_wait", "spawn"),
           "flower_start": part("flower_start", "app_call"),
           "import": part("import", within=parts), "setup": part("setup", within=parts),
           "evaluate_and_fit": part("evaluate", "fit", within=parts),
           "save_and_encode": part("save", "encode", within=parts),
           "reply": part("reply"), "after_last_reply": part("after_last_reply")}
    row["rest"] = row["wall"] - sum(row[k] for k in SPLIT if k != "rest")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="fedlog")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not byte-compile the packages first (module docstring)")
    parser.add_argument("--out", default="bench/results/flower.jsonl",
                        help="append the JSON record here ('' for nowhere)")
    args = parser.parse_args()
    if not args.no_compile:
        for package in ("bayesfl", "inference", "calibration"):
            compileall.compile_dir(ROOT / package, quiet=1)
    torch.set_num_threads(1)
    load_before = os.getloadavg()

    def simulator_rounds():
        result = simulate(args.strategy, rounds=args.rounds, progress=False, batched=False,
                          threads=1, **EXPERIMENT)
        return result, [m["seconds"] for m in result.metrics if m["round"] >= 1]

    # the simulator runs before and after the Flower run: on a shared machine whose load
    # changes, the median of both is the simulator's round under the Flower run's conditions
    sim, sim_rounds = simulator_rounds()

    with tempfile.TemporaryDirectory(prefix="bayesfl-bench-flower-") as tmp:
        out = Path(tmp) / "run"
        with LocalFederation(3, start_timeout=300.0) as fed:
            status = fed.run({**EXPERIMENT, "strategy": args.strategy, "rounds": args.rounds,
                              "out": str(out), "threads": 1, "evaluate-every": 1,
                              "round-timeout": 600.0, "node-wait": 300.0}, timeout=3600.0,
                             done_marker=out / "summary.json")
        if not status.completed:
            raise SystemExit(f"the Flower run ended as {status.status}: {status.details}")
        records = [json.loads(line) for line in
                   (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
    load_after = os.getloadavg()
    sim_after, rounds_after = simulator_rounds()
    if sim_after.summary["ece"] != sim.summary["ece"]:
        raise SystemExit("the simulator's two runs differ: the bench is not reproducible")
    sim_rounds += rounds_after
    flower_process = flower_process_seconds()
    standalone_import = clientapp_import_seconds()

    rows = [round_split(m) for m in records if m["round"] >= 1]
    flower_round = statistics.median(r["wall"] for r in rows)
    sim_round = statistics.median(sim_rounds)
    ratio = flower_round / sim_round
    print(f"{'round':>5} {'wall s':>7} | {'before':>6} {'pull+':>6} {'flower':>6} | "
          f"{'import':>6} {'setup':>5} {'eval+':>5} {'save+':>5} | {'reply':>5} {'after':>5} "
          f"{'rest':>5} | {'cpu':>5}")
    print(f"{'':>5} {'':>7} | {'push':>6} {'spawn':>6} {'start':>6} | {'':>6} {'':>5} "
          f"{'fit':>5} {'enc':>5} | {'':>5} {'':>5} {'':>5} | {'':>5}")
    for r in rows:
        print(f"{r['round']:>5} {r['wall']:7.2f} | {r['before_push']:6.2f} "
              f"{r['pull_and_spawn']:6.2f} {r['flower_start']:6.2f} | {r['import']:6.2f} "
              f"{r['setup']:5.2f} {r['evaluate_and_fit']:5.2f} {r['save_and_encode']:5.2f} | "
              f"{r['reply']:5.2f} {r['after_last_reply']:5.2f} {r['rest']:5.2f} | "
              f"{r['cpu']:5.2f}")
    print(f"alone, after the run: a fresh flwr-clientapp process with Flower's command "
          f"{flower_process:.2f} s, the handler's imports {standalone_import:.2f} s")
    print(f"simulator round (median of {len(sim_rounds)}): {sim_round:.3f} s; Flower round: "
          f"{flower_round:.2f} s ({ratio:.1f}x); ECE simulator {sim.summary['ece']:.6f} vs "
          f"Flower {summary['ece']:.6f}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    floor = PULL_SLEEP + flower_process
    with_torch = floor + standalone_import
    print(f"Flower's own floor per round: the {PULL_SLEEP:g} s pull sleep + a fresh "
          f"flwr-clientapp process with Flower's command ({flower_process:.2f} s) = "
          f"{floor:.2f} s ({floor / sim_round:.1f}x the simulator round), before any ClientApp "
          f"work; with the imports of a torch ClientApp ({standalone_import:.2f} s): "
          f"{with_torch:.2f} s ({with_torch / sim_round:.1f}x)")
    cpu = statistics.median(r["cpu"] for r in rows)
    cores, nodes = os.cpu_count() or 1, EXPERIMENT["clients"]
    print(f"on this machine a message's process takes {cpu:.2f} CPU s; the {nodes} nodes' "
          f"messages of a round share {cores} core(s): >= {nodes * cpu / cores:.2f} s of the "
          "round while they run, on top of the pull sleep")


    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    result = {
        "bench": "flower", "strategy": args.strategy, "rounds": args.rounds, "clients": 3,
        "simulator_round_s": sim_round, "flower_round_s": flower_round,
        "ratio_flower_over_simulator": ratio,
        **{f"flower_{key.removeprefix('flower_')}_s": median(key) for key in SPLIT},
        "flower_message_cpu_s": cpu,
        "flower_process_alone_s": flower_process, "client_import_alone_s": standalone_import,
        "flower_floor_s": floor, "ratio_flower_floor_over_simulator": floor / sim_round,
        "flower_floor_with_torch_s": with_torch,
        "ratio_flower_floor_with_torch_over_simulator": with_torch / sim_round,
        "ece_simulator": sim.summary["ece"], "ece_flower": summary["ece"],
        "messages_per_client_per_round": 1,
        "byte_compiled": not args.no_compile,
        "load_average_before": load_before[0], "load_average_after": load_after[0],
        "flower_run_s": status.seconds, "rows": rows}
    print(json.dumps(append_result(args.out, result, seeds=[EXPERIMENT["seed"]],
                                   load_before=load_before)))

if __name__ == "__main__":
    main()
