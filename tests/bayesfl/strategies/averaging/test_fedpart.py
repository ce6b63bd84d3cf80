"""FedPart: the schedule, partial rounds for real (uploads, frozen parameters, backward,
bytes), FedProx under the schedule, and resume mid-cycle."""

import json

import pytest
import torch
from strategy_helpers import Client, make_client_data, wire
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.layer_groups import layer_groups
from bayesfl.messages import Message, encode
from bayesfl.simulate import simulate
from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.averaging.fedpart_schedule import (
    FULL,
    SYNCED,
    FedPartSchedule,
    schedule_from_option,
)
from bayesfl.training import LocalTraining, train_plain

BODY = "resnet8:4-4-8"  # BatchNorm body, two conv shortcuts, 10 groups with its head
SHAPE = (64,)           # flat 8x8 images


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny networks: one intra-op thread is fastest (and fair to a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paper_map(r, G=10, R=2, F=5):
    """Spec fedpart.md §1.3's pseudo-code, written independently: 0-indexed t = r - 1."""
    s = (r - 1) % (F + R * G)
    return FULL if s < F else (s - F) // R


def test_schedule_round_to_group_map_of_the_papers_resnet8_defaults():
    schedule = FedPartSchedule(10, rounds_per_group=2, full_rounds_per_cycle=5,
                               warmup_rounds=5, cycles=5)
    assert schedule.total_rounds == 125  # spec: L = 25, C = 5, T = 125
    got = [schedule.group_at(r) for r in range(1, 126)]
    assert got == [paper_map(r) for r in range(1, 126)]
    assert got[:7] == [FULL] * 5 + [0, 0] and got[23:31] == [9, 9] + [FULL] * 5 + [0]
    assert schedule.upload_fraction() == pytest.approx(7 / 25)  # the paper's 28%
    with pytest.raises(ConfigError, match="past the schedule"):
        schedule.group_at(126)


def test_ablation_schedule_runs_sweeps_back_to_back_and_orders_differ():
    ablation = FedPartSchedule(10, rounds_per_group=2, full_rounds_per_cycle=0,
                               warmup_rounds=5)
    # spec §1.3: the cycle ends fall at r = 25, 45, 65
    assert [ablation.group_at(r) for r in (25, 26, 45, 46, 65)] == [9, 0, 9, 0, 9]
    rev = FedPartSchedule(10, order="rev")
    assert [rev.group_at(r) for r in (6, 7, 8, 25)] == [9, 9, 8, 0]
    perm = FedPartSchedule(10, order="random-perm", seed=3)
    sweep = [perm.group_at(r) for r in range(6, 26, 2)]
    assert sorted(sweep) == list(range(10)) and sweep != list(range(10))
    uniform = FedPartSchedule(10, order="random", seed=3)
    draws = [uniform.group_at(r) for r in range(6, 26)]
    assert draws == [FedPartSchedule(10, order="random", seed=3).group_at(r)
                     for r in range(6, 26)]  # a pure function of round and seed
    assert len(set(draws)) > 3
    with pytest.raises(ConfigError, match="order"):
        FedPartSchedule(10, order="shuffle")


def test_random_perm_draws_a_fresh_permutation_of_the_groups_every_cycle():
    # W = F = 1, R = 2, G = 8: cycle c's sweep is rounds 2 + 17c + (0..15), two per group;
    # every sweep visits each group once, in its own order (8! orders: no two of these six
    # cycles share one), and the schedule is a pure function of round and seed
    schedule = FedPartSchedule(8, rounds_per_group=2, full_rounds_per_cycle=1, warmup_rounds=1,
                               order="random-perm", seed=11)
    sweeps = []
    for cycle in range(6):
        start = 2 + 17 * cycle
        assert schedule.group_at(start - 1) == FULL
        groups = [schedule.group_at(r) for r in range(start, start + 16)]
        assert groups[::2] == groups[1::2]  # R = 2 rounds on each group
        assert sorted(groups[::2]) == list(range(8))
        sweeps.append(tuple(groups[::2]))
    assert len(set(sweeps)) == 6
    again = FedPartSchedule(8, rounds_per_group=2, full_rounds_per_cycle=1, warmup_rounds=1,
                            order="random-perm", seed=11)
    assert [again.group_at(r) for r in range(1, 103)] == [schedule.group_at(r)
                                                          for r in range(1, 103)]
    other = FedPartSchedule(8, rounds_per_group=2, full_rounds_per_cycle=1, warmup_rounds=1,
                            order="random-perm", seed=12)
    assert [other.group_at(r) for r in range(1, 103)] != [schedule.group_at(r)
                                                          for r in range(1, 103)]


@pytest.mark.parametrize("name, low", [("num_groups", 1), ("rounds_per_group", 1),
                                       ("full_rounds_per_cycle", 0), ("warmup_rounds", 0)])
def test_each_count_option_is_an_integer_at_or_above_its_bound(name, low):
    given = {"num_groups": 3, name: low}
    assert getattr(FedPartSchedule(**given), name) == low  # the bound itself is accepted
    for bad in (low - 1, True, False, float(low + 1), str(low + 1)):
        with pytest.raises(ConfigError,
                           match=rf"fedpart {name} must be an integer >= {low}, got {bad!r}"):
            FedPartSchedule(**{**given, name: bad})


def test_cycles_is_none_or_an_integer_at_least_one():
    assert FedPartSchedule(3, cycles=None).total_rounds is None
    assert FedPartSchedule(3, cycles=1).total_rounds == 5 + 6  # W + G R
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ConfigError,
                           match=rf"fedpart cycles must be an integer >= 1 or None, got {bad!r}"):
            FedPartSchedule(3, cycles=bad)
    with pytest.raises(ConfigError, match=r"fedpart order must be one of .*'random-perm'.*"
                                          r"got 'shuffle'"):
        FedPartSchedule(3, order="shuffle")


