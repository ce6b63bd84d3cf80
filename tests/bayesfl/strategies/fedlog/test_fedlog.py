"""FedLog: sufficiency of the server step, upload invariants, statistics of absent clients,
the posterior predictive, variants."""

import copy
import math
import re

import pytest
import torch
from scipy.optimize import minimize
from strategy_helpers import (
    FEATURE_DIM,
    NUM_CLASSES,
    SIZES,
    evaluation_broadcast,
    fit_all,
    generators,
    network_output,
    predict,
    run_round,
    wire,
)

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies import MAP_PLUGIN, PREDICTIVE, make_strategy
from bayesfl.strategies.fedlog.fedlog import HeadObjective
from inference.conjugate import (
    ConjugatePosterior,
    ConjugatePrior,
    PrivacyNoiseWarning,
    SufficientStatistics,
)


def pooled_table(strategy, clients):
    """Independent reference: one-hot matmul of the pooled augmented features (float64)."""
    feats = torch.cat([network_output(strategy, c) for c in clients]).double()
    labels = torch.cat([c.data.train_y for c in clients])
    onehot = torch.nn.functional.one_hot(labels, NUM_CLASSES).double()
    phi = torch.cat([torch.ones(len(labels), 1, dtype=torch.float64), feats], dim=1)
    return onehot.T @ phi, len(labels)


def lbfgs_map(S, N):
    """Reference MAP: L-BFGS on the full C*m objective (spec §2.1)."""
    C, m = S.shape
    s = S.numpy()

    def f(w):
        W = torch.tensor(w.reshape(C, m), requires_grad=True)
        J = (W * S).sum() - N * torch.logsumexp(W.pow(2).sum(1) / 4, 0)
        (-J).backward()  # minimise -J: W.grad is its gradient
        return -J.item(), W.grad.numpy().ravel()

    res = minimize(f, (s / N / 2).ravel(), jac=True, method="L-BFGS-B",
                   options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 10_000})
    return torch.tensor(res.x.reshape(C, m))


@pytest.mark.parametrize("round_", [0, 1])
def test_server_step_equals_centralized_map_on_pooled_features(build, round_):
    strategy, clients, state = build("fedlog", upload_dtype="float64", feature_scale=1.0)
    if round_ == 1:  # train once so the features are not those of the initial bodies
        state, _ = run_round(strategy, clients, state, 0)
    new_state, _ = run_round(strategy, clients, state, round_)
    table, n = pooled_table(strategy, clients)
    # sufficiency: sum of client statistics == pooled statistic (exact in float64)
    torch.testing.assert_close(new_state["statistics"], table, atol=1e-9, rtol=1e-12)
    reference = lbfgs_map(table, 1.0 + n)  # prior chi = 0, nu = 1
    head = new_state["head"].double()  # stored in float32: 6e-8 relative rounding
    scale = reference.abs().max()
    assert (head - reference).abs().max() <= 1e-6 * scale
    # the float64 solve itself matches the stationarity condition p_y W_y / 2 = S_y / N
    W = strategy.solve_head(table, n, privatized=False)
    p = torch.softmax(W.pow(2).sum(1) / 4, 0)
    torch.testing.assert_close(p[:, None] * W / 2, table / (1.0 + n), atol=1e-10, rtol=1e-9)


def test_float32_uploads_give_the_same_head_to_float32_rounding(build):
    strategy, clients, state = build("fedlog", feature_scale=1.0)
    new_state, ups = run_round(strategy, clients, state, 0)
    assert ups[0].tensors["statistics"].dtype == torch.float32
    table, n = pooled_table(strategy, clients)
    W = strategy.solve_head(table, n, privatized=False)
    # float32 statistics: relative rounding 6e-8 per entry, so 1e-6 relative to max |W|
    assert (new_state["head"].double() - W).abs().max() <= 1e-6 * W.abs().max()


def test_upload_bias_column_is_class_counts(build):
    strategy, clients, state = build("fedlog", feature_scale=1.0)
    _, ups = run_round(strategy, clients, state, 0)
    for c, u in zip(clients, ups, strict=True):
        counts = torch.bincount(c.data.train_y, minlength=NUM_CLASSES).float()
        assert torch.equal(u.tensors["statistics"][:, 0], counts)
        assert int(u.tensors["num_samples"]) == c.data.num_train


def test_round_zero_does_not_train_and_later_rounds_only_train_the_body(build):
    strategy, clients, state = build("fedlog")
    before = copy.deepcopy(clients[0].state)
    state, _ = run_round(strategy, clients, state, 0)
    after0 = clients[0].state
    assert after0.keys() == before.keys()
    assert all(torch.equal(before[k], after0[k]) for k in before)
    head = state["head"].clone()
    state, _ = run_round(strategy, clients, state, 1)
    assert not torch.equal(before["model.1.weight"], clients[0].state["model.1.weight"])
    assert not torch.equal(head, state["head"])  # new statistics, new head


