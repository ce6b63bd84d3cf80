"""FedLog's ``feature_scale="heldout"`` (the default since issue 40): every client keeps a fixed
stratified share of its training examples out of training and out of the statistics the bodies
train through, scores it on a grid of scales under the broadcast statistics, and the server takes
the scale of least summed held-out NLL — equal to the choice on the pooled held-out examples;
the slices' statistics then join the posterior (the evaluation broadcast holds every row's)."""

import copy
import math

import numpy as np
import pytest
import torch
from strategy_helpers import NUM_CLASSES, evaluation_broadcast, network_output, run_round, wire

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics
from inference.conjugate.heldout_scale import (
    HELDOUT_SCALE_CAP,
    HELDOUT_SCALE_GRID,
    scale_from_grid,
)

FRACTION = 0.25


def heldout_of(strategy, client):
    """(kept, held-out) ClientData of a client under the strategy's split."""
    return strategy.split_heldout(client.data)


def pooled_heldout_nll(strategy, clients, statistics):
    """The summed held-out NLL on the grid over all clients, computed here from scratch: the
    clients' current bodies on their held-out inputs, the MAP head of ``statistics`` at each
    scale, log-softmax by hand."""
    totals = torch.zeros(len(HELDOUT_SCALE_GRID), dtype=torch.float64)
    for c in clients:
        _, held = heldout_of(strategy, c)
        feats = network_output(strategy, c, held.train_x).double()
        phi = torch.cat([torch.ones(len(feats), 1, dtype=torch.float64), feats], 1)
        for g, s in enumerate(HELDOUT_SCALE_GRID):
            W = ConjugatePosterior(ConjugatePrior(nu=1.0), statistics, feature_scale=s).map()
            logp = torch.log_softmax(phi @ W.T, dim=1)
            totals[g] -= logp[torch.arange(len(held.train_y)), held.train_y].sum()
    return totals


def test_the_held_out_share_is_stratified_fixed_and_never_in_the_statistics(build):
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, ups = run_round(strategy, clients, state, 0)
    for c, u in zip(clients, ups, strict=True):
        kept, held = heldout_of(strategy, c)
        assert kept.num_train + held.num_train == c.data.num_train
        assert held.num_train == round(c.data.num_train * FRACTION)
        # the same share in every call (seeded by the run seed and the client id)
        again = heldout_of(strategy, c)[1]
        assert torch.equal(again.train_x, held.train_x)
        # the upload counts only the kept examples, and its class counts are theirs
        assert float(u.tensors["num_samples"]) == kept.num_train
        counts = torch.bincount(kept.train_y, minlength=NUM_CLASSES).double()
        torch.testing.assert_close(u.tensors["statistics"][:, 0].double(), counts)
        # no held-out row is a kept row
        rows = {tuple(r.tolist()) for r in kept.train_x}
        assert not any(tuple(r.tolist()) in rows for r in held.train_x)


def test_round_0_scores_nothing_and_the_scale_stays_1(build):
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, ups = run_round(strategy, clients, state, 0)
    for u in ups:
        assert float(u.tensors["heldout_count"]) == 0
        assert not bool(u.tensors["heldout_nll"].any())
    assert float(state["feature_scale"]) == 1.0


@pytest.mark.parametrize("options", [{}, {"feature_scale": "heldout"}],
                         ids=["default", "heldout"])