def test_position_is_the_cycle_and_sweep_slot_of_a_one_based_round():
    # W = 2, G = 3, R = 2, F = 1: cycle 0 is rounds 1-8, cycle 1 rounds 9-15, cycle 2 16-22
    schedule = FedPartSchedule(3, rounds_per_group=2, full_rounds_per_cycle=1, warmup_rounds=2,
                               cycles=3)
    sweep = [0, 0, 1, 1, 2, 2]
    assert [schedule.position(r) for r in range(1, 23)] == (
        [(0, None)] * 2 + [(0, j) for j in sweep] + [(1, None)] + [(1, j) for j in sweep]
        + [(2, None)] + [(2, j) for j in sweep])
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ConfigError, match=rf"fedpart rounds are 1-based integers, "
                                              rf"got {bad!r}"):
            schedule.position(bad)
    with pytest.raises(ConfigError, match=r"round 23 is past the schedule's 3 cycle\(s\) "
                                          r"\(22 rounds\)"):
        schedule.position(23)


def test_random_orders_are_pinned_per_seed_and_random_draws_each_round_afresh():
    # a run's schedule is a pure function of (seed, round): these values must not change
    # between versions, or a resumed run would train other groups than it started with
    def draws(order, seed):
        schedule = FedPartSchedule(4, rounds_per_group=1, full_rounds_per_cycle=0,
                                   warmup_rounds=0, order=order, seed=seed)
        return [schedule.group_at(r) for r in range(1, 13)]

    assert draws("random", 5) == [2, 1, 1, 2, 3, 0, 3, 1, 1, 3, 2, 2]  # repeats within a sweep
    assert draws("random-perm", 5) == [2, 3, 0, 1, 2, 0, 3, 1, 0, 3, 1, 2]  # a perm per sweep
    assert draws("random", 6) != draws("random", 5)
    assert draws("random-perm", 6) != draws("random-perm", 5)