@pytest.mark.trained
def test_training_improves_fedlog_training_accuracy(build):
    strategy, clients, state = build("fedlog", sizes=(30, 30, 30))
    state, _ = run_round(strategy, clients, state, 0)

    def train_accuracy(r):
        correct = sum(int((predict(strategy, c, state, c.data.train_x, r).argmax(1)
                           == c.data.train_y).sum()) for c in clients)
        return correct / 90

    acc0 = train_accuracy(0)
    for r in range(1, 5):
        state, _ = run_round(strategy, clients, state, r)
    assert train_accuracy(4) > max(acc0, 0.6)


def test_map_plugin_is_softmax_of_the_map_head_times_augmented_features(build):
    strategy, clients, state = build("fedlog", feature_scale=1.0)
    state, _ = run_round(strategy, clients, state, 0)
    c = clients[1]
    probs = predict(strategy, c, state, c.data.test_x, key=MAP_PLUGIN)
    feats = network_output(strategy, c, c.data.test_x).double()
    phi = torch.cat([torch.ones(len(feats), 1, dtype=torch.float64), feats], 1)
    # the plug-in is computed in float64 from the broadcast statistics, so the reference is
    # the float64 head solved from the same statistics (the float32 broadcast head would differ
    # by ~1e-7). Both are float64 softmaxes of the same float32 features: 1e-12 leaves room
    # for summation order only, and catches a wrong head, a missing bias or a wrong feature.
    W = strategy.solve_head(state["statistics"], float(state["num_samples"]), privatized=False)
    torch.testing.assert_close(probs, torch.softmax(phi @ W.T, 1), atol=1e-12, rtol=0)
    # ... and it is the broadcast float32 head's softmax up to that head's rounding (6e-8
    # relative per entry of W, times logits of O(1-10))
    torch.testing.assert_close(probs, torch.softmax(phi @ state["head"].double().T, 1),
                               atol=1e-6, rtol=0)


@pytest.mark.trained
def test_batched_client_updates_match_the_plain_loop(build):
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    twins = copy.deepcopy(clients)
    s_plain, _ = run_round(strategy, clients, state, 1, batched=False)
    s_batch, _ = run_round(strategy, twins, state, 1, batched=True)
    torch.testing.assert_close(s_plain["head"], s_batch["head"], atol=1e-5, rtol=1e-5)


def test_heterogeneous_bodies_share_one_head(build):
    strategy, clients, state = build("fedlog", bodies=("mlp:8", "mlp:5-5"))
    assert clients[0].config.body != clients[1].config.body
    state, _ = run_round(strategy, clients, state, 0)
    state, _ = run_round(strategy, clients, state, 1, batched=True)  # one group per body
    assert state["head"].shape == (NUM_CLASSES, 5)


def test_fit_group_refuses_clients_with_two_body_specs(build):
    strategy, clients, state = build("fedlog", bodies=("mlp:8", "mlp:5-5"))
    down = strategy.configure(state, 0).broadcast
    with pytest.raises(ConfigError, match="one body spec"):
        strategy.fit_group([c.config for c in clients], [c.state for c in clients],
                           [c.data for c in clients], down, generators(clients, 0))


# ---- statistics of absent clients ---------------------------------------------------------
def test_latest_sums_every_clients_latest_accepted_statistics(build):
    strategy, clients, state = build("fedlog", feature_scale=1.0)
    assert strategy.absent_clients == "latest"  # the default
    state, ups0 = run_round(strategy, clients, state, 0)
    state, ups1 = run_round(strategy, clients[:2], state, 1)  # client 2 does not upload
    latest = [ups1[0], ups1[1], ups0[2]]
    tables = torch.stack([u.tensors["statistics"] for u in latest]).double()
    n = sum(int(u.tensors["num_samples"]) for u in latest)
    expected = SufficientStatistics.sum_tables(tables, n).table
    assert torch.equal(state["statistics"], expected)
    # float32 uploads of non-negative features: their float64 sum is exact as well
    assert torch.equal(state["statistics"], tables[0] + tables[1] + tables[2])
    assert float(state["num_samples"]) == n
    assert torch.equal(state["head"], strategy.solve_head(expected, n, privatized=False).float())
    # the absent client keeps its cached table; the others' caches hold this round's uploads
    # (one stack per upload tensor, a row per client id)
    assert torch.equal(state["latest/statistics"][2], ups0[2].tensors["statistics"])
    assert torch.equal(state["latest/num_samples"][2], ups0[2].tensors["num_samples"])
    for k in (0, 1):
        assert torch.equal(state["latest/statistics"][k], ups1[k].tensors["statistics"])
    assert state["latest/present"].tolist() == [True, True, True]
    # a cached table is a client's latest body: after training, round 1's differ from round 0's
    assert not torch.equal(ups1[0].tensors["statistics"], ups0[0].tensors["statistics"])


