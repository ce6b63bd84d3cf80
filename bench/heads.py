"""Benchmark: every head kind of ``inference.fit_head`` on digits features from a fixed body.

Data: scikit-learn's ``load_digits`` (1,797 8x8 images, 10 classes), split with a fixed seed into
1,297 training and 500 test images. Body: a FIXED random projection + ReLU (64 pixels / 16 ->
128 features, Gaussian weights N(0, 1/64) drawn with seed 0, never trained), then features
standardised with the training mean and std. Heads are fitted on the training features.

Figures per kind: fit time (s), time to predict 1,000 inputs (the 500 test rows twice; timing
only), test accuracy, NLL (nats) and ECE (15 equal-width bins, top label), from the
``calibration`` package when present. Ratios are fit / predict times against the ``laplace``
head measured in the same run. The subnet Laplace kind runs on the body + a linear head whose
weights are the Laplace head's mode (a network at its MAP), with a 300-parameter subnet.

The prior precision shared by the laplace, mfvi, sgld and subnet_laplace heads is chosen on a
grid by the full Laplace log evidence (the conjugate head keeps its own default prior).

Reading the table: with that prior, the posterior is prior-dominated in many directions (marginal
sd up to the prior's 1), so the full Laplace predictive is under-confident (high ECE; its MAP
plug-in is not). SGLD's default step ``0.1 / L`` (``L ≈ 9e3`` here) over 1,500 steps explores only
the data-dominated directions (a prior-dominated one needs ~``2 / (ε λ) ≈ 2e5`` steps), so its
figures stay close to the MAP's; MFVI is mean-field (under-dispersed). Compare them as run here,
not as exact posteriors.

Run: ``python bench/heads.py [--threads N]`` (default 1 intra-op thread: on the shared 2-core
machine, parallel kernels on small tensors stall under load). Prints a table, then one JSON
line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.factory import fit_head
from inference.laplace_head import fit_laplace_head, log_marginal_likelihood

NUM_FEATURES = 128
PRIOR_GRID = (1.0, 3.0, 10.0, 30.0, 100.0)
SEED = 0


def load_features() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(SEED)
    order = torch.randperm(len(labels), generator=gen)
    train, test = order[:1297], order[1297:]
    projection = nn.Linear(64, NUM_FEATURES)
    with torch.no_grad():
        projection.weight.copy_(torch.randn(NUM_FEATURES, 64, generator=gen) / 8.0)
        projection.bias.copy_(torch.randn(NUM_FEATURES, generator=gen) * 0.1)
    raw = torch.relu(projection(pixels)).detach()
    mean, std = raw[train].mean(0), raw[train].std(0).clamp_min(1e-3)
    body = nn.Sequential(projection, nn.ReLU(), Standardise(mean, std))
    for p in body.parameters():
        p.requires_grad_(False)
    features = body(pixels).detach()
    return body, pixels, features, labels, train, test


class Standardise(nn.Module):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    try:
        from calibration.metrics import ece, nll
    except ImportError:  # calibration not built yet: local top-label ECE and NLL
        def nll(p, y):
            return float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean())

        def ece(p, y, n_bins=15):
            conf, pred = p.max(1)
            bins = torch.clamp((conf * n_bins).long(), max=n_bins - 1)
            correct = (pred == y).double()
            total = 0.0
            for b in range(n_bins):
                mask = bins == b
                if mask.any():
                    gap = float(correct[mask].mean() - conf[mask].mean())
                    total += float(mask.sum()) * abs(gap)
            return total / len(y)

    probs = probs.double()
    return {
        "accuracy": float((probs.argmax(1) == labels).double().mean()),
        "nll": float(nll(probs, labels)),
        "ece": float(ece(probs, labels, n_bins=15)),
    }


def choose_prior_precision(x_train: torch.Tensor, y_train: torch.Tensor) -> tuple[float, dict]:
    """Grid search of the shared prior precision by the Laplace log evidence (full Laplace)."""
    evidence = {}
    for precision in PRIOR_GRID:
        post = fit_laplace_head(x_train, y_train, 10, prior_precision=precision)
        evidence[precision] = log_marginal_likelihood(post, x_train, y_train)
    return max(evidence, key=evidence.get), evidence


def main() -> None:
    threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
    torch.set_num_threads(threads)
    body, pixels, features, labels, train, test = load_features()
    x_train, y_train = features[train], labels[train]
    x_test, y_test = features[test], labels[test]
    timing_inputs = torch.cat([x_test, x_test])  # 1,000 rows
    prior_precision, evidence = choose_prior_precision(x_train, y_train)
    print("Laplace log evidence by prior precision: "
          + ", ".join(f"{k:g}: {v:.1f}" for k, v in evidence.items())
          + f"  -> prior_precision = {prior_precision:g}")
    options = {
        "conjugate": {},
        "laplace": {"prior_precision": prior_precision, "structure": "full"},
        "mfvi": {"prior_precision": prior_precision, "num_steps": 2000, "batch_size": 256},
        "sgld": {"prior_precision": prior_precision, "num_samples": 100, "burn_in": 500,
                 "thinning": 10, "batch_size": 256},
    }
    rows = {}
    posts = {}
    for kind, opts in options.items():
        start = time.perf_counter()
        post = fit_head(kind, x_train, y_train, 10, **opts)
        fit_s = time.perf_counter() - start
        post.predict_proba(timing_inputs[:10])  # warm caches (factorisations) before timing
        start = time.perf_counter()
        post.predict_proba(timing_inputs)
        predict_s = time.perf_counter() - start
        rows[kind] = {"fit_s": fit_s, "predict_1000_s": predict_s,
                      **metrics(post.predict_proba(x_test), y_test)}
        posts[kind] = post

    try:
        import inference.subnet  # noqa: F401
    except ImportError:
        pass
    else:
        mode = posts["laplace"].mean.float()  # (10, 129) MAP head, bias in column 0
        head = nn.Linear(NUM_FEATURES, 10)
        with torch.no_grad():
            head.bias.copy_(mode[:, 0])
            head.weight.copy_(mode[:, 1:])
        model = nn.Sequential(body, head)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(pixels[train], y_train), batch_size=256)
        start = time.perf_counter()
        post = fit_head("subnet_laplace", model, loader, subnet_size=300,
                        prior_precision=prior_precision)
        fit_s = time.perf_counter() - start
        timing_pixels = torch.cat([pixels[test], pixels[test]])
        post.predict_proba(timing_pixels[:10])
        start = time.perf_counter()
        post.predict_proba(timing_pixels)
        predict_s = time.perf_counter() - start
        rows["subnet_laplace"] = {"fit_s": fit_s, "predict_1000_s": predict_s,
                                  **metrics(post.predict_proba(pixels[test]), y_test)}

    peer = rows["laplace"]
    for row in rows.values():
        row["fit_vs_laplace"] = row["fit_s"] / peer["fit_s"]
        row["predict_vs_laplace"] = row["predict_1000_s"] / peer["predict_1000_s"]

    print(f"digits: {len(train)} train / {len(test)} test, fixed random-projection+ReLU body, "
          f"m={NUM_FEATURES}, torch threads={torch.get_num_threads()}")
    header = (f"{'head':<15}{'fit s':>9}{'x laplace':>10}{'pred 1k s':>11}{'x laplace':>10}"
              f"{'acc':>8}{'NLL':>8}{'ECE':>8}")
    print(header)
    print("-" * len(header))
    for kind, r in rows.items():
        print(f"{kind:<15}{r['fit_s']:>9.3f}{r['fit_vs_laplace']:>10.2f}{r['predict_1000_s']:>11.4f}"
              f"{r['predict_vs_laplace']:>10.2f}{r['accuracy']:>8.3f}{r['nll']:>8.3f}"
              f"{r['ece']:>8.3f}")
    rounded = {k: {n: round(v, 5) for n, v in r.items()} for k, r in rows.items()}
    print(json.dumps({"benchmark": "heads", "dataset": "digits", "peer": "laplace",
                      "prior_precision": prior_precision, "threads": torch.get_num_threads(),
                      "rows": rounded}))


if __name__ == "__main__":
    main()