def test_describe_lists_the_schedule_one_line_per_block():
    schedule = FedPartSchedule(3, rounds_per_group=2, full_rounds_per_cycle=1, warmup_rounds=2,
                               cycles=2)
    assert schedule.describe(15, ["a", "b", "c"]) == "\n".join([
        "FedPart schedule: G=3 groups, R=2, F=1, warm-up=2, cycles=2, order=seq",
        "  rounds 1-2: FULL",
        "  rounds 3-4: group 1 (a)",
        "  rounds 5-6: group 2 (b)",
        "  rounds 7-8: group 3 (c)",
        "  rounds 9: FULL",
        "  rounds 10-11: group 1 (a)",
        "  rounds 12-13: group 2 (b)",
        "  rounds 14-15: group 3 (c)"])
    # a run that ends mid-block ends its last line there; no names, no parentheses
    assert schedule.describe(10).splitlines()[1:] == [
        "  rounds 1-2: FULL", "  rounds 3-4: group 1", "  rounds 5-6: group 2",
        "  rounds 7-8: group 3", "  rounds 9: FULL", "  rounds 10: group 1"]
    assert schedule.describe(1).splitlines()[1:] == ["  rounds 1: FULL"]


def test_schedule_option_is_none_fedpart_or_a_fedpart_dict_of_known_options():
    assert schedule_from_option(None) is None
    assert schedule_from_option("fedpart") == {"kind": "fedpart"}
    given = {"kind": "fedpart", "rounds_per_group": 1, "full_rounds_per_cycle": 0,
             "warmup_rounds": 3, "cycles": 2, "order": "rev", "group_prefixes": ["head"],
             "min_group_size": 10, "downlink": "full"}
    got = schedule_from_option(given)
    assert got == given and got is not given
    for bad in ("fedavg", {"kind": "fedavg"}, {"rounds_per_group": 1}, ["fedpart"], 3):
        with pytest.raises(ConfigError, match=r"schedule must be None, 'fedpart' or a dict "
                                              r"with kind 'fedpart'.*got "):
            schedule_from_option(bad)
    with pytest.raises(ConfigError, match=r"unknown fedpart schedule option\(s\) \['R', "
                                          r"'seed'\]; valid: rounds_per_group, "
                                          r"full_rounds_per_cycle, warmup_rounds, cycles, "
                                          r"order, group_prefixes, min_group_size, downlink"):
        schedule_from_option({"kind": "fedpart", "seed": 1, "R": 2})


def context(rounds=12, clients=3):
    return StrategyContext(3, 8, LocalTraining(epochs=1, lr=1e-2, batch_size=8), rounds=rounds,
                           input_shape=SHAPE, bodies=(BODY,), clients=clients)


OPTIONS = dict(warmup_rounds=1, full_rounds_per_cycle=1, rounds_per_group=1)


def make(name="fedpart", clients=3, **options):
    strategy = make_strategy(name, context(clients=clients), **{**OPTIONS, **options})
    people = []
    for k in range(clients):
        config = strategy.context.client_config(k)
        data = make_client_data(k, 10, 4, seed=k)
        data.train_x = torch.randn(10, 64, generator=torch.Generator().manual_seed(k))
        data.test_x = torch.randn(4, 64, generator=torch.Generator().manual_seed(50 + k))
        people.append(Client(config, data, strategy.init_client(config)))
    return strategy, people, strategy.init()


def play(strategy, clients, state, r):
    """One round as a transport plays it; returns (plan, new state, uploads, new states)."""
    plan = strategy.configure(state, r)
    down = wire(plan.broadcast)
    ups = []
    for c in clients:
        c.state, up = strategy.fit(c.config, c.state, c.data, down,
                                   torch.Generator().manual_seed(100 * r + c.config.client_id))
        ups.append(wire(up))
    assert strategy.validate_uploads(plan, ups, [c.config.client_id for c in clients]) \
        == [None] * len(ups)
    return plan, strategy.aggregate(state, ups, r, torch.Generator()), ups


def test_partial_uploads_hold_exactly_the_active_group_and_the_rest_stays():
    strategy, clients, state = make()
    groups = strategy.groups(BODY)
    assert len(groups) == 10 and groups[-1].name == "head"
    plan, state, ups = play(strategy, clients, state, 1)  # FULL
    assert set(ups[0].tensors) == set(state) - {k for k in state if k.startswith("declared")} \
        | {"num_samples"}
    for r in range(2, 6):  # partial rounds on groups 1..4
        g = groups[strategy.group_at(r)]
        before = dict(state)
        plan, state, ups = play(strategy, clients, state, r)
        for up in ups:
            assert set(up.tensors) == set(g.names) | {"num_samples"}
        assert set(plan.upload_schema) == set(g.names) | {"num_samples"}
        for name, value in before.items():  # the server changes only the group it got
            if name not in g.names and not name.startswith("declared"):
                assert torch.equal(state[name], value), name
        assert any(not torch.equal(state[n], before[n]) for n in g.parameters)
    # a full upload in a partial round breaks that round's schema
    full = {k: torch.zeros_like(v) for k, v in state.items() if not k.startswith("declared")}
    full["num_samples"] = torch.tensor([10])
    plan = strategy.configure(state, 6)
    bad = wire(Message(ups[0].header.__class__(strategy.name, 6, 0, "up"), full))
    assert strategy.validate_uploads(plan, [bad], [0])[0] is not None