def test_omit_sums_only_the_rounds_uploads(build):
    strategy, clients, state = build("fedlog", absent_clients="omit", feature_scale=1.0)
    state, _ = run_round(strategy, clients, state, 0)
    state, ups1 = run_round(strategy, clients[:2], state, 1)
    tables = torch.stack([u.tensors["statistics"] for u in ups1]).double()
    n = sum(int(u.tensors["num_samples"]) for u in ups1)
    assert torch.equal(state["statistics"], SufficientStatistics.sum_tables(tables, n).table)
    assert float(state["num_samples"]) == n
    assert not any(k.startswith("latest/") for k in state)


def test_an_unknown_absent_clients_policy_is_a_config_error(build):
    with pytest.raises(ConfigError, match="absent_clients"):
        build("fedlog", absent_clients="mean")


# ---- upload invariants ----------------------------------------------------------------------
def _tampered(upload, **tensors):
    return Message(upload.header, {**upload.tensors, **tensors})


def _with_counts(t, counts):
    return torch.cat([counts, t["statistics"][:, 1:]], 1)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: {"statistics": t["statistics"][:, :-1]}, "shape"),
        (lambda t: {"statistics": t["statistics"].double()}, "dtype"),
        (lambda t: {"statistics": t["statistics"].clone().fill_(float("nan"))}, "non-finite"),
        (lambda t: {"num_samples": t["num_samples"] + 1}, "sum to"),
        (lambda t: {"statistics": torch.cat([t["statistics"][:, :1] + 0.5,
                                             t["statistics"][:, 1:]], 1)}, "integral"),
        (lambda t: {"statistics": torch.cat([-t["statistics"][:, :1],
                                             t["statistics"][:, 1:]], 1)}, "negative"),
        (lambda t: {"num_samples": t["num_samples"] * 0}, ">= 1"),
    ],
)
def test_invalid_uploads_are_rejected_with_a_reason(build, change, reason):
    strategy, clients, state = build("fedlog")
    plan = strategy.configure(state, 0)
    _, ups = run_round(strategy, clients, state, 0)
    bad = wire(_tampered(ups[0], **change(ups[0].tensors)))
    with pytest.raises(MessageRejected, match=reason):
        strategy.validate_upload(plan, bad, 0)


def test_an_upload_for_another_round_or_client_is_rejected(build):
    strategy, clients, state = build("fedlog")
    _, ups = run_round(strategy, clients, state, 0)
    with pytest.raises(MessageRejected, match="round"):
        strategy.validate_upload(strategy.configure(state, 1), ups[0], 0)
    with pytest.raises(MessageRejected, match="client_id"):
        strategy.validate_upload(strategy.configure(state, 0), ups[0], 2)


TAMPERINGS = {  # name -> (change of an upload's tensors, expected reason)
    "negative counts": (lambda t: {"statistics": _with_counts(
        t, t["statistics"][:, :1] * torch.tensor([[-1.0], [1.0], [1.0]]))}, "negative"),
    "non-integral counts": (lambda t: {"statistics": _with_counts(
        t, t["statistics"][:, :1] + torch.tensor([[0.5], [-0.5], [0.0]]))}, "integral"),
    "counts not summing to num_samples": (lambda t: {"num_samples": t["num_samples"] + 2},
                                          "sum to"),
    "num_samples 0": (lambda t: {"num_samples": t["num_samples"] * 0}, ">= 1"),
    "wrong shape": (lambda t: {"statistics": t["statistics"][:, :-1]}, "shape"),
}


def _verdicts_one_at_a_time(strategy, plan, messages, ids):
    verdicts = []
    for message, cid in zip(messages, ids, strict=True):
        try:
            strategy.validate_upload(plan, message, cid)
        except MessageRejected as err:
            verdicts.append(err.reason)
        else:
            verdicts.append(None)
    return verdicts


def test_validating_a_batch_gives_the_verdicts_of_one_upload_at_a_time(build):
    strategy, clients, state = build("fedlog")
    plan = strategy.configure(state, 0)
    _, ups = run_round(strategy, clients, state, 0)
    messages, ids, expected = [], [], []
    for k, (change, reason) in enumerate(TAMPERINGS.values()):
        good = ups[k % len(ups)]
        messages += [good, wire(_tampered(good, **change(good.tensors)))]
        ids += [good.header.client_id] * 2
        expected += [None, reason]
    batch = strategy.validate_uploads(plan, messages, ids)
    assert batch == _verdicts_one_at_a_time(strategy, plan, messages, ids)
    for verdict, reason in zip(batch, expected, strict=True):
        if reason is None:
            assert verdict is None
        else:
            assert verdict is not None and reason in verdict, (verdict, reason)


