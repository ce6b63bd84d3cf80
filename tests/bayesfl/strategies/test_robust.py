"""Robust aggregation: the rules against independent references, screening of absurd uploads,
the declared-sample ledger, the one screening API every strategy's upload checks go through,
and parameter averaging with each option."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats
from strategy_helpers import context, fit_all, generators, make_clients, run_round, wire

from bayesfl.errors import ConfigError
from bayesfl.messages import Message
from bayesfl.strategies import make_strategy
from bayesfl.strategies.averaging.parameter_averaging import shared_state
from bayesfl.strategies.robust import (
    coordinate_median,
    count_problems,
    declarations,
    declared_problems,
    norm_scales,
    screen,
    screening_reasons,
    trimmed_mean,
)


# ---- the rules, against numpy / scipy ------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5, 6])
def test_coordinate_median_is_numpys_median(k):
    x = torch.randn(k, 3, 4, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    np.testing.assert_array_equal(coordinate_median(x).numpy(), np.median(x.numpy(), axis=0))


@pytest.mark.parametrize(("k", "beta"), [(5, 0.1), (10, 0.1), (10, 0.25), (7, 0.3), (4, 0.0)])
def test_trimmed_mean_is_scipys_trim_mean(k, beta):
    x = torch.randn(k, 6, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    # both drop floor(beta k) values at each end; equal up to summation order (1 ulp-ish)
    np.testing.assert_allclose(trimmed_mean(x, beta).numpy(),
                               stats.trim_mean(x.numpy(), beta, axis=0), rtol=1e-14, atol=1e-15)


def test_norm_scales_clip_only_the_updates_above_the_bound():
    norms = torch.tensor([0.5, 2.0, 8.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(norm_scales(norms, 2.0),
                               torch.tensor([1.0, 1.0, 0.25, 1.0], dtype=torch.float64))
    assert torch.equal(norm_scales(norms, None), torch.ones(4, dtype=torch.float64))


def test_screening_compares_with_the_lower_median_so_two_clients_suffice():
    flags = screen(torch.tensor([1.0, 1e3]), 10.0)
    assert flags.tolist() == [False, True]
    # lower median 2: 25 > 10 x 2 is flagged, 19 is not
    assert screen(torch.tensor([1.0, 2.0, 19.0, 25.0]), 10.0).tolist() == [False] * 3 + [True]
    assert not screen(torch.tensor([5.0]), 10.0).any()  # one upload: nothing to compare with
    assert not screen(torch.tensor([0.0, 0.0, 3.0]), 10.0).any()  # no scale: no verdict
    assert not screen(torch.tensor([1.0, 1e9]), None).any()


def test_the_ledger_keeps_the_first_declared_count_and_flags_larger_later_ones():
    ledger = declarations({}, [3, 4], [60, 80])
    ledger = declarations(ledger, [3], [50])  # a smaller count does not replace the first
    assert {k: int(v) for k, v in ledger.items()} == {"declared/3": 60, "declared/4": 80}
    reasons = declared_problems(ledger, [3, 4, 5], [60, 10**7, 10**7])
    assert reasons[0] is None and reasons[2] is None  # equal; a client never seen before
    assert "num_samples 10000000 exceeds the 80 this client declared" in reasons[1]


# ---- the one screening API -----------------------------------------------------------------
def test_a_screening_reason_names_the_value_the_ratio_and_the_rounds_lower_median():
    values = torch.tensor([4.0, 6.0, 100.0, 5.0], dtype=torch.float64)  # lower median 5
    assert screening_reasons(values, 10.0, "total count") == [
        None, None, "total count 100 is more than 10x the round's median 5 (screening_ratio)",
        None]
    assert screening_reasons(values, None, "total count") == [None] * 4


def test_count_problems_check_the_count_then_the_ledger_then_the_rounds_median():
    # one upload per rule, and one breaking all three at once, which gets the first reason
    _, plan, _, ups = round_uploads()
    ledger = declarations({}, [u.header.client_id for u in ups], SIZES)
    plan = dataclasses.replace(plan, state={**plan.state, **ledger})
    ups = [tampered(ups[0], num_samples=0), tampered(ups[1], num_samples=SIZES[1] + 1),
           *ups[2:]]
    assert count_problems(plan, ups, 10.0) == [
        "num_samples must be >= 1, got 0",
        f"num_samples {SIZES[1] + 1} exceeds the {SIZES[1]} this client declared in its first "
        "accepted upload", None, None, None]
    fresh = dataclasses.replace(plan, state={})  # no ledger yet: only the median screens
    ups[4] = tampered(ups[4], num_samples=10**6)
    reasons = count_problems(fresh, ups, 10.0)
    # counts 0, 21, 7, 15, 10**6: the median is 15, so only the inflated one is flagged
    assert reasons[1:4] == [None] * 3
    assert reasons[4] == ("num_samples 1e+06 is more than 10x the round's median 15 "
                          "(screening_ratio)")
    assert count_problems(fresh, ups, None)[1:] == [None] * 4  # ratio None: counts unscreened


SCREENED_COUNTS = [("fedavg", "num_samples", "num_samples"),
                   ("fedpa", "num_samples", "num_samples"),
                   ("fedpop", "num_samples", "num_samples"),
                   ("pfedbayes", "num_samples", "num_samples"),
                   ("colearn", "counts", "total count"),
                   ("fd", "counts", "total count")]


@pytest.mark.parametrize(("name", "tensor", "what"), SCREENED_COUNTS)
def test_every_strategy_screens_an_inflated_count_with_the_same_rule_and_words(name, tensor,
                                                                               what):
    # an honest round with one client's sample count(s) multiplied by 10**6: each strategy
    # rejects it, only it, with the reason screening_reasons words for the round's values
    strategy, plan, _, ups = round_uploads(name)
    inflated = {**ups[2].tensors, tensor: ups[2].tensors[tensor] * 10**6}
    ups[2] = Message(ups[2].header, inflated)
    totals = torch.tensor([float(u.tensors[tensor].sum()) for u in ups], dtype=torch.float64)
    reasons = verdicts(strategy, plan, ups)
    assert reasons == screening_reasons(totals, 10.0, what)
    assert reasons[2] is not None and [k for k, r in enumerate(reasons) if r] == [2]


@pytest.mark.parametrize("options", [{"aggregation": "krum"}, {"trim_fraction": 0.5},
                                     {"trim_fraction": -0.1}, {"norm_bound": 0.0},
                                     {"norm_bound": math.inf}, {"screening_ratio": 1.0},
                                     {"screening_ratio": "10"}, {"trim_fraction": True}])
def test_invalid_robust_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        make_strategy("fedavg", context(), **options)


# ---- parameter averaging with the options ---------------------------------------------------
SIZES = (12, 20, 7, 15, 9)


def round_uploads(name="fedavg", **options):
    """Strategy, plan and honestly trained uploads of round 1 (not yet aggregated)."""
    strategy = make_strategy(name, context(sizes=SIZES), **options)
    clients = make_clients(strategy, SIZES)
    state = strategy.init()
    plan = strategy.configure(state, 1)
    down = wire(plan.broadcast)
    ups = [wire(u) for _, u in fit_all(strategy, clients, down, generators(clients, 1))]
    return strategy, plan, state, ups


def tampered(upload: Message, scale: float = 1.0, num_samples: int | None = None) -> Message:
    tensors = {k: v * scale if k != "num_samples" else v for k, v in upload.tensors.items()}
    if num_samples is not None:
        tensors["num_samples"] = torch.tensor([num_samples], dtype=torch.int64)
    return Message(upload.header, tensors)


def verdicts(strategy, plan, ups):
    return strategy.validate_uploads(plan, ups, [u.header.client_id for u in ups])


def test_honest_uploads_pass_screening():
    strategy, plan, _, ups = round_uploads()
    assert verdicts(strategy, plan, ups) == [None] * len(SIZES)


@pytest.mark.parametrize("scale", [1e3, 1e6, 1e30])
def test_scaled_parameters_are_rejected_by_update_norm_screening(scale):
    strategy, plan, _, ups = round_uploads()
    ups[2] = tampered(ups[2], scale)
    reasons = verdicts(strategy, plan, ups)
    assert reasons[2].startswith("update norm") and "screening_ratio" in reasons[2]
    assert reasons[:2] + reasons[3:] == [None] * 4


def test_an_inflated_sample_count_is_rejected():
    strategy, plan, _, ups = round_uploads()
    ups[0] = tampered(ups[0], -1.0, num_samples=2**40)  # sign flip with an absurd weight
    reasons = verdicts(strategy, plan, ups)
    assert reasons[0].startswith("num_samples 1.1e+12 is more than 10x")


def test_a_count_above_the_first_declared_one_is_rejected_in_later_rounds():
    strategy = make_strategy("fedavg", context(sizes=SIZES))
    clients = make_clients(strategy, SIZES)
    state, _ = run_round(strategy, clients, strategy.init(), 1)
    plan = strategy.configure(state, 2)
    ups = [wire(u) for _, u in fit_all(strategy, clients, wire(plan.broadcast),
                                       generators(clients, 2))]
    ups[1] = tampered(ups[1], num_samples=SIZES[1] + 1)
    assert verdicts(strategy, plan, ups)[1] == (
        f"num_samples {SIZES[1] + 1} exceeds the {SIZES[1]} this client declared in its first "
        "accepted upload")


def test_screening_can_be_switched_off():
    strategy, plan, _, ups = round_uploads(screening_ratio=None)
    ups[2] = tampered(ups[2], 1e3)
    assert verdicts(strategy, plan, ups) == [None] * len(SIZES)


def stacked(ups, name):
    return np.stack([u.tensors[name].double().numpy() for u in ups])


@pytest.mark.parametrize(("aggregation", "reference"), [
    ("median", lambda x: np.median(x, axis=0)),
    ("trimmed-mean", lambda x: stats.trim_mean(x, 0.2, axis=0)),
])
def test_robust_aggregation_is_the_coordinate_wise_rule(aggregation, reference):
    strategy, _, state, ups = round_uploads(aggregation=aggregation, trim_fraction=0.2)
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    for name in shared_state(state):
        np.testing.assert_allclose(new[name].numpy(), reference(stacked(ups, name)),
                                   rtol=1e-6, atol=1e-7)  # float32 storage of the result


def test_one_absurd_upload_barely_moves_the_median():
    strategy, _, state, ups = round_uploads(aggregation="median", screening_ratio=None)
    clean = strategy.aggregate(state, ups[1:], 1, torch.Generator())
    poisoned = strategy.aggregate(state, [tampered(ups[0], 1e30), *ups[1:]], 1,
                                  torch.Generator())
    for name in shared_state(state):  # 5 values vs 4 honest ones: the median stays inside
        honest = stacked(ups[1:], name)
        assert (poisoned[name].numpy() <= honest.max(0) + 1e-7).all()
        assert (poisoned[name].numpy() >= honest.min(0) - 1e-7).all()
        assert torch.isfinite(clean[name]).all()


def test_norm_bounding_clips_each_update_before_the_weighted_mean():
    bound = 0.05
    strategy, _, state, ups = round_uploads(norm_bound=bound)
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    names = sorted(shared_state(state))
    start = {n: state[n].double().numpy() for n in names}
    updates = [{n: u.tensors[n].double().numpy() - start[n] for n in names} for u in ups]
    norms = [math.sqrt(sum((d[n] ** 2).sum() for n in names)) for d in updates]
    assert max(norms) > bound  # the bound is active for this check to mean anything
    weights = np.array(SIZES, dtype=np.float64) / sum(SIZES)
    for n in names:
        want = start[n] + sum(w * min(1.0, bound / nrm) * d[n]
                              for w, nrm, d in zip(weights, norms, updates, strict=True))
        np.testing.assert_allclose(new[n].numpy(), want, rtol=1e-6, atol=1e-7)


def test_without_options_the_aggregate_is_bit_identical_to_the_plain_weighted_mean():
    strategy, _, state, ups = round_uploads()
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    weights = torch.tensor(SIZES, dtype=torch.float64)
    weights = weights / weights.sum()
    for name in shared_state(state):
        want = torch.tensordot(weights, torch.stack([u.tensors[name].double() for u in ups]),
                               dims=1).float()
        assert torch.equal(new[name], want)


# ---- FedLog: what an honest statistic satisfies ------------------------------------------------
def fedlog_round(**options):
    # the paper's s = 1: the uploads are the statistics of every training example (the
    # held-out default keeps a slice apart, tests/bayesfl/strategies/fedlog)
    options = {"feature_scale": 1.0} | options
    strategy = make_strategy("fedlog", context(sizes=SIZES), **options)
    clients = make_clients(strategy, SIZES)
    state = strategy.init()
    plan = strategy.configure(state, 0)
    ups = [wire(u) for _, u in fit_all(strategy, clients, wire(plan.broadcast),
                                       generators(clients, 0))]
    return strategy, clients, plan, state, ups


def with_statistics(upload: Message, table: torch.Tensor, n: int | None = None) -> Message:
    tensors = dict(upload.tensors, statistics=table.to(upload.tensors["statistics"].dtype))
    if n is not None:
        tensors["num_samples"] = torch.tensor([n], dtype=torch.int64)
    return Message(upload.header, tensors)


def test_honest_fedlog_statistics_pass_every_bound():
    strategy, _, plan, _, ups = fedlog_round()
    assert verdicts(strategy, plan, ups) == [None] * len(SIZES)


def test_feature_sums_of_1e30_are_rejected_by_the_feature_bound():
    strategy, _, plan, _, ups = fedlog_round()
    table = ups[1].tensors["statistics"].double().clone()
    table[:, 1:] = torch.where(table[:, :1] > 0, 1e30, 0.0)
    reasons = verdicts(strategy, plan, [*ups[:1], with_statistics(ups[1], table), *ups[2:]])
    assert reasons[1] == "feature sums exceed the feature bound 1000 times the class counts"
    assert reasons[0] is None and reasons[2:] == [None] * 3


def test_a_consistent_but_inflated_count_is_rejected_by_screening():
    # 1e7 samples on a client of 20, with counts and sums made consistent: only the
    # comparison with the other clients gives it away
    strategy, _, plan, _, ups = fedlog_round()
    table = ups[1].tensors["statistics"].double() * 500_000
    reasons = verdicts(strategy, plan, [*ups[:1], with_statistics(ups[1], table, 10**7),
                                        *ups[2:]])
    assert reasons[1].startswith("num_samples 1e+07 is more than 100x the round's median")


def test_a_fedlog_count_above_the_first_declared_one_is_rejected():
    strategy, clients, _, state, ups = fedlog_round()
    state = strategy.aggregate(state, ups, 0, torch.Generator())
    assert int(state["declared"][3]) == SIZES[3]  # the ledger: one row per client
    plan = strategy.configure(state, 1)
    ups = [wire(u) for _, u in fit_all(strategy, clients, wire(plan.broadcast),
                                       generators(clients, 1))]
    table = ups[3].tensors["statistics"].double().clone()
    table[0] += torch.cat([torch.ones(1), table[0, 1:] / table[0, 0].clamp_min(1)])
    reasons = verdicts(strategy, plan, [*ups[:3], with_statistics(ups[3], table, SIZES[3] + 1),
                                        ups[4]])
    assert reasons[3] == (f"num_samples {SIZES[3] + 1} exceeds the {SIZES[3]} this client "
                          "declared in its first accepted upload")


def test_clients_clamp_features_at_the_feature_bound_so_honest_uploads_always_pass():
    strategy, clients, plan, _, ups = fedlog_round(feature_bound=0.05)
    assert verdicts(strategy, plan, ups) == [None] * len(SIZES)
    c = clients[0]
    from strategy_helpers import network_output
    features = network_output(strategy, c).double()
    assert features.max() > 0.05  # the clamp is active
    table = torch.zeros_like(ups[0].tensors["statistics"], dtype=torch.float64)
    table[:, 0] = torch.bincount(c.data.train_y, minlength=table.shape[0]).double()
    table[:, 1:].index_add_(0, c.data.train_y, features.clamp(max=0.05))
    torch.testing.assert_close(ups[0].tensors["statistics"].double(), table,
                               rtol=1e-6, atol=1e-7)  # float32 upload


def test_median_statistics_aggregation_uses_the_median_class_mean_times_the_count():
    strategy, _, _, state, ups = fedlog_round(statistics_aggregation="median",
                                              absent_clients="omit")
    new = strategy.aggregate(state, ups, 0, torch.Generator())
    tables = np.stack([u.tensors["statistics"].double().numpy() for u in ups])
    counts = tables[:, :, 0]
    want = np.zeros_like(tables[0])
    want[:, 0] = counts.sum(0)
    for y in range(tables.shape[1]):
        holders = counts[:, y] > 0
        means = tables[holders, y, 1:] / counts[holders, y, None]
        want[y, 1:] = counts[:, y].sum() * np.median(means, axis=0)
    np.testing.assert_allclose(new["statistics"].numpy(), want, rtol=1e-12, atol=1e-12)


def test_median_statistics_aggregation_is_refused_for_noisy_local_dp_uploads():
    with pytest.raises(ConfigError, match="needs exact class counts"):
        make_strategy("fedlog-dp-local", context(), statistics_aggregation="median")
    with pytest.raises(ConfigError, match="set clip, not feature_bound"):
        make_strategy("fedlog-dp-central", context(), feature_bound=3.0)