def test_the_servers_scale_is_the_pooled_held_out_choice(build, options):
    strategy, clients, state = build("fedlog", heldout_fraction=FRACTION,
                                     upload_dtype="float64", **options)
    state, _ = run_round(strategy, clients, state, 0)
    statistics = SufficientStatistics(state["statistics"], round(float(state["num_samples"])),
                                      privatized=True)
    # round 1's clients score with the bodies that made round 0's statistics, before training
    expected = pooled_heldout_nll(strategy, clients, statistics)
    before = copy.deepcopy(clients)
    state, ups = run_round(strategy, clients, state, 1)
    total = torch.stack([u.tensors["heldout_nll"] for u in ups]).sum(0)
    # float64 throughout; sums of the same terms in another order: 1e-10 relative
    torch.testing.assert_close(total, expected, rtol=1e-10, atol=0)
    assert float(sum(u.tensors["heldout_count"] for u in ups)) == sum(
        heldout_of(strategy, c)[1].num_train for c in before)
    scale = float(state["feature_scale"])
    assert scale == scale_from_grid(expected)
    assert strategy.server_metrics(state) == {"feature_scale": scale}
    # the head the bodies train through is the MAP of this round's statistics at s = 1; the
    # evaluation posterior is theirs at the chosen scale
    stats = SufficientStatistics(state["statistics"], round(float(state["num_samples"])),
                                 privatized=True)
    W = ConjugatePosterior(ConjugatePrior(nu=1.0), stats, feature_scale=1.0).map()
    torch.testing.assert_close(state["head"].double(), W, rtol=1e-6, atol=1e-6 * W.abs().max())
    c = clients[0]
    posterior = strategy.posterior(c.config, c.state, evaluation_broadcast(strategy, state, 1))
    assert posterior.head.feature_scale == scale
    # these toy rows are all classified right, so their NLL falls as s grows: the choice stops
    # at the cap (a chosen s below it reaching the posterior: test_the_choice_follows_...)
    assert scale == HELDOUT_SCALE_CAP < scale_from_grid(expected, cap=None)


def test_the_servers_scale_is_a_brute_force_grid_search_on_the_pooled_held_out_rows(build):
    """The default's choice, against a brute force written here without the library's grid
    code: every scale of the grid, the MAP of the broadcast statistics, the pooled held-out
    rows' NLL; the server's choice is the best grid point at most 1 (the cap: the choice only
    tempers) refined within its neighbours, never above 1."""
    strategy, clients, state = build("fedlog", heldout_fraction=FRACTION, upload_dtype="float64")
    state, _ = run_round(strategy, clients, state, 0)
    stats = SufficientStatistics(state["statistics"], round(float(state["num_samples"])),
                                 privatized=True)
    feats, labels = [], []
    for c in clients:
        held = heldout_of(strategy, c)[1]
        feats.append(network_output(strategy, c, held.train_x).double())
        labels.append(held.train_y)
    phi = torch.cat([torch.ones(sum(len(f) for f in feats), 1, dtype=torch.float64),
                     torch.cat(feats)], 1)
    y = torch.cat(labels)
    nll = []
    for s in HELDOUT_SCALE_GRID:
        W = ConjugatePosterior(ConjugatePrior(nu=1.0), stats, feature_scale=s).map()
        nll.append(float(-torch.log_softmax(phi @ W.T, 1)[torch.arange(len(y)), y].sum()))
    best = int(np.argmin(nll))
    if HELDOUT_SCALE_GRID[best] > 1.0:
        best = int(np.argmin([v for v, s in zip(nll, HELDOUT_SCALE_GRID, strict=True)
                              if s <= 1.0]))
    state, _ = run_round(strategy, clients, state, 1)
    chosen = float(state["feature_scale"])
    low = HELDOUT_SCALE_GRID[max(best - 1, 0)]
    high = min(HELDOUT_SCALE_GRID[min(best + 1, len(HELDOUT_SCALE_GRID) - 1)], 1.0)
    assert low <= chosen <= high
    # and it is no worse on the pooled rows than the brute force's best grid point, to the
    # parabola's accuracy
    W = ConjugatePosterior(ConjugatePrior(nu=1.0), stats, feature_scale=chosen).map()
    at_choice = float(-torch.log_softmax(phi @ W.T, 1)[torch.arange(len(y)), y].sum())
    assert at_choice <= nll[best] + 1e-3 * abs(nll[best])


