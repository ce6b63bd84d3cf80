"""Bench: a Flower round against the embedded simulator's round for the same work.

The same experiment (FedLog on digits, 3 clients, iid, seed 0, one torch thread everywhere)
runs in the simulator and on a Flower deployment on 127.0.0.1 (a SuperLink and three
SuperNodes, :class:`bayesfl.flower.local.LocalFederation`), evaluating after every round on
both. A Flower round is one ``train.round`` message per client: it evaluates the previous
round's state and fits; its record's wall time runs from the round's start to its aggregate
(the simulator's round: fit, aggregate, evaluate). Per training round it reports the wall
time of each and splits Flower's into:

* ``training``: the slowest client's fit and evaluation work and the server's aggregation
  (what the simulator also does);
* ``serialization``: encoding and decoding/validating bayesfl messages (server and client);
* ``client_setup``: the ClientApp loading the data and building the strategy;
* ``polling_and_processes``: the rest: Flower's floor, which bayesfl cannot change with a
  supported API: the SuperNode's hard-coded 3 s sleep after an empty pull, the SuperExec's
  1 s task poll, and a fresh ClientApp process per message (``flwr-clientapp`` imported, then
  torch and bayesfl, and ``torch._dynamo`` on the first ``torch.optim`` construction);
  ``process_start`` measures one import of the ClientApp on its own for scale.

Usage: ``python bench/flower.py [--rounds 3] [--strategy fedlog]``. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: the repository root goes there instead
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bayesfl.flower.local import LocalFederation  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402

EXPERIMENT = {"dataset": "digits", "clients": 3, "partition": "iid", "seed": 0}


def process_start_seconds() -> float:
    """Wall time of a fresh interpreter importing the ClientApp (what every message costs)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import bayesfl.flower.client_app"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategy", default="fedlog")
    args = parser.parse_args()
    torch.set_num_threads(1)

    sim = simulate(args.strategy, rounds=args.rounds, progress=False, batched=False,
                   threads=1, **EXPERIMENT)
    sim_rounds = [m["seconds"] for m in sim.metrics if m["round"] >= 1]

    with tempfile.TemporaryDirectory(prefix="bayesfl-bench-flower-") as tmp:
        out = Path(tmp) / "run"
        with LocalFederation(3, start_timeout=300.0) as fed:
            status = fed.run({**EXPERIMENT, "strategy": args.strategy, "rounds": args.rounds,
                              "out": str(out), "threads": 1, "evaluate-every": 1,
                              "round-timeout": 600.0, "node-wait": 300.0}, timeout=3600.0)
        if not status.completed:
            raise SystemExit(f"the Flower run ended as {status.status}: {status.details}")
        records = [json.loads(line) for line in
                   (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
    spawn = process_start_seconds()

    rows = []
    for m in (r for r in records if r["round"] >= 1):
        f = m["flower"]
        training = f["client_fit"] + f["client_evaluate"] + f["server_aggregate"]
        serialization = f["server_encode"] + f["server_decode_validate"] + f["client_encode"]
        setup = f["client_setup"]
        rest = m["seconds"] - training - serialization - setup
        rows.append({"round": m["round"], "wall": m["seconds"], "training": training,
                     "serialization": serialization, "client_setup": setup,
                     "polling_and_processes": rest, "server_polling_wait": f["round_polling"]})
    flower_round = statistics.median(r["wall"] for r in rows)
    sim_round = statistics.median(sim_rounds)
    print(f"{'round':>5} {'wall s':>8} {'training':>9} {'serial.':>8} {'setup':>7} "
          f"{'polling+procs':>14}")
    for r in rows:
        print(f"{r['round']:>5} {r['wall']:8.2f} {r['training']:9.2f} "
              f"{r['serialization']:8.4f} {r['client_setup']:7.2f} "
              f"{r['polling_and_processes']:14.2f}")
    print(f"simulator round (median of {len(sim_rounds)}): {sim_round:.3f} s; Flower round: "
          f"{flower_round:.2f} s ({flower_round / sim_round:.0f}x); one ClientApp process "
          f"start: {spawn:.2f} s; ECE simulator {sim.summary['ece']:.6f} vs Flower "
          f"{summary['ece']:.6f}")

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(json.dumps({
        "bench": "flower", "strategy": args.strategy, "rounds": args.rounds, "clients": 3,
        "simulator_round_s": sim_round, "flower_round_s": flower_round,
        "ratio_flower_over_simulator": flower_round / sim_round,
        "flower_training_s": median("training"),
        "flower_serialization_s": median("serialization"),
        "flower_client_setup_s": median("client_setup"),
        "flower_polling_and_processes_s": median("polling_and_processes"),
        "clientapp_process_start_s": spawn,
        "ece_simulator": sim.summary["ece"], "ece_flower": summary["ece"],
        "messages_per_client_per_round": 1,
        "flower_run_s": status.seconds}))


if __name__ == "__main__":
    main()