def test_the_broadcast_carries_the_groups_changed_since_the_previous_round():
    strategy, clients, state = make()
    for r in (1, 2, 3):
        _, state, _ = play(strategy, clients, state, r)
    names = set(strategy.configure(state, 4).broadcast.tensors)
    groups = strategy.groups(BODY)
    assert names == set(groups[1].names) | set(groups[2].names)  # round 3's and round 4's
    full = make(downlink="full")[0]
    assert set(full.configure(state, 4).broadcast.tensors) == set(strategy.configure(
        state, 1).broadcast.tensors)
    # a client that missed round 3 cannot complete its model from a changed-only broadcast
    clients[0].state = {**clients[0].state, SYNCED: torch.tensor([1])}
    with pytest.raises(ConfigError, match="downlink='full'"):
        strategy.fit(clients[0].config, clients[0].state, clients[0].data,
                     wire(strategy.configure(state, 4).broadcast), torch.Generator())


def test_frozen_parameters_and_statistics_stay_bit_identical_on_the_client():
    strategy, clients, state = make()
    _, state, _ = play(strategy, clients, state, 1)
    r = 5  # group 4: stage-2 conv1 + bn1 (mid network)
    g = strategy.groups(BODY)[strategy.group_at(r)]
    assert g.name == "body.layers.1.0.conv1"
    c = clients[0]
    broadcast = wire(strategy.configure(state, r).broadcast)
    c.state[SYNCED] = torch.tensor([r - 1])
    start = strategy.global_model(c.config, c.state, broadcast, frozenset(broadcast.tensors))
    start = {"model." + k: v.clone() for k, v in start.state_dict().items()}
    new, _ = strategy.fit(c.config, c.state, c.data, broadcast, torch.Generator())
    changed = {k[len("model."):] for k, v in start.items() if not torch.equal(new[k], v)}
    # trained: the group's parameters and statistics, plus the counters BatchNorm keeps
    assert changed - set(g.names) <= {k for k in changed if k.endswith("num_batches_tracked")}
    assert set(g.parameters) <= changed


def statistics(values):
    """The BatchNorm running statistics among ``values`` (a state or a message's tensors)."""
    return {k: v for k, v in values.items() if k.endswith(("running_mean", "running_var"))}


