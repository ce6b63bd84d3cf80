"""Why FedLog's posterior predictive equals its MAP plug-in on S1, and whether a tempered
posterior chosen on held-out rows changes that (issue 40, task 2).

Takes run directories written by ``bench/s1_shift.py --runs DIR`` (FedLog runs) and, for every
run: the MAP logits' magnitude (the gap between the two largest logits) against the Laplace
posterior's logit standard deviation on the clients' own test rows, clean and rotated by 30 and
60 degrees, and on the unseen-label rows; then the probit predictive of the posterior tempered by
T (``N(W*, T H^-1)``: the summed statistics and count divided by T, the likelihood raised to
1/T; the MAP and so the plug-in are unchanged up to the prior's pseudo-count) on a grid of T,
with T chosen by the pooled NLL of the clients' held-out slices (``feature_scale="heldout"``
runs; never the test rows), scored on the test rows: NLL clean/30/60 and the unseen-label AUROC
of the predictive entropy, against the plug-in.

Usage: ``python bench/s1_posterior_spread.py RUN_DIR [RUN_DIR ...]``; prints one JSON line per
run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])

from bayesfl.loaded_run import load_run  # noqa: E402
from bayesfl.shift_evaluation import _run_data  # noqa: E402
from bayesfl.shifts import data_range, rotate  # noqa: E402
from bayesfl.strategies.networks import batched_apply  # noqa: E402
from calibration import auroc, ood_scores  # noqa: E402
from inference.conjugate.laplace import ConjugateLaplace  # noqa: E402

TEMPERATURES = tuple(10.0 ** (k / 4) for k in range(0, 21))  # 1 .. 1e5
SHAPE = (1, 28, 28)


def nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    return float(-probs[torch.arange(len(y)), y].clamp(min=1e-12).log().mean())


def probit(posterior, x: torch.Tensor, temperature: float) -> torch.Tensor:
    """Probit predictive of the posterior tempered by ``temperature`` for augmented rows x."""
    laplace = posterior.laplace()
    tempered = ConjugateLaplace(laplace.mean, laplace.N / temperature)
    mean, var = tempered.logit_moments(x * posterior._column_scale)
    return torch.softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=1)


def analyse(run_dir: Path) -> dict:
    run = load_run(run_dir)
    strategy = run.strategy
    posterior = strategy.head_posterior(run.evaluation_broadcast)
    dataset, clients = _run_data(run, None)
    low = data_range(dataset.x)[0]
    rows: dict[str, list] = {k: [] for k in ("clean", "30", "60", "held", "ood")}
    labels: dict[str, list] = {k: [] for k in rows}
    owner_in, owner_ood = [], []
    pooled_x = torch.cat([d.test_x for d in clients])
    pooled_y = torch.cat([d.test_y for d in clients])
    for k, data in enumerate(clients):
        model = strategy.client_model(run.clients[k].config, run.client_state(k))

        def feats(x, model=model):
            with torch.no_grad():
                f = batched_apply(model, x).to(torch.float64)
            return torch.cat([torch.ones_like(f[:, :1]), f], 1)

        rows["clean"].append(feats(data.test_x))
        labels["clean"].append(data.test_y)
        for deg in (30, 60):
            rows[str(deg)].append(feats(rotate(data.test_x, deg, SHAPE, fill=low)))
            labels[str(deg)].append(data.test_y)
        if getattr(strategy, "heldout", False):
            held = strategy.split_heldout(data)[1]
            rows["held"].append(feats(held.train_x))
            labels["held"].append(held.train_y)
        seen = torch.unique(data.train_y)
        outside = ~torch.isin(pooled_y, seen)
        rows["ood"].append(feats(pooled_x[outside]))
        labels["ood"].append(pooled_y[outside])
        owner_in.append(torch.full((len(data.test_y),), k))
        owner_ood.append(torch.full((int(outside.sum()),), k))
    x = {k: torch.cat(v) for k, v in rows.items() if v}
    y = {k: torch.cat(v) for k, v in labels.items() if v}
    W = posterior.map()
    out: dict = {"run": str(run_dir), "feature_scale": posterior.feature_scale,
                 "N": posterior.natural_count, "prior_nu": posterior.prior.nu}
    laplace = posterior.laplace()
    for name in ("clean", "30", "60", "ood"):
        logits = x[name] @ W.T
        top2 = logits.topk(2, dim=1).values
        gap = top2[:, 0] - top2[:, 1]
        _, var = laplace.logit_moments(x[name] * posterior._column_scale)
        sd = var.sqrt()
        top = logits.argmax(1)
        sd_top = sd[torch.arange(len(top)), top]
        out[f"spread/{name}"] = {
            "median_gap": float(gap.median()), "median_sd_top": float(sd_top.median()),
            "median_sd_over_gap": float((sd_top / gap.clamp(min=1e-9)).median()),
            "median_feature_norm": float(x[name][:, 1:].norm(dim=1).median()),
        }
    plugin = {n: torch.softmax(x[n] @ W.T, 1) for n in x}

    def figures(probs: dict) -> dict:
        result = {f"nll/{n}": nll(probs[n], y[n]) for n in ("clean", "30", "60")}
        scores = torch.cat([ood_scores(probs["clean"]), ood_scores(probs["ood"])])
        flags = torch.cat([torch.zeros(len(probs["clean"])), torch.ones(len(probs["ood"]))])
        result["auroc_entropy"] = auroc(scores, flags.bool())
        return result

    out["plugin"] = figures(plugin)
    grid = []
    for t in TEMPERATURES:
        probs = {n: probit(posterior, x[n], t) for n in x}
        entry = {"T": t, **figures(probs)}
        if "held" in x:
            entry["nll/held"] = nll(probs["held"], y["held"])
        grid.append(entry)
    out["tempered"] = grid
    if "held" in x:
        best = min(grid, key=lambda e: e["nll/held"])
        out["chosen_T"] = best
        out["held_nll_plugin"] = nll(plugin["held"], y["held"])
        out["joint"] = joint_choice(run, posterior, x, y, figures)
    return out


def joint_choice(run, posterior, x: dict, y: dict, figures) -> dict:
    """(s, T) chosen together by the held-out slices' NLL of the probit predictive, the slices
    scored against the posterior of the kept rows only (the statistics the bodies trained
    through, ``state["statistics"]``), as the federated choice of s scores them; then the
    posterior of every row at that (s, T) scored on the test rows."""
    from inference.conjugate import ConjugatePosterior, SufficientStatistics
    from inference.conjugate.heldout_scale import HELDOUT_SCALE_GRID

    state = run.state
    kept = SufficientStatistics(state["statistics"].to(torch.float64),
                                round(float(state["num_samples"])), privatized=True)
    best = None
    for scale in HELDOUT_SCALE_GRID:
        held_post = ConjugatePosterior(posterior.prior, kept, feature_scale=scale)
        for t in TEMPERATURES:
            value = nll(probit(held_post, x["held"], t), y["held"])
            if best is None or value < best[0]:
                best = (value, scale, t)
    value, scale, t = best
    final = ConjugatePosterior(posterior.prior, posterior.statistics, feature_scale=scale)
    probs = {n: probit(final, x[n], t) for n in x}
    plug = {n: torch.softmax(x[n] @ final.map().T, 1) for n in x}
    return {"s": scale, "T": t, "nll/held": value, "predictive": figures(probs),
            "plugin": figures(plug)}


def main() -> None:
    for arg in sys.argv[1:]:
        print(json.dumps(analyse(Path(arg))), flush=True)


if __name__ == "__main__":
    main()