def test_central_dp_batch_verdicts_include_the_clamp_bound(build):
    strategy, clients, state = build("fedlog-dp-central", epsilon=5.0, clip=0.5)
    plan = strategy.configure(state, 0)
    _, ups = run_round(strategy, clients, state, 0)
    over = ups[1].tensors["statistics"].clone()
    over[:, 1:] += 100.0
    negative, _ = TAMPERINGS["negative counts"]
    messages = [ups[0], wire(_tampered(ups[1], statistics=over)), ups[2],
                wire(_tampered(ups[2], **negative(ups[2].tensors)))]
    ids = [0, 1, 2, 2]
    batch = strategy.validate_uploads(plan, messages, ids)
    assert batch == _verdicts_one_at_a_time(strategy, plan, messages, ids)
    assert batch[0] is None and batch[2] is None
    assert "clamp" in batch[1]
    assert "negative" in batch[3]


def _invariant_rows():
    """Stacked tables (K, C, m) float64 and counts (K,) int64, one invariant broken per row
    (row 1 breaks two: the first in the order of the checks names the reason)."""
    C, m = NUM_CLASSES, FEATURE_DIM + 1
    rows = [  # (class counts, num_samples, feature sums per class, expected reason)
        ([2.0, 1.0, 1.0], 4, 0.25, None),
        ([-1.0, 1.0, 0.0], 0, 0.0, "num_samples must be >= 1, got 0"),
        ([-1.0, 3.0, 2.0], 4, 0.0, "negative"),
        ([1.5, 1.5, 1.0], 4, 0.0, "not integral"),
        ([1.0, 2.0, 3.0], 7, 0.0, "class counts sum to 6 but num_samples is 7"),
        ([1.0, 1.0, 1.0], 3, -0.5, "negative feature sums, impossible for features after a "
                                   "ReLU"),
        ([1.0, 0.0, 1.0], 2, 0.25, "non-zero feature sums for a class with count 0"),
        ([1.0, 1.0, 1.0], 3, 1e30, "bound"),
        ([1.0, 1.0, 1.0], 3, 100.0, "clamp bound"),
    ]
    tables = torch.zeros(len(rows), C, m, dtype=torch.float64)
    for k, (counts, _, feature_sum, _) in enumerate(rows):
        tables[k, :, 0] = torch.tensor(counts)
        tables[k, :, 1:] = feature_sum * tables[k, :, :1]  # a per-sample value times n_y
        if feature_sum and not all(counts):
            tables[k, 1, 1:] = feature_sum  # a class without samples yet with feature sums
    n = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    return tables, n, [r[3] for r in rows]


def test_problems_name_the_first_violated_invariant_of_every_row():
    from strategy_helpers import context

    central = make_strategy("fedlog-dp-central", context(), clip=2.0)
    tables, n, expected = _invariant_rows()
    reasons = central.privacy.problems(tables, n)
    assert len(reasons) == len(expected)
    for k, (got, want) in enumerate(zip(reasons, expected, strict=True)):
        if want is None:
            assert got is None, k
        else:
            assert got is not None and want in got, (k, got, want)
    assert "clamp bound 2 times" in reasons[-2]
    # without DP the bound is feature_bound (1000): 100 per sample is accepted, 1e30 is not
    clean = make_strategy("fedlog", context()).privacy.problems(tables, n)
    assert clean[:-2] == reasons[:-2] and clean[-1] is None
    assert clean[-2] == "feature sums exceed the feature bound 1000 times the class counts"
    # local-DP uploads are noisy: there is no invariant to check
    local = make_strategy("fedlog-dp-local", context()).privacy.problems(tables, None)
    assert local == [None] * len(expected)


# ---- the posterior predictive ---------------------------------------------------------------
def test_predict_returns_the_posterior_predictive_and_the_map_plugin(build):
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    c = clients[0]
    out = strategy.predict(c.config, c.state, evaluation_broadcast(strategy, state),
                           c.data.test_x)
    assert set(out) == {PREDICTIVE, MAP_PLUGIN}
    for probs in out.values():
        assert probs.dtype == torch.float64 and probs.shape == (c.data.num_test, NUM_CLASSES)
        torch.testing.assert_close(probs.sum(1), torch.ones(c.data.num_test,
                                                            dtype=torch.float64))
    assert not torch.equal(out[PREDICTIVE], out[MAP_PLUGIN])  # probit != plug-in


