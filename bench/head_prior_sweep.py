"""Benchmark: how much the Laplace head's prior precision matters, and how well its refitted
evidence chooses it (issue 41: can a cheaper criterion replace the refitted evidence?).

The head's fit spends most of its time choosing ``λ``, the prior precision, by the refitted
Laplace evidence (a handful of mode refits, `inference.laplace_marglik`). A cheaper criterion
would choose another ``λ``: the evidence at a fixed curvature (MacKay's fixed point, one
eigendecomposition) landed an order of magnitude higher on S1's heads (`inference.laplace_marglik`),
laplace-torch's ``optimize_prior_precision`` (the evidence at the fixed MAP of ``λ = 1``) lands
lower. This bench
measures what that costs the user: the held-out NLL and ECE of the head at its defaults against
the same head at fixed ``λ`` over a grid, and at laplace-torch's ``λ``.

Data and sizes: those of ``bench/laplace_head_speed.py`` (frozen MNIST MLP features, 100 ReLU
units, 10 classes; the head trains on the first ``n`` rows, scored on the last 1,000).

Run: ``python bench/head_prior_sweep.py [--sizes 250,1000,3000]
[--out bench/results/head_prior_sweep.jsonl]``. One torch thread, ~2 CPU-minutes. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.laplace_head_speed import NUM_CLASSES, TEST_ROWS, features, peer, scores  # noqa: E402
from bench.run_cache import append_result  # noqa: E402
from inference import fit_head  # noqa: E402

#: The fixed prior precisions of the sweep: a factor of about two apart, from below
#: laplace-torch's choices to where the fixed-curvature evidence lands.
GRID = (1.0, 3.0, 6.0, 10.0, 20.0, 40.0, 90.0)


def one_size(phi: torch.Tensor, labels: torch.Tensor, rows: int) -> dict:
    x, y = phi[:rows], labels[:rows]
    x_test, y_test = phi[-TEST_ROWS:], labels[-TEST_ROWS:]
    head = fit_head("laplace", x, y, NUM_CLASSES)
    evidence = {"prior_precision": head.prior_selection.value,
                **scores(head.predict_proba(x_test), y_test)}
    grid = [{"prior_precision": lam,
             **scores(fit_head("laplace", x, y, NUM_CLASSES, prior_precision=lam)
                      .predict_proba(x_test), y_test)} for lam in GRID]
    peer_lam = peer(x, y, x_test, y_test)["prior_precision"]
    at_peer = {"prior_precision": peer_lam,
               **scores(fit_head("laplace", x, y, NUM_CLASSES, prior_precision=peer_lam)
                        .predict_proba(x_test), y_test)}
    return {"rows": rows, "evidence": evidence, "grid": grid, "laplace_torch_lambda": at_peer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="250,1000,3000")
    parser.add_argument("--out", default=None,
                        help="append the JSON record to this file (e.g. "
                             "bench/results/head_prior_sweep.jsonl)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    phi, labels = features(100)
    sizes = []
    for rows in (int(v) for v in args.sizes.split(",")):
        size = one_size(phi, labels, rows)
        sizes.append(size)
        cells = "  ".join(f"λ={g['prior_precision']:g}: {g['nll']:.4f}" for g in size["grid"])
        print(f"n={rows:>5}  evidence λ={size['evidence']['prior_precision']:.3g}: "
              f"{size['evidence']['nll']:.4f}  laplace-torch λ="
              f"{size['laplace_torch_lambda']['prior_precision']:.3g}: "
              f"{size['laplace_torch_lambda']['nll']:.4f}  |  {cells}", flush=True)
    record = append_result(args.out, {"bench": "head_prior_sweep", "sizes": sizes,
                                      "grid": list(GRID)},
                           seeds=[0], load_before=load_before)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
