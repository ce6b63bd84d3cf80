"""S1 conformal prediction sets (issue 45): coverage per client and set size of federated
split-conformal sets, the recommended Bayesian configuration against its plug-in and FedAvg-FT,
in distribution and under rotation and unseen labels.

S1 (`bench.fedsi_small`'s ``COMMON``): ``mnist-5k``, 10 clients, ``labels:5:train=50``,
MLP 784-100-10, batch 50, 30 rounds of 5 local epochs, lr 1e-3. Every run holds out 20% of each
client's training rows (``conformal=``, the run step) for the threshold. After training, for
alpha in {0.05, 0.1}, every score (LAC, APS, RAPS; not randomised) and the three thresholds
(``exact``: the pooled threshold over counts; ``one-shot``: FedCP-QQ, whose bound assumes
exchangeable clients; ``sketch``: the one-shot quantile sketch, at or above the pooled
threshold), the run's own conformal step (`bayesfl.conformal.conformal_run`,
the federated protocol with its messages and byte counts) calibrates on the clean held-out rows,
and every client forms its sets on:

* its own test rows (in distribution: the coverage guarantee applies);
* the same rows rotated by 30 and 60 degrees (bilinear, corners filled with the data's minimum,
  as `bayesfl.evaluate_shift` rotates) - the threshold is the clean one, as a deployed
  model's would be;
* the test rows of every client whose label it never trained on ("unseen labels").

Per condition: pooled coverage, the lowest client coverage, clients below the target, mean set
size; for the headline predictive and, where the method has one, its MAP plug-in. The peer
named in the ratio: the recommended configuration's mean set size at alpha = 0.1 over its
plug-in's (< 1: the posterior's sets are smaller at the same guarantee).

Usage: ``python bench/s1_conformal.py [--seeds 0,1,2] [--rounds 30] [--labels ...]
[--scores lac,aps,raps]``; one JSON line per (method, seed, score) is appended to
``bench/results/s1_conformal.jsonl`` (a run already there with the sketch threshold is
skipped); the last line printed is the JSON summary (the ratio on APS).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.conformal import (  # noqa: E402
    PREDICTIVES,
    ConformalClient,
    conformal_run,
    parse_conformal,
    result_message,
)
from bayesfl.data.datasets import load_dataset  # noqa: E402
from bayesfl.engine.setup import run_setup  # noqa: E402
from bayesfl.shifts import apply_shift, image_shape_of  # noqa: E402
from bayesfl.simulate import simulate  # noqa: E402
from bench.fedsi_small import COMMON  # noqa: E402
from bench.run_cache import provenance, read_jsonl  # noqa: E402
from calibration.conformal import CoverageAccumulator  # noqa: E402

CACHE = Path("bench/results/s1_conformal.jsonl")
METHODS = {  # label -> (strategy, options)
    "FedAvg-FT + head=laplace": ("fedavg-ft", {"head": "laplace"}),
    "FedAvg-FT": ("fedavg-ft", {}),
}
ALPHAS = (0.05, 0.1)
THRESHOLDS = ("exact", "one-shot", "sketch")
ROTATIONS = (30.0, 60.0)
SCORES = ("lac", "aps", "raps")


def _figures(accs: dict[int, CoverageAccumulator], target: float) -> dict:
    pooled = None
    covers = []
    for acc in accs.values():
        pooled = CoverageAccumulator(acc.num_classes).merge(acc) if pooled is None \
            else pooled.merge(acc)
        covers.append(acc.compute()["coverage"])
    figures = pooled.compute()
    return {"coverage": figures["coverage"], "mean_set_size": figures["mean_set_size"],
            "rows": figures["count"], "client_min": min(covers),
            "clients_below": sum(c < target for c in covers),
            "per_client": [round(c, 4) for c in covers]}


def measure(label: str, seed: int, rounds: int, epochs: int,
            scores: tuple[str, ...] = SCORES) -> list[dict]:
    """One training of ``label`` at ``seed``; one record per score."""
    strategy, options = METHODS[label]
    t0 = time.perf_counter()
    result = simulate(strategy, rounds=rounds, seed=seed, local_epochs=epochs, lr=1e-3,
                      strategy_options=options, conformal="aps:0.1", **COMMON)
    train_s = time.perf_counter() - t0
    config = result.config
    dataset = load_dataset(config.dataset, seed=config.data_rng_seed, **config.dataset_options)
    setup = run_setup(config, dataset, torch.device("cpu"))  # the run's own hold-out, rebuilt
    held_out = setup.held_out
    clients = result.clients
    for c in clients:  # the rebuilt split is the run's
        assert torch.equal(setup.client_data[c.client_id].train_y, c.data.train_y)
    image_shape = image_shape_of(tuple(dataset.input_shape), config.dataset)
    train_x = torch.cat([c.data.train_x for c in clients])
    data_range = (float(train_x.min()), float(train_x.max()))
    pooled_x = torch.cat([c.data.test_x for c in clients])
    pooled_y = torch.cat([c.data.test_y for c in clients])
    num_classes = result.strategy.num_classes

    def predict(k: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = result.strategy.predict(clients[k].config, result.client_state(k),
                                          result.evaluation_broadcast, x)
        return {key: v.to(torch.float64).cpu() for key, v in out.items() if key in PREDICTIVES}

    # every client's test rows under each condition, predicted once
    conditions: dict[str, dict[int, tuple[dict, torch.Tensor]]] = {"clean": {}}
    for deg in ROTATIONS:
        conditions[f"rotate {deg:g}"] = {}
    conditions["unseen labels"] = {}
    for c in clients:
        k = c.client_id
        x, y = c.data.test_x, c.data.test_y
        conditions["clean"][k] = (predict(k, x), y)
        for deg in ROTATIONS:
            shifted = apply_shift("rotate", deg, x, image_shape=image_shape,
                                  data_range=data_range)
            conditions[f"rotate {deg:g}"][k] = (predict(k, shifted), y)
        unseen = ~torch.isin(pooled_y, torch.unique(c.data.train_y))
        if bool(unseen.any()):
            conditions["unseen labels"][k] = (predict(k, pooled_x[unseen]), pooled_y[unseen])

    held_probs = {k: predict(k, h.x) for k, h in held_out.items()}
    records = [_score_record(label, seed, rounds, epochs, score, result, clients, held_out,
                             held_probs, conditions, setup, num_classes) for score in scores]
    for record in records:
        record.update(provenance())
        record["seconds"] = round(time.perf_counter() - t0, 1)
        record["train_seconds"] = round(train_s, 1)
    return records


def _score_record(label: str, seed: int, rounds: int, epochs: int, score: str, result,
                  clients, held_out, held_probs, conditions, setup, num_classes) -> dict:
    strategy, options = METHODS[label]
    record: dict = {"label": label, "strategy": strategy, "options": options, "seed": seed,
                    "rounds": rounds, "epochs": epochs, "score": score,
                    "held_out_rows": sum(h.size for h in held_out.values()),
                    "accuracy": float(result.summary["accuracy"]), "results": []}
    for alpha in ALPHAS:
        for method in THRESHOLDS:
            spec = parse_conformal(f"{score}:{alpha}:{method}")
            outcome = conformal_run(result.strategy, clients, held_out,
                                    result.evaluation_broadcast, spec=spec,
                                    held_out_fraction=setup.held_out_fraction, run_seed=seed,
                                    states=result.personalized or None)
            summary = outcome.summary()
            entry = {"alpha": alpha, "method": method, "bytes_up": summary["bytes_up"],
                     "bytes_up_per_client": summary["bytes_up_per_client"],
                     "bytes_down": summary["bytes_down"], "steps": summary["steps"],
                     "predictives": {}}
            result_msg = result_message(outcome.search.steps, outcome.search.thresholds)
            halves = {k: ConformalClient.from_probabilities(k, held_probs[k], held_out[k].y,
                                                            spec, seed) for k in held_out}
            for i, key in enumerate(PREDICTIVES):
                if key not in summary["predictives"]:
                    continue
                p = summary["predictives"][key]
                per: dict = {"threshold": p["threshold"],
                             "coverage_bound": p.get("coverage_bound"),
                             "coverage_upper_bound": p.get("coverage_upper_bound")}
                for name, rows in conditions.items():
                    accs = {}
                    for k, (probs, y) in rows.items():
                        reply = halves[k].evaluate(result_msg, probs, y, num_classes)
                        accs[k] = CoverageAccumulator.from_state_dict(
                            {"counts": reply.tensors["counts"][i],
                             "size_counts": reply.tensors["size_counts"][i]})
                    per[name] = _figures(accs, 1 - alpha)
                # the run step's own clean figures must be these
                assert per["clean"]["coverage"] == p["coverage"]
                entry["predictives"][key] = per
            record["results"].append(entry)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--labels", default=",".join(METHODS))
    parser.add_argument("--scores", default=",".join(SCORES))
    parser.add_argument("--cache", default=str(CACHE))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cache = Path(args.cache)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label in args.labels.split(","):
            done = {(r["label"], r["seed"], r["rounds"], r["score"])
                    for r in read_jsonl(cache) if "sketch" in {e["method"] for e in r["results"]}}
            scores = tuple(s for s in args.scores.split(",")
                           if (label, seed, args.rounds, s) not in done)
            if not scores:
                print(f"{label} seed {seed}: cached", flush=True)
                continue
            records = measure(label, seed, args.rounds, args.epochs, scores)
            with cache.open("a") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
            for record, entry in ((r, e) for r in records for e in r["results"]):
                for key, per in entry["predictives"].items():
                    print(f"{label} seed {seed} {record['score']} a={entry['alpha']} "
                          f"{entry['method']:8s} "
                          f"{key:10s} clean cov {per['clean']['coverage']:.4f} size "
                          f"{per['clean']['mean_set_size']:.2f} | rot60 cov "
                          f"{per['rotate 60']['coverage']:.3f} size "
                          f"{per['rotate 60']['mean_set_size']:.2f} | unseen cov "
                          f"{per['unseen labels']['coverage']:.3f} size "
                          f"{per['unseen labels']['mean_set_size']:.2f} "
                          f"({entry['bytes_up_per_client']:.0f} B up/client)", flush=True)
    records = [r for r in read_jsonl(cache) if r["rounds"] == args.rounds]
    summary = {}
    for label in METHODS:
        for key in PREDICTIVES:
            sizes = [e["predictives"][key]["clean"]["mean_set_size"]
                     for r in records if r["label"] == label and r["score"] == "aps"
                     for e in r["results"]
                     if e["alpha"] == 0.1 and e["method"] == "exact"
                     and key in e["predictives"]]
            if sizes:
                summary[f"{label}/{key}/size_a0.1"] = sum(sizes) / len(sizes)
    head = summary.get("FedAvg-FT + head=laplace/predictive/size_a0.1")
    plug = summary.get("FedAvg-FT + head=laplace/map_plugin/size_a0.1")
    if head and plug:
        print(f"mean set size at alpha 0.1, posterior / its plug-in: {head / plug:.3f}")
        summary["ratio_posterior_over_plugin"] = head / plug
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