def test_the_probit_predictive_is_the_conjugate_posteriors_of_the_broadcast_statistics(build):
    strategy, clients, state = build("fedlog", predictive="probit", feature_scale=1.0)
    state, _ = run_round(strategy, clients, state, 0)
    state, _ = run_round(strategy, clients, state, 1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    c = clients[2]
    got = strategy.predict(c.config, c.state, broadcast, c.data.test_x)[PREDICTIVE]
    stats = SufficientStatistics(broadcast.tensors["statistics"],
                                 round(float(broadcast.tensors["num_samples"])))
    posterior = ConjugatePosterior(ConjugatePrior(nu=1.0), stats)
    feats = network_output(strategy, c, c.data.test_x).double()
    expected = posterior.predict_proba(feats, method="probit")
    # the same float64 computation from the same statistics and features
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_the_map_predictive_makes_the_headline_the_plugin(build):
    strategy, clients, state = build("fedlog", predictive="map")
    state, _ = run_round(strategy, clients, state, 0)
    c = clients[0]
    out = strategy.predict(c.config, c.state, evaluation_broadcast(strategy, state),
                           c.data.test_x)
    assert torch.equal(out[PREDICTIVE], out[MAP_PLUGIN])


def test_an_unknown_predictive_is_a_config_error(build):
    with pytest.raises(ConfigError, match="predictive"):
        build("fedlog", predictive="laplace")


@pytest.mark.parametrize("predictive", ["probit", "map"])
def test_the_client_posterior_samples_heads_and_predicts_as_predict_does(build, predictive):
    # the deterministic predictives ("mc" draws from a generator predict seeds from the round)
    strategy, clients, state = build("fedlog", predictive=predictive)
    state, _ = run_round(strategy, clients, state, 0)
    broadcast = evaluation_broadcast(strategy, state)
    c = clients[1]
    posterior = strategy.posterior(c.config, c.state, broadcast)
    draws = posterior.sample(10, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (10, NUM_CLASSES, FEATURE_DIM + 1)
    assert torch.isfinite(draws).all()
    x = c.data.test_x
    torch.testing.assert_close(posterior.predict_proba(x),
                               strategy.predict(c.config, c.state, broadcast, x)[PREDICTIVE],
                               atol=1e-12, rtol=0)


def test_fedavg_has_no_posterior(build):
    strategy, clients, state = build("fedavg")
    c = clients[0]
    with pytest.raises(ConfigError, match="not a posterior strategy"):
        strategy.posterior(c.config, c.state, evaluation_broadcast(strategy, state))


# ---- FedLog-C and DP --------------------------------------------------------------------------
def test_fedlog_c_broadcasts_statistics_and_clients_rebuild_the_servers_head(build):
    strategy, clients, state = build("fedlog-c")
    state, _ = run_round(strategy, clients, state, 0)
    down = wire(strategy.configure(state, 1).broadcast)
    assert set(down.tensors) == {"statistics", "num_samples"}
    target = strategy.broadcast.training_target(down, strategy)
    head = torch.cat([target.bias[:, None], target.weight], 1)
    torch.testing.assert_close(head, state["head"], atol=0, rtol=0)  # same deterministic solve
    table = state["statistics"]
    torch.testing.assert_close(target.class_means.double(),
                               table[:, 1:] / table[:, :1].clamp_min(1), atol=1e-6, rtol=1e-6)
    state, _ = run_round(strategy, clients, state, 1)
    assert torch.isfinite(state["head"]).all()


def test_dp_noise_scale_composes_over_every_release_of_the_run(build):
    strategy, _, _ = build("fedlog-dp-central", epsilon=1.0, delta=0.01, clip=2.0)
    # rounds = 3 plus the init round: v2 sigma = sqrt(8 k (1 + d b^2) ln(e + eps/delta)) / eps
    d, k = 4, 4
    expected = (8 * k * (1 + d * 4.0) * math.log(math.e + 100)) ** 0.5
    assert strategy.sigma == pytest.approx(expected, rel=1e-12)


def test_the_v1_accountant_spends_the_budget_on_each_release(build):
    strategy, _, _ = build("fedlog-dp-central", epsilon=1.0, delta=0.01, clip=2.0,
                           accountant="single")
    # v1: sigma = sqrt(2 (1 + d b^2) ln(1.25 / delta)) / eps, whatever the number of rounds
    expected = (2 * (1 + 4 * 4.0) * math.log(1.25 / 0.01)) ** 0.5
    assert strategy.sigma == pytest.approx(expected, rel=1e-12)
    v2, _, _ = build("fedlog-dp-central", epsilon=1.0, delta=0.01, clip=2.0)
    assert v2.accountant == "k_round" and v2.sigma > strategy.sigma


def test_an_unknown_accountant_is_a_config_error(build):
    with pytest.raises(ConfigError, match="accountant"):
        build("fedlog-dp-local", accountant="rdp")


def test_local_dp_uploads_are_noisy_and_carry_no_sample_count(build):
    strategy, clients, state = build("fedlog-dp-local", epsilon=5.0)
    _, ups = run_round(strategy, clients, state, 0)
    counts = torch.bincount(clients[0].data.train_y, minlength=NUM_CLASSES).float()
    assert "num_samples" not in ups[0].tensors
    assert not torch.equal(ups[0].tensors["statistics"][:, 0], counts)
    assert strategy.sigma > 0


def test_central_dp_adds_noise_once_at_the_server_and_clamps_features(build):
    strategy, clients, state = build("fedlog-dp-central", epsilon=5.0, clip=0.5)
    plan = strategy.configure(state, 0)
    new_state, ups = run_round(strategy, clients, state, 0)
    clean = sum(u.tensors["statistics"].double() for u in ups)
    noise = new_state["statistics"] - clean
    assert noise.abs().max() > 0
    assert noise.std().item() == pytest.approx(strategy.sigma, rel=0.6)
    assert bool(new_state["privatized"].all())
    feats = network_output(strategy, clients[0])
    assert feats.max() <= 0.5
    # an upload that violates the clamp bound is rejected
    t = ups[0].tensors["statistics"].clone()
    t[:, 1:] += 100.0
    with pytest.raises(MessageRejected, match="clamp"):
        strategy.validate_upload(plan, wire(_tampered(ups[0], statistics=t)), 0)


def test_the_training_head_puts_the_bias_first():
    head = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    feats = torch.tensor([[3.0]])
    labels = torch.tensor([0])
    # logits [1 + 2 * 3, 0 - 1 * 3] = [7, -3]
    expected = torch.nn.functional.cross_entropy(torch.tensor([[7.0, -3.0]]), labels,
                                                 reduction="none")
    torch.testing.assert_close(HeadObjective(head)(feats, labels), expected)


def test_fit_group_of_fedlog_uploads_the_statistics_fit_uploads(build):
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    down = wire(strategy.configure(state, 1).broadcast)
    plain = fit_all(strategy, clients, down, generators(clients, 1))
    grouped = fit_all(strategy, clients, down, generators(clients, 1), batched=True)
    for (_, a), (_, b) in zip(plain, grouped, strict=True):
        assert torch.equal(a.tensors["num_samples"], b.tensors["num_samples"])
        # float32 rounding of vmapped vs plain Adam over the round, in sums of <= 20 features
        # (entries up to ~20: rtol 1e-5 leaves ~2e-4; measured differences are ~1e-6)
        torch.testing.assert_close(a.tensors["statistics"], b.tensors["statistics"],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{"clip": "a"}, {"clip": True}, {"clip": float("inf")},
                                     {"epsilon": float("nan")}, {"delta": "0.1"},
                                     {"clip": -1.0}, {"delta": 1.0}])
def test_dp_budget_options_must_be_finite_numbers_in_range(options):
    from strategy_helpers import context

    for name in ("fedlog-dp-local", "fedlog-dp-central"):
        with pytest.raises(ConfigError, match=r"finite number|DP needs"):
            make_strategy(name, context(), **options)


@pytest.mark.parametrize("name", ["fedlog-dp-local", "fedlog-dp-central"])
def test_an_epsilon_whose_noise_swamps_any_data_set_is_refused_with_the_smallest_usable(name):
    from strategy_helpers import context

    # epsilon 1e-300: sigma ~1e301, every local-DP upload overflowed float32 and was rejected
    with pytest.raises(ConfigError, match=rf"{name} epsilon=1e-300 is out of range: its "
                       r"Gaussian noise \(sigma .*e\+301 per cell.*larger than the statistics "
                       r"of even 1e\+09 samples per class") as info:
        make_strategy(name, context(), epsilon=1e-300)
    assert ("overflow float32" in str(info.value)) == (name == "fedlog-dp-local")
    smallest = float(re.search(r"use epsilon >= (\S+) for this run", str(info.value))[1])
    make_strategy(name, context(), epsilon=smallest)  # the bound it names is accepted
    with pytest.raises(ConfigError, match="out of range"):
        make_strategy(name, context(), epsilon=smallest / 1.1)


@pytest.mark.parametrize("value", [1e300, 2e9, -1.0, float("nan"), float("inf"), True, "1"])
def test_prior_nu_must_lie_between_0_and_a_billion_pseudo_samples(value):
    from strategy_helpers import context

    with pytest.raises(ConfigError, match=r"prior_nu must be a number in \[0, 1e\+09\], got "
                                          r".*pseudo-count of samples"):
        make_strategy("fedlog", context(), prior_nu=value)
    assert make_strategy("fedlog", context(), prior_nu=1e9).prior_nu == 1e9


# ---- DP: noise against signal, and the noise-aware posterior ----------------------------------
def test_dp_servers_record_the_noise_variance_and_noise_to_signal_of_the_sum(build):
    from inference.conjugate import privacy_signal_to_noise

    for name, releases in (("fedlog-dp-local", len(SIZES)), ("fedlog-dp-central", 1)):
        strategy, clients, state = build(name, epsilon=1.0)
        with pytest.warns(PrivacyNoiseWarning):  # 39 samples: swamped at epsilon 1
            state, _ = run_round(strategy, clients, state, 0)
        # local: every client's noise is in the sum (variances add); central: once
        assert float(state["noise_variance"]) == pytest.approx(strategy.sigma**2 * releases,
                                                               rel=1e-12)
        n = float(state["num_samples"])
        expected = privacy_signal_to_noise(
            strategy.sigma, n / NUM_CLASSES, feature_dim=FEATURE_DIM, bound=strategy.clip,
            clients=len(SIZES), placement="local" if "local" in name else "central")
        assert float(state["dp_noise_to_signal"]) == pytest.approx(expected.noise_to_signal,
                                                                   rel=1e-12)
        assert strategy.server_metrics(state) == {
            "dp_noise_to_signal": pytest.approx(expected.noise_to_signal, rel=1e-12),
            "dp_sigma": strategy.sigma,
            "dp_noise_std": pytest.approx(strategy.sigma * math.sqrt(releases), rel=1e-12)}


def test_the_noise_warning_is_raised_once_per_run_and_not_for_a_generous_budget(build):
    import warnings

    strategy, clients, state = build("fedlog-dp-local", epsilon=1.0)
    with pytest.warns(PrivacyNoiseWarning, match="raise epsilon"):
        state, _ = run_round(strategy, clients, state, 0)
    generous, generous_clients, generous_state = build("fedlog-dp-local", epsilon=1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyNoiseWarning)
        run_round(strategy, clients, state, 1)  # already said
        generous_state, _ = run_round(generous, generous_clients, generous_state, 0)
    assert float(generous_state["dp_noise_to_signal"]) < 0.5


@pytest.mark.parametrize(("name", "count_from_noise"), [("fedlog-dp-local", True),
                                                        ("fedlog-dp-central", False)])
def test_dp_clients_evaluate_with_the_noise_aware_posterior(build, name, count_from_noise):
    from inference.conjugate import NoisyConjugatePosterior

    strategy, clients, state = build(name, epsilon=1.0)
    with pytest.warns(PrivacyNoiseWarning):
        state, _ = run_round(strategy, clients, state, 0)
    broadcast = evaluation_broadcast(strategy, state)
    assert torch.equal(broadcast.tensors["noise_variance"], state["noise_variance"])
    head = strategy.head_posterior(broadcast)
    assert isinstance(head, NoisyConjugatePosterior)
    assert head.noise_variance == float(state["noise_variance"])
    assert head.count_from_noise is count_from_noise
    face, _, _ = build(name, epsilon=1.0, noise_aware=False)
    face_head = face.head_posterior(broadcast)
    assert type(face_head) is ConjugatePosterior
    # the same MAP (the head clients train with is untouched), a wider posterior
    assert torch.equal(head.map(), face_head.map())
    assert torch.equal(state["head"], face_head.map().float())
    assert bool((head.laplace().marginal_variances()
                 > face_head.laplace().marginal_variances()).all())
    x = clients[0].data.test_x
    aware = strategy.predict(clients[0].config, clients[0].state, broadcast, x)
    plain = face.predict(clients[0].config, clients[0].state, broadcast, x)
    assert torch.equal(aware[MAP_PLUGIN], plain[MAP_PLUGIN])
    assert float(aware[PREDICTIVE].max(1).values.mean()) < float(
        plain[PREDICTIVE].max(1).values.mean())


def test_noise_aware_must_be_true_or_false():
    from strategy_helpers import context

    with pytest.raises(ConfigError, match="noise_aware"):
        make_strategy("fedlog-dp-local", context(), noise_aware="yes")


@pytest.mark.trained
def test_a_dp_run_on_digits_reports_its_noise_to_signal_and_warns_only_when_swamped():
    import warnings

    from bayesfl.simulate import simulate

    common = dict(dataset="digits", clients=20, rounds=1, seed=0, progress=False, threads=1)
    with pytest.warns(PrivacyNoiseWarning, match="swamps"):
        swamped = simulate(strategy="fedlog-dp-local", strategy_options={"epsilon": 1.0},
                           **common)
    assert swamped.summary["dp_noise_to_signal"] > 1
    assert all("dp_noise_to_signal" in record for record in swamped.metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyNoiseWarning)
        useful = simulate(strategy="fedlog-dp-central", strategy_options={"epsilon": 8.0},
                          **common)
    assert useful.summary["dp_noise_to_signal"] < 0.5
    assert useful.summary["accuracy"] > 0.9


def _local_uploads(strategy, round_, total_count):
    """Three local-DP uploads whose noisy count columns sum to ``total_count``."""
    uploads = []
    for cid in range(len(SIZES)):
        table = torch.zeros(NUM_CLASSES, FEATURE_DIM + 1)
        table[:, 0] = total_count / (len(SIZES) * NUM_CLASSES)
        uploads.append(strategy.up_message(round_, cid, {"statistics": table}))
    return uploads


def test_local_dp_averages_the_noisy_count_over_rounds_and_warns_only_beyond_its_error(build):
    import warnings

    from inference.conjugate import l2_sensitivity

    strategy, _, state = build("fedlog-dp-local", epsilon=0.2)
    R, C = len(SIZES), NUM_CLASSES
    # the count at which the noise-to-signal is 0.5, and the standard error of one noisy count
    threshold = (strategy.sigma * math.sqrt(R * (FEATURE_DIM + 1)) * C
                 / (0.5 * l2_sensitivity(FEATURE_DIM, strategy.clip)))
    error = strategy.sigma * math.sqrt(R * C)
    assert threshold > 1000  # counts are rounded to integers: 5e-4 relative at most
    assert error > 0.2 * threshold  # a noisy count can move the figure across 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyNoiseWarning)
        # above 0.5 at the count released, below at one standard error more: no warning
        state = strategy.aggregate(state, _local_uploads(strategy, 0, threshold - 0.5 * error), 0,
                                   torch.Generator().manual_seed(0))
    assert float(state["dp_noise_to_signal"]) > 0.5
    # the figure uses the mean of the counts released so far: (t - e/2 + t + 3e/2) / 2 = t + e/2
    state = strategy.aggregate(state, _local_uploads(strategy, 1, threshold + 1.5 * error), 1,
                               torch.Generator().manual_seed(1))
    expected = strategy.noise_report(threshold + 0.5 * error, R).noise_to_signal
    assert float(state["dp_noise_to_signal"]) == pytest.approx(expected, rel=1e-3)
    assert float(state["dp_noise_to_signal"]) < 0.5
    # far below the count where the noise is tolerable: warned, even counting the error
    fresh, _, fresh_state = build("fedlog-dp-local", epsilon=0.2)
    with pytest.warns(PrivacyNoiseWarning, match="degrades|swamps"):
        fresh.aggregate(fresh_state, _local_uploads(fresh, 0, threshold - 2 * error), 0,
                        torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name, options", [
    ("fedlog", {}), ("fedlog", {"feature_scale": 1.0}),
    ("fedlog", {"feature_scale": 1.0, "upload_dtype": "float64"}),
    ("fedlog", {"upload_dtype": "float64"}), ("fedlog", {"feature_scale": "evidence"}),
    ("fedlog-dp-local", {"epsilon": 5.0, "clip": 1.0})])
