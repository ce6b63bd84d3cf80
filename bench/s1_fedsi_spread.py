"""FedSI's personalised subnet posterior on S1 (issue 40, task 2): the GLM logit standard
deviation against the gap between the two largest logits on each client's test rows (clean,
rotated 30/60 degrees, unseen labels), the probit predictive with the logit variances times T
(a likelihood tempered by 1/T, approximately), and the Laplace evidence of the prior variance
alpha on the personalised subnet (whose mode is the prior mean, so the evidence is
``-1/2 log det(I + alpha GGN_S)``, decreasing in alpha).

Usage: ``python bench/s1_fedsi_spread.py RUN_DIR`` (a FedSI run of ``bench/s1_shift.py --runs``);
prints one JSON object.
"""
import json
import math
import sys
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])
from bayesfl.loaded_run import load_run  # noqa: E402
from bayesfl.shift_evaluation import _run_data  # noqa: E402
from bayesfl.shifts import data_range, rotate  # noqa: E402
from calibration import auroc, ood_scores  # noqa: E402

TEMPERATURES = (1, 10, 100, 1e3, 1e4)
SETS = ("clean", "30", "60", "ood")


def nll(p: torch.Tensor, y: torch.Tensor) -> float:
    return float(-p[torch.arange(len(y)), y].clamp(min=1e-12).log().mean())


def main() -> None:
    torch.set_num_threads(1)
    run = load_run(sys.argv[1])
    strategy = run.strategy
    dataset, clients = _run_data(run, None)
    low = data_range(dataset.x)[0]
    pooled_x = torch.cat([d.test_x for d in clients])
    pooled_y = torch.cat([d.test_y for d in clients])
    acc: dict = {n: {"f": [], "v": [], "y": []} for n in SETS}
    alpha_rows = []
    for k, d in enumerate(clients):
        post = strategy.posterior(run.clients[k].config, run.client_state(k),
                                  run.evaluation_broadcast)
        engine = post._subnet_jacobian()
        unseen = ~torch.isin(pooled_y, torch.unique(d.train_y))
        sets = {"clean": (d.test_x, d.test_y),
                "30": (rotate(d.test_x, 30, (1, 28, 28), fill=low), d.test_y),
                "60": (rotate(d.test_x, 60, (1, 28, 28), fill=low), d.test_y),
                "ood": (pooled_x[unseen], pooled_y[unseen])}
        with torch.no_grad():
            for n, (x, y) in sets.items():
                var, logits = post._factored_variance(engine, x.to(post._mean.dtype))
                acc[n]["f"].append(logits.double())
                acc[n]["v"].append(var.double())
                acc[n]["y"].append(y)
        eig = torch.linalg.eigvalsh(post._ggn).clamp(min=0)
        alpha_rows.append({
            "client": k, "n_subnet": int(eig.numel()),
            "prior_var": float(1 / post._prior_precision.median()),
            "ggn_eig_max": float(eig.max()), "ggn_eig_median": float(eig.median()),
            "log_evidence_alpha": {a: float(-0.5 * torch.log1p(a * eig).sum())
                                   for a in (1e-6, 1e-4, 1e-2, 1, 100)}})
    F = {n: torch.cat(acc[n]["f"]) for n in SETS}
    V = {n: torch.cat(acc[n]["v"]) for n in SETS}
    Y = {n: torch.cat(acc[n]["y"]) for n in SETS}
    out: dict = {"run": sys.argv[1]}
    for n in SETS:
        top2 = F[n].topk(2, 1).values
        gap = top2[:, 0] - top2[:, 1]
        top = F[n].argmax(1)
        sd = V[n].sqrt()[torch.arange(len(top)), top]
        out[f"spread/{n}"] = {"median_gap": float(gap.median()),
                              "median_sd_top": float(sd.median()),
                              "median_sd_over_gap": float((sd / gap.clamp(min=1e-9)).median())}

    def figures(t: float) -> dict:
        p = {n: torch.softmax(F[n] / torch.sqrt(1 + math.pi / 8 * t * V[n]), 1) for n in SETS}
        scores = torch.cat([ood_scores(p["clean"]), ood_scores(p["ood"])])
        flags = torch.cat([torch.zeros(len(p["clean"])), torch.ones(len(p["ood"]))]).bool()
        return {"T": t, **{f"nll/{n}": nll(p[n], Y[n]) for n in ("clean", "30", "60")},
                "auroc_entropy": auroc(scores, flags)}

    out["plugin"] = figures(0.0)
    out["tempered"] = [figures(t) for t in TEMPERATURES]
    out["alpha"] = alpha_rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