def test_a_full_round_uploads_every_statistic_and_the_server_averages_them():
    strategy, clients, state = make()
    stats = statistics(state)
    assert len(stats) == 18  # 9 BatchNorm layers, running mean and variance each
    plan, new, ups = play(strategy, clients, state, 1)
    assert set(statistics(plan.broadcast.tensors)) == set(stats)
    for name, old in stats.items():
        sent = [u.tensors[name] for u in ups]
        assert all(not torch.equal(t, old) for t in sent), name  # trained on every client
        # FedAvg's weights n_c, 10 each: the float64 mean of the uploads, cast to float32
        torch.testing.assert_close(new[name], torch.stack([t.double() for t in sent]).mean(0)
                                   .float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("r", [2, 4])  # group 0 (body.pre_bn), group 2 (stage-1 bn2)
def test_a_partial_round_trains_uploads_and_averages_only_its_groups_statistics(r):
    # bn_stats="aggregate": the group's statistics are trained, uploaded and averaged; every
    # other statistic moves during local training too (its layer still normalises with
    # batch statistics) but is restored to the global value, and the server keeps it
    strategy, clients, state = make()
    for previous in range(1, r):
        _, state, _ = play(strategy, clients, state, previous)
    g = strategy.groups(BODY)[strategy.group_at(r)]
    assert len(g.buffers) == 2
    _, new, ups = play(strategy, clients, state, r)
    frozen = set(statistics(state)) - set(g.buffers)
    for c, up in zip(clients, ups, strict=True):
        assert set(statistics(up.tensors)) == set(g.buffers)
        for name in g.buffers:
            assert not torch.equal(up.tensors[name], state[name]), name
            assert torch.equal(c.state["model." + name], up.tensors[name]), name
        for name in frozen:
            assert torch.equal(c.state["model." + name], state[name]), name
    for name in g.buffers:
        torch.testing.assert_close(new[name], torch.stack([u.tensors[name].double()
                                                           for u in ups]).mean(0).float(),
                                   rtol=1e-6, atol=1e-7)
    assert all(torch.equal(new[name], state[name]) for name in frozen)


def test_norm_bound_clips_a_partial_rounds_parameter_updates_but_never_its_statistics():
    # norm_bound 1e-3: each upload's update of the group's parameters (its norm over them
    # alone) is scaled to 1e-3 before the mean; the statistics are averaged as sent
    strategy, clients, state = make(norm_bound=1e-3)
    _, state, _ = play(strategy, clients, state, 1)
    g = strategy.groups(BODY)[strategy.group_at(2)]
    _, new, ups = play(strategy, clients, state, 2)
    old = {n: state[n].double() for n in g.parameters}
    norms = [sum(float((u.tensors[n].double() - old[n]).square().sum()) for n in old) ** 0.5
             for u in ups]
    assert min(norms) > 1e-2  # every client's update is clipped
    for n in g.parameters:
        clipped = [old[n] + 1e-3 / norm * (u.tensors[n].double() - old[n])
                   for u, norm in zip(ups, norms, strict=True)]
        # float64 clipping and mean, cast to float32 (equal counts: equal weights)
        torch.testing.assert_close(new[n], torch.stack(clipped).mean(0).float(), rtol=1e-6,
                                   atol=1e-7)
    for n in g.buffers:
        torch.testing.assert_close(new[n], torch.stack([u.tensors[n].double() for u in ups])
                                   .mean(0).float(), rtol=1e-6, atol=1e-7)


def test_with_local_statistics_none_travels_and_each_client_evaluates_with_its_own():
    # bn_stats="local" (the FedPart paper's code, FedBN-like)
    strategy, clients, state = make(bn_stats="local")
    assert not statistics(state)
    plan, state, ups = play(strategy, clients, state, 1)
    assert not statistics(plan.broadcast.tensors)
    assert all(not statistics(u.tensors) for u in ups)
    evaluation = wire(strategy.configure_evaluation(state, 1))
    assert not statistics(evaluation.tensors)
    name = "model.body.pre_bn.running_mean"
    assert not torch.equal(clients[0].state[name], clients[1].state[name])
    x = clients[0].data.test_x
    for c in clients[:2]:
        model = strategy.global_model(c.config, c.state, evaluation).eval()
        with torch.no_grad():
            expected = torch.softmax(model(x).double(), dim=-1)
        # the same float32 network, vmapped or not: rounding only
        torch.testing.assert_close(strategy.predict(c.config, c.state, evaluation, x)
                                   ["predictive"], expected, rtol=1e-5, atol=1e-6)


def test_the_flat_schedule_options_shape_the_round_to_group_map():
    # W = 2 FULL rounds, then G = 10 groups deep to shallow, R = 3 rounds each (rounds
    # 3-32), then cycle 2: F = 1 FULL round (33) and the sweep again (34-63); 2 cycles
    strategy = make_strategy("fedpart", context(), warmup_rounds=2, full_rounds_per_cycle=1,
                             rounds_per_group=3, cycles=2, order="rev")
    assert [strategy.group_at(r) for r in range(1, 13)] == [FULL, FULL, 9, 9, 9, 8, 8, 8,
                                                            7, 7, 7, 6]
    assert [strategy.group_at(r) for r in (32, 33, 34, 63)] == [0, FULL, 9, 0]
    assert strategy.schedule().total_rounds == 63
    with pytest.raises(ConfigError, match="past the schedule"):
        strategy.group_at(64)


def test_group_prefixes_and_min_group_size_define_the_groups():
    manual = make_strategy("fedpart", context(), **OPTIONS,
                           group_prefixes=["body.pre_conv", "body.pre_bn", "body.layers",
                                           "head"])
    groups = manual.groups(BODY)
    assert [g.name for g in groups] == ["body.pre_conv", "body.pre_bn", "body.layers", "head"]
    assert groups[0].buffers == ()
    assert groups[1].buffers == ("body.pre_bn.running_mean", "body.pre_bn.running_var")
    assert manual.schedule().num_groups == 4 and manual.group_at(4) == 2
    merged = make_strategy("fedpart", context(), **OPTIONS, min_group_size=200)
    sizes = [g.numel for g in merged.groups(BODY)]
    # 204 | 152 + 152 | 152 + 152 | 24 + 304 | 592 | 48 + 27 merged into the one before
    assert sizes == [204, 304, 304, 328, 667]
    assert merged.schedule().num_groups == 5


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_backward_of_a_partial_round_touches_no_frozen_parameter():
    strategy, clients, _ = make()
    model = strategy.client_model(clients[0].config, clients[0].state)
    g = strategy.groups(BODY)[3]  # stage-2 conv1 + bn1
    fired = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d | nn.Linear | nn.BatchNorm2d):
            module.register_full_backward_hook(lambda m, gi, go, name=name: fired.append(name))
    data = clients[0].data
    train_plain(model, data.train_x, data.train_y, nn.functional.cross_entropy,
                LocalTraining(epochs=1, batch_size=10), generator=torch.Generator(),
                trainable=set(g.parameters).__contains__)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in g.parameters)
    assert all(p.grad is not None for n, p in model.named_parameters() if n in g.parameters)
    modules = set(fired)
    # nothing shallower than the group, nor the stage-2 shortcut (its input is stage 1's)
    shallow = {"body.pre_conv", "body.pre_bn", "body.layers.0.0.conv1", "body.layers.0.0.bn1",
               "body.layers.0.0.conv2", "body.layers.0.0.bn2",
               "body.layers.1.0.downsample.0", "body.layers.1.0.downsample.1"}
    assert not modules & shallow
    assert {"body.layers.1.0.conv1", "body.layers.1.0.conv2", "head"} <= modules