def test_a_groups_uploads_are_byte_for_byte_those_built_one_client_at_a_time(
        build, name, options):
    # fit_group converts the K statistic tables once and hands out rows of the stacks; the
    # encoded messages must be the bytes of one _upload per client (what fit sends), for
    # every upload dtype and optional entry; a noisy release (local DP) draws each client's
    # noise from its own generator, so both forms must consume the generators alike
    from bayesfl.messages import encode

    strategy, clients, _ = build(name, **options)
    g = torch.Generator().manual_seed(0)
    k = len(clients)
    tables = torch.rand(k, NUM_CLASSES, FEATURE_DIM + 1, generator=g, dtype=torch.float64)
    squares = (torch.rand(k, generator=g, dtype=torch.float64) if strategy.evidence
               else [None] * k)
    scores = ([(torch.rand(3, generator=g, dtype=torch.float64),
                torch.tensor([2.0], dtype=torch.float64),
                torch.rand(NUM_CLASSES, FEATURE_DIM + 1, generator=g, dtype=torch.float64))
               for _ in range(k)] if strategy.heldout else [None] * k)
    configs, datas = [c.config for c in clients], [c.data for c in clients]
    one_by_one = [strategy._upload(c, d, 1, t, gen, q, h)
                  for c, d, t, gen, q, h in zip(configs, datas, tables, generators(clients, 1),
                                                squares, scores, strict=True)]
    grouped = strategy._uploads(configs, datas, 1, tables, generators(clients, 1), squares,
                                scores)
    assert [encode(m) for m in grouped] == [encode(m) for m in one_by_one]
    assert [m.header for m in grouped] == [m.header for m in one_by_one]