@pytest.mark.parametrize("absent_clients", ["latest", "omit"])
def test_the_slices_statistics_are_added_back_exactly(build, absent_clients):
    """The evaluation posterior is that of every training row: the kept rows' statistics (what
    the bodies train through and the slices are scored against) plus the slices', each of the
    client's trained body, so no row is lost to the choice of s."""
    strategy, clients, state = build("fedlog", heldout_fraction=FRACTION, upload_dtype="float64",
                                     absent_clients=absent_clients)
    for r in range(3):
        state, ups = run_round(strategy, clients, state, r)
        # every upload carries its slice's statistics, of the body after this round's training
        for c, u in zip(clients, ups, strict=True):
            held = heldout_of(strategy, c)[1]
            expected = SufficientStatistics.from_features(
                network_output(strategy, c, held.train_x).double(), held.train_y, NUM_CLASSES)
            torch.testing.assert_close(u.tensors["heldout_statistics"], expected.table,
                                       rtol=1e-12, atol=1e-12)
    # final statistics = those of all rows (kept + held out) of the clients' final bodies
    # (each part's features from its own forward pass, as the clients compute them: a pass
    # over all rows at once rounds the float32 features differently, by ~1e-7)
    parts = [p for c in clients for p in heldout_of(strategy, c)]
    features = torch.cat([network_output(strategy, c, p.train_x).double()
                          for c in clients for p in heldout_of(strategy, c)])
    labels = torch.cat([p.train_y for p in parts])
    everything = SufficientStatistics.from_features(features, labels, NUM_CLASSES)
    evaluation = evaluation_broadcast(strategy, state, 2)
    torch.testing.assert_close(evaluation.tensors["statistics"], everything.table,
                               rtol=1e-12, atol=1e-12)
    one_pass = SufficientStatistics.from_features(
        torch.cat([network_output(strategy, c).double() for c in clients]),
        torch.cat([c.data.train_y for c in clients]), NUM_CLASSES)
    torch.testing.assert_close(evaluation.tensors["statistics"], one_pass.table,
                               rtol=1e-6, atol=1e-6)
    assert float(evaluation.tensors["num_samples"]) == sum(c.data.num_train for c in clients)
    # the training broadcast keeps the kept rows' only (the slices stay held out)
    kept = sum(heldout_of(strategy, c)[0].num_train for c in clients)
    assert float(strategy.configure(state, 3).broadcast.tensors["num_samples"]) == kept
    # the posterior clients evaluate with is the one of all rows, at the chosen scale
    c = clients[0]
    posterior = strategy.posterior(c.config, c.state, evaluation)
    torch.testing.assert_close(posterior.head.statistics.table, everything.table,
                               rtol=1e-12, atol=1e-12)
    assert posterior.head.feature_scale == float(state["feature_scale"])


def test_the_slices_statistics_are_counted_in_the_upload_bytes(build):
    """The slice's statistics travel in the upload dtype, C x m numbers more than s = 1's
    upload (beside the 33 + 1 float64 scores), and the transport counts every byte."""
    from bayesfl.messages import encode

    _, _, _, paper = trained_uploads(build, feature_scale=1)
    strategy, _, _, ups = trained_uploads(build)
    assert ups[0].tensors["heldout_statistics"].dtype == torch.float32
    assert ups[0].tensors["heldout_statistics"].shape == (NUM_CLASSES, strategy.m)
    extra = len(encode(ups[0])) - len(encode(paper[0]))
    floats = NUM_CLASSES * strategy.m * 4 + (len(HELDOUT_SCALE_GRID) + 1) * 8
    assert floats <= extra <= floats + 400  # + the three entries' names and headers


