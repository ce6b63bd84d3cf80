"""Benchmark: are the Bayesian heads better calibrated than the network they sit on? (issue 12)

Setting: scikit-learn's ``load_digits`` (1,797 8x8 images / 16, 10 classes), a stratified 70/30
split (``train_test_split(..., random_state=SEED)``), a 64-200-50-10 ReLU MLP trained with Adam
(lr 1e-3, batch 32, 30 epochs, ``torch.manual_seed(SEED)``). Features are the last hidden layer
(50 ReLU units) of the trained network. Peer: the network's own softmax, measured in the same run.

Every head is a row of `HEADS`: ``inference.fit_head(kind, train_features, train_labels,
10, **options)`` (options empty: the defaults), then on the test features its default predictive
(``predict_proba(x)``) and its MAP plug-in (``row.plugin``; ``predict_proba(x, method="map")``
unless the row says otherwise). Figures: accuracy, ECE (15 equal-width bins, top label), NLL
(nats) and mean confidence, from the ``calibration`` package.

Acceptance (issue 12), per head, on its default predictive: ECE <= 0.03, NLL <= 1.5 x the
network's NLL, and NLL no worse than the head's own MAP plug-in.

Run: ``python bench/heads_calibration.py [--seed 0] [--epochs 30] [--out
bench/results/heads_calibration.jsonl]`` (the table of docs/inference.md is generated from the
newest record of each seed there). One intra-op thread (small
tensors on a shared 2-core machine). Prints a table, then, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# `python bench/x.py` puts bench/ first on sys.path, where bench/calibration.py would shadow the
# calibration package: use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.run_cache import append_result  # noqa: E402
from calibration.metrics import ece, nll  # noqa: E402
from inference.factory import fit_head  # noqa: E402

SEED = 0
HIDDEN = (200, 50)
NUM_CLASSES = 10
ECE_LIMIT = 0.03
NLL_RATIO_LIMIT = 1.5


def map_plugin(posterior: Any, features: Tensor) -> Tensor:
    """Softmax at the posterior's mean / mode (every Gaussian and conjugate head)."""
    return posterior.predict_proba(features, method="map")