@pytest.mark.trained
def test_fedprox_part_trains_the_group_with_the_proximal_term():
    prox, clients, state = make("fedprox-part", mu=0.0)
    avg, twins, state2 = make("fedpart")
    for r in (1, 2):  # mu = 0 is FedAvg exactly
        _, state, _ = play(prox, clients, state, r)
        _, state2, _ = play(avg, twins, state2, r)
    assert all(torch.equal(state[k], state2[k]) for k in state)
    strong, clients, s = make("fedprox-part", mu=1e4)
    _, s, _ = play(strong, clients, s, 1)
    _, moved, _ = play(strong, clients, s, 2)
    _, free, _ = play(avg, twins, s, 2)
    names = strong.groups(BODY)[0].parameters

    def step(a):
        return sum((a[n] - s[n]).norm() for n in names)

    # a strong proximal term holds the group near w_t; Adam's steps are about lr whatever the
    # gradient, so the weights oscillate about w_t instead of staying on it: 3x, not 100x
    assert step(moved) < step(free) / 3
    anchor = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    w = {"a": torch.tensor([2.0, 0.0]), "b": torch.tensor([0.5]), "c": torch.tensor([9.0])}
    value = strong.penalty(anchor)(w)
    assert value.item() == pytest.approx(0.5 * 1e4 * (1.0 + 4.0))  # c has no anchor
    with pytest.raises(ConfigError, match="sets its own schedule"):
        make_strategy("fedpart", context(), schedule="fedpart")


def test_fedavg_takes_the_schedule_as_an_option():
    a = make_strategy("fedavg", context(), schedule={"kind": "fedpart", **OPTIONS})
    b = make_strategy("fedpart", context(), **OPTIONS)
    assert [a.group_at(r) for r in range(1, 13)] == [b.group_at(r) for r in range(1, 13)]
    with pytest.raises(ConfigError, match="unknown fedpart schedule option"):
        make_strategy("fedavg", context(), schedule={"kind": "fedpart", "R": 2})