def trained_uploads(build, **options):
    strategy, clients, state = build("fedlog", heldout_fraction=FRACTION, **options)
    state, _ = run_round(strategy, clients, state, 0)
    state, ups = run_round(strategy, clients, state, 1)
    return strategy, clients, state, ups


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: {"heldout_statistics": t["heldout_statistics"] * -1}, "negative"),
        (lambda t: {"heldout_statistics": t["heldout_statistics"] * 0 + 0.5},
         "heldout_statistics.*integral"),
        (lambda t: {"heldout_statistics": torch.cat(
            [t["heldout_statistics"][:, :1] * 2, t["heldout_statistics"][:, 1:]], 1)},
         "differs from the .* scored"),
        (lambda t: {"heldout_statistics": t["heldout_statistics"] * 1e3,
                    "heldout_count": t["heldout_count"] * 1e3}, "exceeds"),
        (lambda t: {"heldout_statistics": t["heldout_statistics"][:2]}, "shape"),
    ],
)
def test_impossible_slice_statistics_are_rejected_with_a_reason(build, change, reason):
    strategy, clients, state = build("fedlog", heldout_fraction=FRACTION)
    state, _ = run_round(strategy, clients, state, 0)
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    tensors = {k: v.clone() for k, v in ups[1].tensors.items()}
    bad = wire(Message(ups[1].header, {**tensors, **change(tensors)}))
    with pytest.raises(MessageRejected, match=reason):
        strategy.validate_upload(plan, bad, 1)


def test_the_broadcast_is_the_statistics_and_the_scale_not_the_head(build):
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, _ = run_round(strategy, clients, state, 0)
    state, _ = run_round(strategy, clients, state, 1)
    down = wire(strategy.configure(state, 2).broadcast)
    assert set(down.tensors) == {"statistics", "num_samples", "feature_scale"}
    target = strategy.broadcast.training_target(down, strategy)
    # the head each client trains through is the server's (solved from the same wire table)
    head = torch.cat([target.bias[:, None], target.weight], 1)
    torch.testing.assert_close(head.double(), state["head"].double(), rtol=0, atol=1e-6)
    evaluation = evaluation_broadcast(strategy, state, 1)
    assert float(evaluation.tensors["feature_scale"]) == float(state["feature_scale"])


def test_fit_group_uploads_what_fit_uploads(build):
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, _ = run_round(strategy, clients, state, 0)
    twins = copy.deepcopy(clients)
    _, plain = run_round(strategy, clients, state, 1, batched=False)
    _, batch = run_round(strategy, twins, state, 1, batched=True)
    for a, b in zip(plain, batch, strict=True):
        assert float(a.tensors["heldout_count"]) == float(b.tensors["heldout_count"]) > 0
        # vmapped and plain forward passes differ in float32 rounding only
        torch.testing.assert_close(a.tensors["heldout_nll"], b.tensors["heldout_nll"],
                                   rtol=1e-4, atol=1e-4)


def test_the_choice_follows_the_held_out_data(build):
    """Scores favouring small scales pull the server's choice there, and the evaluation
    posterior to it; scores favouring large ones pull it up to the cap, 1 (a server ignoring
    the scores would keep s = 1 or one fixed value)."""
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, ups = run_round(strategy, clients, state, 0)
    logs = torch.tensor([math.log(s) for s in HELDOUT_SCALE_GRID], dtype=torch.float64)
    chosen = []
    for target in (0.1, 0.6, 3.0):
        bowl = (logs - math.log(target)) ** 2 + 1.0
        forged = [wire(Message(u.header, {**u.tensors, "heldout_nll": bowl / 3,
                                          "heldout_count": torch.ones(1, dtype=torch.float64)}))
                  for u in ups]
        new = strategy.aggregate(state, forged, 1, torch.Generator().manual_seed(1))
        chosen.append(float(new["feature_scale"]))
        c = clients[0]
        posterior = strategy.posterior(c.config, c.state, evaluation_broadcast(strategy, new, 1))
        assert posterior.head.feature_scale == chosen[-1]
    # an exact quadratic in log s: the parabola's vertex is the target itself, up to the cap
    assert chosen == pytest.approx([0.1, 0.6, HELDOUT_SCALE_CAP], rel=1e-9)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: {"heldout_nll": t["heldout_nll"] - 1e3}, ">= 0"),
        (lambda t: {"heldout_nll": t["heldout_nll"].fill_(math.nan)}, "non-finite|finite"),
        (lambda t: {"heldout_count": t["heldout_count"] + 0.5}, "whole number"),
        (lambda t: {"heldout_count": t["heldout_count"] + 1e6}, "exceeds"),
        (lambda t: {"heldout_count": t["heldout_count"] * 0,
                    "heldout_nll": t["heldout_nll"] + 1.0}, "0 with no held-out"),
        (lambda t: {"heldout_nll": t["heldout_nll"][:3]}, "shape"),
    ],
)
def test_impossible_held_out_scores_are_rejected_with_a_reason(build, change, reason):
    strategy, clients, state = build("fedlog", feature_scale="heldout", heldout_fraction=FRACTION)
    state, _ = run_round(strategy, clients, state, 0)
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    tensors = {k: v.clone() for k, v in ups[0].tensors.items()}
    bad = wire(Message(ups[0].header, {**tensors, **change(tensors)}))
    with pytest.raises(MessageRejected, match=reason):
        strategy.validate_upload(plan, bad, 0)