@dataclass(frozen=True)
class HeadRow:
    """One head of the table: ``fit_head(kind, ..., **options)``; ``plugin`` gives its MAP
    plug-in probabilities ``(B, C)`` from the fitted posterior and test features."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    plugin: Callable[[Any, Tensor], Tensor] = map_plugin
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.kind


#: The heads, one row each, with their defaults. Add a head by appending a row.
HEADS: list[HeadRow] = [
    HeadRow("laplace"),
    HeadRow("conjugate"),
    HeadRow("mfvi"),  # MAP plug-in: softmax at the variational mean
    HeadRow("sgld"),  # MAP plug-in: softmax at the mean of the draws
]


@dataclass(frozen=True)
class Setting:
    """Trained network and its features: ``x_*`` pixels, ``f_*`` last-hidden features."""

    network: nn.Module
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    f_train: Tensor
    f_test: Tensor


def digits_split(seed: int = SEED) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stratified 70/30 split of digits; pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data / 16.0, digits.target, test_size=0.3,
                                              random_state=seed, stratify=digits.target)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def train_network(x: Tensor, y: Tensor, hidden: tuple[int, ...] = HIDDEN, epochs: int = 30,
                  batch_size: int = 32, lr: float = 1e-3, seed: int = SEED) -> nn.Sequential:
    """A ReLU MLP ``64-hidden-10`` trained by Adam on cross-entropy (seeded)."""
    torch.manual_seed(seed)
    widths = (x.shape[1], *hidden)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    network = nn.Sequential(*layers, nn.Linear(widths[-1], NUM_CLASSES))
    optimiser = torch.optim.Adam(network.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=gen).split(batch_size):
            optimiser.zero_grad()
            nn.functional.cross_entropy(network(x[batch]), y[batch]).backward()
            optimiser.step()
    return network.eval()


def make_setting(seed: int = SEED, epochs: int = 30, hidden: tuple[int, ...] = HIDDEN
                 ) -> Setting:
    x_tr, y_tr, x_te, y_te = digits_split(seed)
    network = train_network(x_tr, y_tr, hidden, epochs, seed=seed)
    body = network[:-1]
    with torch.no_grad():
        return Setting(network, x_tr, y_tr, x_te, y_te, body(x_tr), body(x_te))


def scores(probs: Tensor, labels: Tensor) -> dict[str, float]:
    probs = probs.double()
    return {
        "accuracy": float((probs.argmax(1) == labels).double().mean()),
        "ece": ece(probs, labels, n_bins=15),
        "nll": nll(probs, labels),
        "confidence": float(probs.max(1).values.mean()),
    }


def evaluate_heads(setting: Setting, heads: list[HeadRow] = HEADS) -> dict[str, dict]:
    """Network row plus, per head, its default predictive, MAP plug-in and fit time."""
    with torch.no_grad():
        network_probs = torch.softmax(setting.network(setting.x_test), dim=1)
    rows: dict[str, dict] = {"network": scores(network_probs, setting.y_test)}
    for head in heads:
        start = time.perf_counter()
        post = fit_head(head.kind, setting.f_train, setting.y_train, NUM_CLASSES, **head.options)
        fit_s = time.perf_counter() - start
        default = scores(post.predict_proba(setting.f_test), setting.y_test)
        plugin = scores(head.plugin(post, setting.f_test), setting.y_test)
        rows[head.name] = {"default": default, "map_plugin": plugin, "fit_s": fit_s,
                           "accepted": accepted(default, plugin, rows["network"]),
                           "fit": fit_summary(post)}
    return rows


def accepted(default: dict[str, float], plugin: dict[str, float],
             network: dict[str, float]) -> bool:
    """Issue 12's acceptance for one head's default predictive."""
    return (default["ece"] <= ECE_LIMIT and default["nll"] <= NLL_RATIO_LIMIT * network["nll"]
            and default["nll"] <= plugin["nll"])


def fit_summary(post: Any) -> dict[str, Any]:
    """What the fit chose (``prior_selection``, ``feature_scale_selection``, ...: every
    ``*_selection`` attribute of the posterior with a ``summary()``)."""
    summary: dict[str, Any] = {}
    for name in dir(post):
        value = getattr(post, name, None) if name.endswith("_selection") else None
        if value is not None and hasattr(value, "summary"):
            summary[name] = value.summary()
    return summary


def print_table(rows: dict[str, dict]) -> None:
    print("| head | predictive | accuracy | ECE | NLL | mean confidence | accepted |")
    print("|---|---|---|---|---|---|---|")
    net = rows["network"]
    print(f"| network | softmax | {net['accuracy']:.4f} | {net['ece']:.4f} | {net['nll']:.4f} | "
          f"{net['confidence']:.3f} | |")
    for name, row in rows.items():
        if name == "network":
            continue
        for label, key in (("default", "default"), ("MAP plug-in", "map_plugin")):
            s = row[key]
            mark = ("yes" if row["accepted"] else "NO") if key == "default" else ""
            print(f"| {name} | {label} | {s['accuracy']:.4f} | {s['ece']:.4f} | {s['nll']:.4f} | "
                  f"{s['confidence']:.3f} | {mark} |")
    for name, row in rows.items():
        if name != "network" and row["fit"]:
            print(f"{name}: fit {row['fit_s']:.2f} s, {json.dumps(row['fit'])}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", default=None,
                        help="append the record, with its provenance, to this file (e.g. "
                             "bench/results/heads_calibration.jsonl: the table of "
                             "docs/inference.md is generated from it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    setting = make_setting(args.seed, args.epochs)
    rows = evaluate_heads(setting)
    print(f"digits, 64-200-50 ReLU MLP, 70/30 split, Adam {args.epochs} epochs, seed {args.seed}; "
          f"test n = {len(setting.y_test)}; ECE with 15 bins\n")
    print_table(rows)
    figures: dict[str, Any] = {f"network_{k}": v for k, v in rows["network"].items()}
    for name, row in rows.items():
        if name == "network":
            continue
        for key in ("default", "map_plugin"):
            figures.update({f"{name}_{key}_{k}": v for k, v in row[key].items()})
        figures[f"{name}_nll_ratio_vs_network"] = row["default"]["nll"] / rows["network"]["nll"]
        figures[f"{name}_accepted"] = row["accepted"]
    append_result(args.out, {"bench": "heads_calibration", "epochs": args.epochs,
                             "test_rows": len(setting.y_test), "rows": rows},
                  seeds=[args.seed], load_before=load_before)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