RUN = dict(dataset="gaussian_mixture", clients=3, partition="iid", rounds=8, seed=4,
           body="resnet8:4-4-8", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2,
           progress=False, dataset_options={"num_classes": 3, "dim": 16, "n": 150},
           strategy_options={**OPTIONS, "order": "random-perm"})


def numbers(records):
    if isinstance(records, dict):
        return {k: numbers(v) for k, v in records.items() if not k.startswith("seconds")}
    if isinstance(records, list):
        return [numbers(r) for r in records]
    return records


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fedpart")
    return simulate("fedpart", out=out, **RUN), out


def test_bytes_of_a_round_are_the_groups_serialized_size(full_run):
    result, _ = full_run
    run_context = StrategyContext(3, 8, rounds=8, input_shape=(16,), bodies=(BODY,),
                                  clients=3, seed=4)
    strategy = make_strategy("fedpart", run_context, **RUN["strategy_options"])
    template = strategy.template(BODY)
    for record in result.metrics:
        r = record["round"]
        g = strategy.group_at(r)
        groups = layer_groups(template)
        names = [n for grp in groups for n in grp.names] if g == FULL else \
            list(strategy.groups(BODY)[g].names)
        values = template.state_dict()
        expected = []
        for cid in record["participants"]:
            tensors = {n: torch.zeros_like(values[n]) for n in names}
            tensors["num_samples"] = torch.tensor([1])
            expected.append(len(encode(strategy.up_message(r, cid, tensors))))
        assert record["bytes_up_per_client"] == expected, r
        assert record["flops_local"] > 0


def test_resume_mid_cycle_gives_identical_results(full_run, tmp_path):
    result, _ = full_run

    def stop(r, record):
        if r == 5:  # inside the first sweep (warm-up 1, full 1, R = 1, G = 10)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate("fedpart", out=tmp_path, round_callback=stop, **RUN)
    resumed = simulate("fedpart", out=tmp_path, resume=True, **RUN)
    assert numbers(resumed.metrics) == numbers(result.metrics)
    read = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert numbers(read) == numbers(result.metrics)
    for k, v in result.state.items():
        assert torch.equal(resumed.state[k], v), k


# ---- the FedPart strategies built directly (issue 27, mutation survivors) ----------------------
def test_built_directly_fedpart_runs_the_papers_schedule_defaults():
    # make_strategy passes every option; built directly, the signature's defaults are the
    # paper's: R = 2 rounds per group, F = 5 full rounds per cycle, W = 5 warm-up rounds
    from bayesfl.strategies.averaging.fedpart import FedPart

    context = StrategyContext(num_classes=3, feature_dim=4, input_shape=(6,))
    options = FedPart(context).schedule_options
    assert (options["rounds_per_group"], options["full_rounds_per_cycle"],
            options["warmup_rounds"]) == (2, 5, 5)


def test_fedpart_refuses_a_schedule_option_naming_its_own_options():
    context = StrategyContext(num_classes=3, feature_dim=4, input_shape=(6,))
    # (the list names every option FedPart takes flat, the schedule's and group_prefixes,
    # min_group_size and downlink)
    with pytest.raises(ConfigError, match=r"^fedpart sets its own schedule; give its options "
                       r"\(rounds_per_group, full_rounds_per_cycle, warmup_rounds, cycles, "
                       r"order, group_prefixes, min_group_size, downlink\) directly$"):
        make_strategy("fedpart", context, schedule="fedpart")


@pytest.mark.parametrize("name", ["fedpart", "fedprox-part"])
def test_the_own_schedule_refusal_lists_every_declared_fedpart_option(name):
    import inspect

    from bayesfl.strategies.averaging.fedpart import _PartMixin

    declared = [p.name for p in inspect.signature(_PartMixin.__init__).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(declared) == 8  # R, F, warm-up, cycles, order, groups, min size, downlink
    with pytest.raises(ConfigError) as info:
        make_strategy(name, context(), schedule="fedpart")
    listed = str(info.value).split("(")[1].split(")")[0].split(", ")
    assert listed == declared, str(info.value)