@pytest.mark.parametrize("value", [0, 0.5, 1.0, -0.1, True, "0.1"])
def test_a_held_out_fraction_outside_0_to_a_half_is_a_config_error(build, value):
    with pytest.raises(ConfigError, match=r"heldout_fraction must be a number in \(0, 0.5\)"):
        build("fedlog", feature_scale="heldout", heldout_fraction=value)


def test_held_out_scale_with_median_statistics_is_a_config_error(build):
    with pytest.raises(ConfigError, match="statistics_aggregation='sum'"):
        build("fedlog", feature_scale="heldout", statistics_aggregation="median")


@pytest.mark.parametrize("name", ["fedlog-dp-local", "fedlog-dp-central"])
def test_dp_variants_refuse_the_held_out_scale(build, name):
    with pytest.raises(ConfigError, match="keeps feature_scale = 1"):
        build(name, feature_scale="heldout")


def test_a_client_with_one_training_example_keeps_it_and_scores_nothing(build):
    strategy, clients, state = build("fedlog", sizes=(1, 12), feature_scale="heldout",
                                     heldout_fraction=FRACTION)
    state, _ = run_round(strategy, clients, state, 0)
    state, ups = run_round(strategy, clients, state, 1)
    assert float(ups[0].tensors["num_samples"]) == 1
    assert float(ups[0].tensors["heldout_count"]) == 0
    assert not bool(ups[0].tensors["heldout_statistics"].any())
    assert float(ups[1].tensors["heldout_count"]) == 3
    assert np.isfinite(float(state["feature_scale"]))


@pytest.mark.trained
def test_on_an_easy_task_the_default_predicts_no_sharper_than_the_papers_scale():
    """``make demo``'s setting (digits, 20 clients, ``shards:2``; 5 rounds): each client's
    held-out slice is ~3 examples, none misclassified, so their NLL falls at every s >= 1.
    Uncapped (before 6dfa019) the default chose s of 1.8-3.1 and predicted near one-hot:
    test NLL 0.515 and 0.299 at seeds 0 and 1, 2.7x and 3.9x the paper's s = 1."""
    from bayesfl.simulate import simulate

    common = dict(dataset="digits", clients=20, partition="shards:2", rounds=5,
                  body="mlp:200", feature_dim=50, local_epochs=5, lr=1e-3, batch_size=10,
                  progress=False, threads=1)
    ratios = []
    for seed in (0, 1, 2):
        default = simulate("fedlog", seed=seed, **common)
        paper = simulate("fedlog", seed=seed, strategy_options={"feature_scale": 1},
                         **common).summary
        assert all(record["feature_scale"] <= HELDOUT_SCALE_CAP for record in default.metrics)
        ratios.append(default.summary["nll"] / paper["nll"])
    # Measured, seeds 0-2: native AVX-512 0.99, 0.82, 1.31 (mean 1.04); ATEN_CPU_CAPABILITY=
    # default 0.83, 2.31, 0.94 (1.36); avx2 0.96, 0.92, 1.00 (0.96); uncapped (native) mean 3.47.
    # One seed's NLL moves with a few confidently wrong test images under another rounding, so
    # the paired mean is asserted, at 2: above every capped mean seen, below the uncapped.
    assert sum(ratios) / len(ratios) <= 2.0
