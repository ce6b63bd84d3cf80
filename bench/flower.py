"""Bench: a Flower round against the embedded simulator's round for the same work.

The same experiment (FedLog on digits, 3 clients, iid, seed 0, one torch thread everywhere)
runs in the simulator and on a Flower deployment on 127.0.0.1 (a SuperLink and three
SuperNodes, :class:`bayesfl.flower.local.LocalFederation`), evaluating after every round on
both. A Flower round is one ``train.round`` message per client: it evaluates the previous
round's state and fits; its record's wall time runs from the round's start to its aggregate
(the simulator's round: fit, aggregate, evaluate; the simulator runs once before and once
after the Flower run, and its round is the median over both). Per training round it reports the wall
time of each and splits Flower's round (its slowest client) into:

* ``training``: the slowest client's fit and evaluation work and the server's aggregation
  (what the simulator also does);
* ``serialization``: encoding and decoding/validating bayesfl messages (server and client);
* ``client_import``: the ClientApp's handler importing torch and the bayesfl modules it needs
  (from the replies' ``import`` timing when the server records it, else measured here in a
  fresh interpreter that has imported Flower's command first, as ``flwr-clientapp`` has);
* ``client_setup``: the ClientApp loading the data and building the strategy;
* ``flower_process``: a fresh ``flwr-clientapp`` process starting and importing Flower's
  command, measured here on its own (Flower's floor: one process per message);
* ``polling_and_wait``: the rest, also Flower's floor, which bayesfl cannot change with a
  supported API: the SuperNode's hard-coded 3 s sleep after an empty pull, the SuperExec's
  task poll (0.2 s under :class:`~bayesfl.flower.local.LocalFederation`), the SuperNode's 0.5 s
  sleep while it waits for its ClientApp's reply, and the server's 0.2 s poll.

Before anything runs, the bench byte-compiles bayesfl, inference and calibration
(``compileall``), as ``pip install`` does: in an editable checkout under
``PYTHONDONTWRITEBYTECODE=1`` (set on the development machine) every ClientApp process would
otherwise compile the ~130 modules it imports from source again (about 0.4-0.9 s a message);
``--no-compile`` skips that to measure it.

The figures measured on their own (``flower_process``, ``client_import`` when the server does
not record it) are medians of three fresh processes after the run; during the run three
SuperNodes start theirs at once on a shared machine, so the rest is an upper bound of the
polling. The load average (``os.getloadavg``) before and after is printed with the figures.

Usage: ``python bench/flower.py [--rounds 3] [--strategy fedlog] [--no-compile]``. Last line: JSON.
"""

from __future__ import annotations

import argparse
import compileall
import json
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

PULL_SLEEP = 3.0
"""A SuperNode's hard-coded sleep after an empty pull (flwr 1.41
``supernode/start_client_internal.py``): every round waits it once, since a node that has
just replied pulls before the server has the next round's message."""

STATUS_POLL = 20.0
"""Seconds between the harness's ``flwr ls`` polls for the run's final status while the run's
``summary.json`` is not written yet (then it asks at once): each is a fresh ``flwr`` CLI process
of about 1.5 s CPU, which at the default 2 s would take most of a core of this 2-core machine
from the SuperNodes for the whole run."""

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="fedlog")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not byte-compile the packages first (module docstring)")
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
                             poll=STATUS_POLL, done_marker=out / "summary.json")
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

    rows = []
    for m in (r for r in records if r["round"] >= 1):
        f = m["flower"]
        training = f["client_fit"] + f["client_evaluate"] + f["server_aggregate"]
        serialization = f["server_encode"] + f["server_decode_validate"] + f["client_encode"]
        imports = f.get("client_import", standalone_import)
        setup = f["client_setup"]
        rest = m["seconds"] - training - serialization - imports - setup - flower_process
        rows.append({"round": m["round"], "wall": m["seconds"], "training": training,
                     "serialization": serialization, "client_import": imports,
                     "client_setup": setup, "flower_process": flower_process,
                     "polling_and_wait": rest, "server_polling_wait": f["round_polling"]})
    flower_round = statistics.median(r["wall"] for r in rows)
    sim_round = statistics.median(sim_rounds)
    ratio = flower_round / sim_round
    print(f"{'round':>5} {'wall s':>8} {'training':>9} {'serial.':>8} {'import':>7} "
          f"{'setup':>6} {'process':>8} {'polling+wait':>13}")
    for r in rows:
        print(f"{r['round']:>5} {r['wall']:8.2f} {r['training']:9.2f} "
              f"{r['serialization']:8.4f} {r['client_import']:7.2f} {r['client_setup']:6.2f} "
              f"{r['flower_process']:8.2f} {r['polling_and_wait']:13.2f}")
    print(f"simulator round (median of {len(sim_rounds)}): {sim_round:.3f} s; Flower round: "
          f"{flower_round:.2f} s ({ratio:.1f}x); ECE simulator {sim.summary['ece']:.6f} vs "
          f"Flower {summary['ece']:.6f}; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    floor = PULL_SLEEP + flower_process
    print(f"Flower's own floor per round: the {PULL_SLEEP:g} s pull sleep + a fresh "
          f"flwr-clientapp process with Flower's command ({flower_process:.2f} s) = "
          f"{floor:.2f} s ({floor / sim_round:.1f}x the simulator round before any bayesfl "
          "work; polls of 0.2-0.5 s come on top)")
    print("import" + (" from the replies" if "client_import" in records[-1]["flower"] else
                      " and process measured on their own after the run (module docstring)"))

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(json.dumps({
        "bench": "flower", "strategy": args.strategy, "rounds": args.rounds, "clients": 3,
        "simulator_round_s": sim_round, "flower_round_s": flower_round,
        "ratio_flower_over_simulator": ratio,
        "flower_training_s": median("training"),
        "flower_serialization_s": median("serialization"),
        "flower_client_import_s": median("client_import"),
        "flower_client_setup_s": median("client_setup"),
        "flower_process_start_s": flower_process,
        "flower_polling_and_wait_s": median("polling_and_wait"),
        "flower_floor_s": floor, "ratio_flower_floor_over_simulator": floor / sim_round,
        "ece_simulator": sim.summary["ece"], "ece_flower": summary["ece"],
        "messages_per_client_per_round": 1,
        "byte_compiled": not args.no_compile,
        "load_average_before": load_before[0], "load_average_after": load_after[0],
        "flower_run_s": status.seconds}))


if __name__ == "__main__":
    main()
