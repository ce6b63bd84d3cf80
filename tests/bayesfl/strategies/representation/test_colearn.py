"""CoLearn: the relay sees only feature-space tensors, the contrastive term is the paper's,
absent classes are handled, uploads cost (1 + M_up) C d' floats, and it runs in simulate."""

import itertools
import math

import pytest
import torch
from strategy_helpers import FEATURE_DIM, NUM_CLASSES, make_clients, run_round, wire
from strategy_helpers import context as strategy_context

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message, encode
from bayesfl.simulate import simulate
from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.networks import batched_apply
from bayesfl.strategies.representation.colearn import (
    KEPT,
    KEPT_AVAILABLE,
    contrastive_terms,
    observation_sets,
    peer_prototypes,
    select_observations,
    upload_floats,
)
from bayesfl.strategies.representation.personal import class_means, loss_log
from bayesfl.training import LocalTraining


def test_relay_input_and_output_hold_only_feature_space_tensors_of_declared_shapes(build):
    strategy, clients, state = build("colearn", relay="pool")
    C, d = NUM_CLASSES, FEATURE_DIM
    plan = strategy.configure(state, 1)
    assert {k: tuple(v.shape) for k, v in plan.upload_schema.items()} == {
        "prototypes": (C, d), "observations": (1, C, d), "counts": (C,)}
    state, uploads = run_round(strategy, clients, state, 1)
    for u in uploads:
        assert {k: tuple(v.shape) for k, v in u.tensors.items()} == {
            "prototypes": (C, d), "observations": (1, C, d), "counts": (C,)}
    down = strategy.configure(state, 2).broadcast.tensors
    # float tensors: C x d' prototypes and S x C x d' observation sets; the rest are masks/ids
    assert tuple(down["prototypes"].shape) == (C, d)
    assert tuple(down["observations"].shape) == (len(clients), C, d)
    assert tuple(down["present"].shape) == (C,)
    assert tuple(down["observations_present"].shape) == (len(clients), C)
    assert down["observation_sources"].tolist() != [] and \
        sorted(down["observation_sources"].tolist()) == [c.config.client_id for c in clients]
    param_names = {n for c in clients for n in c.state if n.startswith("model.")}
    assert not param_names & set(down) and not param_names & set(uploads[0].tensors)
    assert strategy.configure_evaluation(state, 2).tensors == {}


def test_parameter_tensors_are_rejected(build):
    strategy, clients, state = build("colearn")
    plan = strategy.configure(state, 1)
    _, uploads = run_round(strategy, clients, state, 1)
    up, params = uploads[0], clients[0].state
    head_w = params["model.head.weight"]  # (C, d'): the prototypes' shape, not their sign
    assert tuple(head_w.shape) == (NUM_CLASSES, FEATURE_DIM) and (head_w < 0).any()
    smuggled = {
        "extra parameter": {**up.tensors, "model.head.weight": head_w},
        "head weight as prototypes": {**up.tensors, "prototypes": head_w.clone()},
        "body weight as observations": {**up.tensors,
                                        "observations": params["model.body.1.weight"]},
    }
    reasons = {"extra parameter": "unexpected", "head weight as prototypes": "negative",
               "body weight as observations": "shape"}
    for case, tensors in smuggled.items():
        with pytest.raises(MessageRejected, match=reasons[case]):
            strategy.validate_upload(plan, wire(Message(up.header, tensors)), 0)


def test_poisoned_uploads_are_rejected_with_a_reason(build):
    strategy, clients, state = build("colearn")
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    t = ups[0].tensors
    counts = t["counts"].clone()
    counts[0] = 10**6
    cases = {
        "huge norm": ({**t, "prototypes": t["prototypes"] * 1e6}, "max_norm"),
        "inflated count": ({**t, "counts": counts}, "median"),
        "negative count": ({**t, "counts": -t["counts"]}, "negative class counts"),
        "NaN": ({**t, "observations": t["observations"] * float("nan")}, "non-finite"),
    }
    for name, (tensors, reason) in cases.items():
        batch = [wire(Message(ups[0].header, tensors)), *map(wire, ups[1:])]
        verdicts = strategy.validate_uploads(plan, batch, [0, 1, 2])
        assert verdicts[0] is not None and reason in verdicts[0], (name, verdicts)
        assert verdicts[1:] == [None, None], name


def test_contrastive_term_equals_a_hand_computation():
    # C = 3, one sample of class 1; its observation set holds all three classes
    z = [0.5, -1.0, 2.0]
    zt = [[1.0, 0.0, 0.0], [0.0, 3.0, -1.0], [-2.0, 0.5, 0.5]]

    def softmax(v):
        e = [math.exp(a) for a in v]
        return [a / sum(e) for a in e]

    p = softmax(z)
    h = [sum(a * b for a, b in zip(p, softmax(row), strict=True)) for row in zt]
    expected = -math.log(h[1]) - math.log(1 - h[0]) - math.log(1 - h[2])
    got = contrastive_terms(torch.tensor([z], dtype=torch.float64),
                            torch.tensor([zt], dtype=torch.float64), torch.tensor([1]),
                            torch.ones(1, 3, dtype=torch.bool))
    # float64 softmaxes and logs of O(1) numbers: agreement to rounding (1e-12)
    assert abs(float(got) - expected) < 1e-12
    # mean over the two negatives, and a missing negative (class 2) dropped
    mean = contrastive_terms(torch.tensor([z], dtype=torch.float64),
                             torch.tensor([zt], dtype=torch.float64), torch.tensor([1]),
                             torch.ones(1, 3, dtype=torch.bool), neg_reduction="mean")
    assert abs(float(mean) - (-math.log(h[1]) - (math.log(1 - h[0]) + math.log(1 - h[2])) / 2)) \
        < 1e-12
    missing = contrastive_terms(torch.tensor([z], dtype=torch.float64),
                                torch.tensor([zt], dtype=torch.float64), torch.tensor([1]),
                                torch.tensor([[True, True, False]]))
    assert abs(float(missing) - (-math.log(h[1]) - math.log(1 - h[0]))) < 1e-12


def test_observation_sets_average_n_avg_samples_of_one_class():
    g = torch.Generator().manual_seed(0)
    features = torch.rand(9, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2])
    obs, sizes = observation_sets(features, labels, 4, 2, 3, g)
    assert sizes.tolist() == [3, 2, 2, 0]  # min(n_avg, n_c); class 3 absent
    assert torch.equal(obs[:, 3], torch.zeros(2, 4))
    torch.testing.assert_close(obs[0, 1], features[5:7].mean(0), rtol=0, atol=1e-15)
    # class 0: the mean of some 3 of its 5 rows (checked against all 10 subsets)
    subsets = [features[list(s)].mean(0) for s in itertools.combinations(range(5), 3)]
    for m in range(2):
        assert min(float((obs[m, 0] - s).abs().max()) for s in subsets) < 1e-15


def test_absent_classes_give_no_nan_and_nothing_uploaded(build):
    strategy, clients, state = build("colearn")
    # client 0 holds no class-2 sample; no client holds class 2 in round 1
    for c in clients:
        keep = c.data.train_y != 2
        c.data.train_x, c.data.train_y = c.data.train_x[keep], c.data.train_y[keep]
    state1, ups = run_round(strategy, clients, state, 1)
    for u in ups:
        assert u.tensors["counts"][2] == 0
        assert torch.equal(u.tensors["prototypes"][2], torch.zeros(FEATURE_DIM))
        assert torch.equal(u.tensors["observations"][:, 2], torch.zeros(1, FEATURE_DIM))
    assert state1["counts"][2] == 0 and torch.isfinite(state1["prototypes"]).all()
    assert strategy.configure(state1, 2).broadcast.tensors["present"].tolist() == [1, 1, 0]
    state2, _ = run_round(strategy, clients, state1, 2)
    for c in clients:
        assert all(math.isfinite(v) for v in loss_log(c.state).values())
        assert all(torch.isfinite(v).all() for v in c.state.values())
    # a class nobody uploads keeps its previous prototype
    previous = dict(state2, counts=state2["counts"].clone())
    previous["counts"][2], previous["prototypes"][2] = 5.0, 0.5
    state3, _ = run_round(strategy, clients, previous, 3)
    assert state3["counts"][2] == 5.0 and torch.equal(state3["prototypes"][2],
                                                      torch.full((FEATURE_DIM,), 0.5))


def test_prototypes_are_count_weighted_means_of_the_uploads(build):
    strategy, clients, state = build("colearn")
    new, ups = run_round(strategy, clients, state, 1)
    counts = torch.stack([u.tensors["counts"] for u in ups]).double()
    protos = torch.stack([u.tensors["prototypes"] for u in ups]).double()
    for c in range(NUM_CLASSES):
        expected = sum(counts[k, c] * protos[k, c] for k in range(len(ups))) / counts[:, c].sum()
        torch.testing.assert_close(new["prototypes"][c].double(), expected, atol=1e-6, rtol=1e-6)


def test_observations_are_drawn_from_peers_only():
    pool = torch.arange(3 * 2 * 1, dtype=torch.float32).reshape(3, 2, 1)
    present = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    sources = torch.tensor([0, 1, 2])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        obs, ok = select_observations(pool, present, sources, 2, 1, g)
        assert ok.all()  # client 1's set lacks class 1: filled from client 0's
        assert float(obs[0, 0, 0]) in (0.0, 2.0) and float(obs[0, 1, 0]) == 1.0
    alone, ok = select_observations(pool[:1], present[:1], sources[:1], 0, 2, g)
    assert not ok.any() and torch.equal(alone, torch.zeros(2, 2, 1))


def test_upload_bytes_are_the_feature_floats_plus_a_constant_header():
    sizes = {}
    for d in (16, 84):
        context = StrategyContext(num_classes=10, feature_dim=d, input_shape=(64,), clients=1)
        strategy = make_strategy("colearn", context, m_up=2)
        tensors = {"prototypes": torch.rand(10, d), "observations": torch.rand(2, 10, d),
                   "counts": torch.full((10,), 3, dtype=torch.int64)}
        message = strategy.up_message(1, 0, tensors)
        assert message.num_elements == upload_floats(10, d, 2) + 10
        sizes[d] = len(encode(message))
    floats = {d: 4 * upload_floats(10, d, 2) for d in sizes}
    # the encoded size grows by exactly 4 bytes per feature float ...
    assert sizes[84] - sizes[16] == floats[84] - floats[16]
    # ... on top of a d'-independent header: C int64 counts plus the safetensors JSON
    header = sizes[84] - floats[84]
    assert header == sizes[16] - floats[16] and 80 <= header < 1024


def test_options_are_validated():
    context = StrategyContext(num_classes=3, feature_dim=4, input_shape=(6,))
    for bad in (dict(lam_kd=-1.0), dict(n_avg=0), dict(bootstrap="never"),
                dict(synchronous=False), dict(relay="pool", relay_pool=1), dict(eps=0.7),
                dict(relay_pool=3), dict(relay="all"), dict(share_counts="no"),
                dict(neg_reduction="max"), dict(keep_optimizer="yes")):
        with pytest.raises(ConfigError):
            make_strategy("colearn", context, **bad)


@pytest.mark.trained
def test_colearn_runs_three_rounds_on_digits_with_two_architectures():
    result = simulate("colearn", "digits", clients=5, partition="iid", rounds=3, seed=0,
                      progress=False, body="mlp:64,cnn:8", feature_dim=32, local_epochs=1,
                      batch_size=16, threads=1)
    assert [c.config.body for c in result.clients] == ["mlp:64", "cnn:8"] * 2 + ["mlp:64"]
    rounds = [m["round"] for m in result.metrics]
    assert rounds == [0, 1, 2, 3]  # round 0: the bootstrap upload
    floats = upload_floats(10, 32)
    for m in result.metrics:
        assert m["rejections"] == [] and m["accepted"] == 5
        assert m["floats_up"] == 5 * (floats + 10)  # features plus the C counts
        assert all(b > 4 * floats for b in m["bytes_up_per_client"])
    assert torch.isfinite(result.state["prototypes"]).all()
    # learning, not noise, on any CPU: chance is 0.1 and its standard error on the 450 test
    # digits is 0.014, so 0.15 is 3.5 of them above; over seeds 0-4 the run ended at 0.24-0.39
    # (sd 0.06; the cnn:8 clients learn slowly), so 0.15 is 3 sd below their mean
    assert result.summary["accuracy"] > 0.15


@pytest.mark.parametrize("options", [
    dict(bootstrap="skip", statistics="running"),
    dict(bootstrap="random", peer="mix", kd_target="peers"),
    dict(weighting="uniform", kd_reduction="sum", neg_reduction="mean", m_up=2, m_down=2,
         keep_optimizer=False, independent_init=False, relay="pool", relay_pool=3),
    dict(relay="sets", m_down=2, peer="mix", kd_target="peers", share_counts=False)])
def test_every_option_trains_without_nan(build, options):
    strategy, clients, state = build("colearn", **options)
    assert strategy.init_round is (options.get("bootstrap", "upload") == "upload")
    for r in ((0, 1, 2) if strategy.init_round else (1, 2)):
        state, _ = run_round(strategy, clients, state, r)
    assert all(torch.isfinite(v).all() for v in state.values())
    if "relay_pool" in options:
        assert state["pool"].shape[0] == 3
    for c in clients:
        assert all(math.isfinite(v) for v in loss_log(c.state).values())


def test_adam_state_is_kept_across_rounds(build):
    strategy, clients, state = build("colearn", bootstrap="skip")
    state, _ = run_round(strategy, clients, state, 1)
    steps = [float(c.state["optim.step"]) for c in clients]
    # 2 local epochs of 5-sample batches: ceil(n / 5) steps each
    assert steps == [2 * math.ceil(len(c.data.train_y) / 5) for c in clients]
    run_round(strategy, clients, state, 2)
    assert [float(c.state["optim.step"]) for c in clients] == [2 * s for s in steps]
    assert all(c.state["optim.exp_avg_sq.head.weight"].abs().sum() > 0 for c in clients)


def test_peer_prototypes_average_the_other_clients_sets():
    pool = torch.tensor([[[1.0], [2.0]], [[3.0], [0.0]], [[5.0], [6.0]]])
    present = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    protos, held = peer_prototypes(pool, present, torch.tensor([0, 1, 2]), 2)
    assert protos.flatten().tolist() == [2.0, 2.0] and held.tolist() == [1.0, 1.0]
    protos, held = peer_prototypes(pool[:1], present[:1], torch.tensor([0]), 0)
    assert held.tolist() == [0.0, 0.0] and protos.abs().sum() == 0


def test_server_reports_prototype_drift_and_spread(build):
    strategy, clients, state = build("colearn", bootstrap="skip")
    new, _ = run_round(strategy, clients, state, 1)
    metrics = strategy.server_metrics(new)
    p = new["prototypes"].double()
    pairs = [(p[i] - p[j]).norm() for i in range(3) for j in range(i + 1, 3)]
    assert abs(metrics["prototype_spread"] - float(sum(pairs) / 3)) < 1e-9
    # from the empty state every class moved by its prototype's norm
    assert abs(metrics["prototype_drift"] - float(p.norm(dim=1).mean())) < 1e-9


# ---- the loss terms by hand, and every documented option --------------------------------------
class GivenFeatures(torch.nn.Module):
    """A stand-in client network: input rows are indices into fixed ``features`` (B, d), the
    head a fixed linear map (no bias)."""

    def __init__(self, features, weight):
        super().__init__()
        self.features = features
        self.head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(weight)

    def forward(self, x):
        f = self.features[x.long().flatten()]
        return self.head(f), f


FEATURES = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 1.0]])
LABELS = torch.tensor([0, 1, 2])
HEAD = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
TARGETS = {
    "prototypes": torch.tensor([[1.0, 0.0], [5.0, 5.0], [1.0, 1.0]]),
    "present": torch.tensor([1.0, 0.0, 1.0]),  # class 1 has no global prototype
    "observations": torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]),  # one set (m_down 1)
    "available": torch.tensor([[True, True, False]]),  # the set lacks class 2
}


def terms_of(**options):
    context = StrategyContext(num_classes=3, feature_dim=2, input_shape=(1,), clients=3)
    strategy = make_strategy("colearn", context, **options)
    model = GivenFeatures(FEATURES, HEAD)
    parts, features = strategy._terms(TARGETS, model, torch.arange(3.0)[:, None], LABELS,
                                      torch.Generator())
    assert torch.equal(features, FEATURES)
    return {k: v.detach() for k, v in parts.items()}


@pytest.mark.parametrize("kd_reduction, kd", [("mean", [2.0, 0.0, 2.0]),
                                              ("sum", [4.0, 0.0, 4.0])])
def test_kd_term_is_the_distance_to_the_global_prototype_and_zero_for_an_absent_class(
        kd_reduction, kd):
    # sample 0: |(1, 2) - (1, 0)|^2 = 4 -> 4 / d' = 2; sample 2: |(3, 1) - (1, 1)|^2 = 4;
    # sample 1's class has no global prototype: no term (its stale row (5, 5) would give 50)
    parts = terms_of(kd_reduction=kd_reduction)
    assert parts["kd"].tolist() == kd
    logits = FEATURES @ HEAD.T
    torch.testing.assert_close(parts["ce"], torch.nn.functional.cross_entropy(
        logits, LABELS, reduction="none"), rtol=0, atol=0)


@pytest.mark.parametrize("option", [{"tau_disc": 2.0}, {"eps": 0.45},
                                    {"neg_reduction": "mean"}])
def test_the_disc_term_takes_the_temperature_clamp_and_negative_reduction_options(option):
    # the disc term is contrastive_terms (checked by hand above) of the client's logits and
    # its head's logits of the drawn set, with the options; each option changes it here
    parts, default = terms_of(**option), terms_of()
    logits, observed = FEATURES @ HEAD.T, TARGETS["observations"] @ HEAD.T
    settings = {"tau": option.get("tau_disc", 1.0), "eps": option.get("eps", 1e-7),
                "neg_reduction": option.get("neg_reduction", "sum")}
    expected = contrastive_terms(logits, observed[[0, 0, 0]], LABELS,
                                 TARGETS["available"][[0, 0, 0]], **settings)
    torch.testing.assert_close(parts["disc"], expected, rtol=1e-6, atol=1e-7)
    assert (parts["disc"] - default["disc"]).abs().max() > 1e-3


def full_batch(**options):
    """CoLearn on one full batch per round (one Adam step), after the bootstrap round 0."""
    training = LocalTraining(epochs=1, lr=1e-2, batch_size=64)
    strategy = make_strategy("colearn", strategy_context(training=training), **options)
    clients = make_clients(strategy)
    state = strategy.init()
    if strategy.init_round:
        state, _ = run_round(strategy, clients, state, 0)
    return strategy, clients, state


def test_the_local_loss_is_ce_plus_lam_kd_kd_plus_lam_disc_disc():
    # Adam's first moment after one step is 0.1 * the gradient (beta1 0.9): the gradient of
    # the batch mean of ce + 2.5 kd + 0.5 disc, the terms computed here from the same targets
    strategy, clients, state = full_batch(lam_kd=2.5, lam_disc=0.5, relay="pool")
    c = clients[1]
    down = wire(strategy.configure(state, 1).broadcast)
    model = strategy.client_model(c.config, c.state)
    targets = strategy._targets(c.config, down, torch.Generator().manual_seed(7))
    assert targets["present"].sum() == 3 and targets["available"].all()
    parts, _ = strategy._terms(targets, model, c.data.train_x, c.data.train_y,
                               torch.Generator())
    loss = (parts["ce"] + 2.5 * parts["kd"] + 0.5 * parts["disc"]).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    new_state, _ = strategy.fit(c.config, c.state, c.data, down,
                                torch.Generator().manual_seed(7))
    for (name, _), grad in zip(model.named_parameters(), grads, strict=True):
        # float32 gradients of the same batch in another order: rounding only
        torch.testing.assert_close(new_state[f"optim.exp_avg.{name}"], 0.1 * grad, rtol=1e-4,
                                   atol=1e-8)
    # the logged terms are their unweighted means over the (one) batch
    for term in ("ce", "kd", "disc"):
        assert loss_log(new_state)[term] == pytest.approx(float(parts[term].detach().mean()),
                                                         rel=1e-5)


def test_running_statistics_are_the_features_of_the_last_epoch_as_trained_on():
    # one full-batch epoch: "running" uploads the features computed before the only step
    # (the initial network's), "final" those of an extra pass after it
    for statistics in ("running", "final"):
        strategy, clients, state = full_batch(statistics=statistics, bootstrap="skip")
        c = clients[1]
        before = batched_apply(strategy.client_model(c.config, c.state), c.data.train_x)[1]
        new_state, up = strategy.fit(c.config, c.state, c.data,
                                     wire(strategy.configure(state, 1).broadcast),
                                     torch.Generator())
        after = batched_apply(strategy.client_model(c.config, new_state), c.data.train_x)[1]
        features = before if statistics == "running" else after
        protos, counts = class_means(features, c.data.train_y, NUM_CLASSES)
        assert torch.equal(up.tensors["counts"], counts)
        # the same rows through the same network, in another batch order: float32 rounding
        torch.testing.assert_close(up.tensors["prototypes"], protos.float(), rtol=1e-5,
                                   atol=1e-6)
        assert (before - after).abs().max() > 1e-4  # the step did change the features


def test_n_avg_sets_how_many_samples_an_observation_averages(build):
    # round 0 uploads statistics of the initial network: with n_avg = 1 each observation is
    # one class-c feature row exactly; with the default 10, a mean of several rows
    for n_avg, single in ((1, True), (10, False)):
        strategy, clients, state = build("colearn", n_avg=n_avg)
        c = clients[1]  # 20 samples: at least 2 of each class
        features = batched_apply(strategy.client_model(c.config, c.state), c.data.train_x)[1]
        _, up = strategy.fit(c.config, c.state, c.data,
                             wire(strategy.configure(state, 0).broadcast), torch.Generator())
        for k in range(NUM_CLASSES):
            rows = features[c.data.train_y == k]
            assert len(rows) >= 2
            is_row = any(torch.equal(up.tensors["observations"][0, k], r) for r in rows)
            assert is_row is single, (n_avg, k)


def test_m_up_and_m_down_set_the_observation_sets_sent_and_drawn(build):
    strategy, clients, state = build("colearn", m_up=2, m_down=3, relay="pool")
    state, ups = run_round(strategy, clients, state, 0)
    assert all(u.tensors["observations"].shape == (2, NUM_CLASSES, FEATURE_DIM) for u in ups)
    assert state["pool"].shape[0] == 2 * len(clients)
    down = wire(strategy.configure(state, 1).broadcast)
    targets = strategy._targets(clients[0].config, down, torch.Generator())
    assert targets["observations"].shape == (3, NUM_CLASSES, FEATURE_DIM)


def relay_broadcast(strategy):
    """A round-1 broadcast by hand: global prototypes all 7; four relayed sets, set j (from
    client j) holding the value j + 1 for every class."""
    C, d = NUM_CLASSES, FEATURE_DIM
    return wire(strategy.down_message(1, {
        "prototypes": torch.full((C, d), 7.0), "present": torch.ones(C),
        "observations": torch.arange(1.0, 5.0)[:, None, None].expand(4, C, d).clone(),
        "observations_present": torch.ones(4, C),
        "observation_sources": torch.arange(4)}))


@pytest.mark.parametrize("peer", ["one", "mix"])
def test_peer_one_draws_a_set_from_one_peer_and_mix_each_class_from_its_own(build, peer):
    strategy, clients, _ = build("colearn", m_down=20, peer=peer, relay="pool")
    targets = strategy._targets(clients[0].config, relay_broadcast(strategy),
                                torch.Generator().manual_seed(0))
    draws = targets["observations"][:, :, 0]  # (20, C): the sender of each class's row, + 1
    assert set(draws.flatten().tolist()) <= {2.0, 3.0, 4.0}  # never client 0's own set
    one_sender = [len(set(row.tolist())) == 1 for row in draws]
    assert all(one_sender) if peer == "one" else not all(one_sender)


@pytest.mark.parametrize("kd_target, value", [("server", 7.0), ("peers", 3.0)])
def test_kd_target_is_the_servers_prototype_or_the_mean_of_the_peers_sets(build, kd_target,
                                                                         value):
    # client 0's peers relay sets of value 2, 3 and 4: their mean is 3
    strategy, clients, _ = build("colearn", kd_target=kd_target, relay="pool")
    targets = strategy._targets(clients[0].config, relay_broadcast(strategy),
                                torch.Generator())
    assert torch.equal(targets["prototypes"], torch.full((NUM_CLASSES, FEATURE_DIM), value))
    assert targets["present"].tolist() == [1.0] * NUM_CLASSES


def hand_upload(strategy, client_id, counts, value):
    """An honest-looking upload: every present class's prototype and observation ``value``."""
    counts = torch.tensor(counts)
    rows = (counts > 0).float()[:, None].expand(NUM_CLASSES, FEATURE_DIM) * value
    return wire(strategy.up_message(1, client_id, {"prototypes": rows.clone(),
                                                   "observations": rows[None].clone(),
                                                   "counts": counts}))


@pytest.mark.parametrize("weighting, class0", [("count", 4.0), ("uniform", 3.0)])
def test_weighting_of_the_global_prototypes(build, weighting, class0):
    # class 0: client 0 (count 1, value 1) and client 1 (count 3, value 5): count-weighted
    # (1 + 15) / 4 = 4, uniform (1 + 5) / 2 = 3; classes 1 and 2 have one holder each
    strategy, _, state = build("colearn", weighting=weighting)
    ups = [hand_upload(strategy, 0, [1, 0, 2], 1.0), hand_upload(strategy, 1, [3, 2, 0], 5.0)]
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    assert new["prototypes"][:, 0].tolist() == [class0, 5.0, 1.0]
    assert new["counts"].tolist() == [4.0, 2.0, 2.0]


@pytest.mark.parametrize("options, rejected", [({}, []), ({"max_norm": 9.0}, [1])])
def test_max_norm_bounds_every_feature_rows_norm(build, options, rejected):
    # value 5 in each of the d' = 4 entries: a row of norm 10 (the other client's: 2)
    strategy, _, state = build("colearn", **options)
    plan = strategy.configure(state, 1)
    ups = [hand_upload(strategy, 0, [2, 2, 1], 1.0), hand_upload(strategy, 1, [2, 2, 1], 5.0)]
    verdicts = strategy.validate_uploads(plan, ups, [0, 1])
    assert [k for k, v in enumerate(verdicts) if v is not None] == rejected
    if rejected:
        assert "max_norm" in verdicts[1]


@pytest.mark.parametrize("ratio, rejected", [(None, []), (2.0, [2]), (10.0, [])])
def test_screening_ratio_bounds_a_clients_total_count_against_the_rounds_median(build, ratio,
                                                                               rejected):
    # total counts 5, 5 and 20: 20 is more than 2x the median 5 and less than 10x
    strategy, _, state = build("colearn", screening_ratio=ratio)
    plan = strategy.configure(state, 1)
    ups = [hand_upload(strategy, k, counts, 1.0)
           for k, counts in enumerate(([2, 2, 1], [1, 2, 2], [10, 5, 5]))]
    verdicts = strategy.validate_uploads(plan, ups, [0, 1, 2])
    assert [k for k, v in enumerate(verdicts) if v is not None] == rejected


def test_bootstrap_random_starts_from_random_prototypes_and_a_pool_of_unknown_senders(build):
    strategy, clients, state = build("colearn", bootstrap="random", m_up=2, relay="pool")
    assert strategy.init_round is False
    C, d = NUM_CLASSES, FEATURE_DIM
    protos = state["prototypes"]
    assert protos.shape == (C, d) and bool((protos > 0).all() and (protos < 1).all())
    assert state["counts"].tolist() == [1.0] * C
    assert state["pool"].shape == (2 * len(clients), C, d)  # clients x m_up sets
    assert state["pool_sources"].tolist() == [-1] * 2 * len(clients)
    skip = build("colearn", bootstrap="skip")[2]
    assert skip["pool"].shape[0] == 0 and skip["counts"].sum() == 0


@pytest.mark.parametrize("independent", [True, False])
def test_independent_init_draws_each_clients_network_from_its_own_seed(build, independent):
    _, clients, _ = build("colearn", independent_init=independent)
    a, b = (c.state["model.head.weight"] for c in clients[:2])  # same body spec
    assert torch.equal(a, b) is not independent


def test_without_keep_optimizer_no_adam_state_is_kept(build):
    strategy, clients, state = build("colearn", keep_optimizer=False, bootstrap="skip")
    assert not any(k.startswith("optim.") for k in clients[0].state)
    run_round(strategy, clients, state, 1)
    assert not any(k.startswith("optim.") for c in clients for k in c.state)


# ---- behaviour the mutation sample found untested (issue 27) ----------------------------------
def test_mean_negative_reduction_divides_each_sample_by_its_own_negatives():
    # uniform logits give h = <(1/3, 1/3, 1/3), p_t> = 1/3 for every observation: a positive
    # costs -log(1/3) = log 3, a negative -log(2/3) = log 1.5. Sample 0 has both negatives,
    # sample 1 one: each mean is over that sample's own negatives, log 1.5 for both
    available = torch.tensor([[True, True, True], [True, True, False]])
    got = contrastive_terms(torch.zeros(2, 3, dtype=torch.float64),
                            torch.rand(2, 3, 3, dtype=torch.float64), torch.tensor([0, 1]),
                            available, neg_reduction="mean")
    expected = math.log(3) + math.log(1.5)
    torch.testing.assert_close(got, torch.tensor([expected, expected], dtype=torch.float64),
                               rtol=1e-12, atol=0)


def test_observation_sets_draw_from_the_given_generator_only():
    # the same generator seed gives the same sets whatever the global random state (rows
    # 2^i: every pair of rows has its own mean)
    features = (2.0 ** torch.arange(10, dtype=torch.float64))[:, None].expand(10, 4)
    labels = torch.zeros(10, dtype=torch.int64)
    sets = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(7)
        sets.append(observation_sets(features, labels, 1, 3, 2, generator)[0])
    assert torch.equal(sets[0], sets[1])


def test_drawn_observations_are_the_pools_values_in_its_dtype():
    # a float64 pool of values float32 cannot hold: the drawn set is the peer's set exactly
    pool = torch.full((2, 3, 2), 0.1, dtype=torch.float64)
    obs, available = select_observations(pool, torch.ones(2, 3), torch.tensor([0, 1]), 0, 1,
                                         torch.Generator().manual_seed(0))
    assert obs.dtype == torch.float64 and torch.equal(obs[0], pool[1])
    assert available.all()


@pytest.mark.parametrize("option, value, message", [
    ("m_up", 0, "colearn m_up must be an integer >= 1, got 0"),
    ("tau_disc", 0.0, "colearn tau_disc must be a finite number >= 1e-06, got 0.0"),
    ("eps", 0.5, "colearn eps must lie in (0, 0.5), got 0.5"),
    ("neg_reduction", "max", "colearn neg_reduction must be one of sum, mean; got 'max'"),
    ("kd_target", "clients", "colearn kd_target must be one of server, peers; got 'clients'"),
])
def test_a_refused_option_is_named_with_what_it_must_be(option, value, message):
    import re

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make_strategy("colearn", strategy_context(), **{option: value})


@pytest.mark.parametrize("bootstrap", ["skip", "random"])
def test_the_server_state_keeps_its_entries_dtypes_and_shapes_across_a_round(build, bootstrap):
    # what a checkpoint is checked against on resume: the state of a fresh run. Only the
    # relay pool's length (the round's observation sets) may change
    strategy, _, state = build("colearn", bootstrap=bootstrap)
    assert strategy.server_metrics(state)["prototype_drift"] == 0.0
    ups = [hand_upload(strategy, 0, [1, 0, 2], 1.0), hand_upload(strategy, 1, [3, 2, 0], 5.0)]
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    assert new.keys() == state.keys()
    for key, tensor in state.items():
        assert new[key].dtype == tensor.dtype, key
        assert new[key].shape[1:] == tensor.shape[1:], key
        if not key.startswith("pool"):
            assert new[key].shape == tensor.shape, key


# ---- behaviour the second mutation sample found untested --------------------------------------
def test_a_relayed_row_of_the_clients_own_is_replaced_by_the_row_it_used_last_round(build):
    # the relayed set's class-0 row is client 0's own: client 0 contrasts with (and keeps for
    # next round) that row of the set it kept, and with the peer's rows of the other classes
    strategy, clients, _ = build("colearn")
    C, d = NUM_CLASSES, FEATURE_DIM
    c = clients[0]
    kept = torch.arange(C * d, dtype=torch.float32).reshape(1, C, d) + 100.0
    state = {**c.state, KEPT: kept, KEPT_AVAILABLE: torch.ones(1, C)}
    relayed = torch.arange(C * d, dtype=torch.float32).reshape(1, C, d) + 1.0
    down = wire(strategy.down_message(1, {
        "prototypes": torch.rand(C, d), "present": torch.ones(C), "observations": relayed,
        "observations_present": torch.ones(1, C),
        "observation_sources": torch.tensor([[0] + [1] * (C - 1)])}))
    new_state, _ = strategy.fit(c.config, state, c.data, down, torch.Generator())
    assert torch.equal(new_state[KEPT][0, 0], kept[0, 0])
    assert torch.equal(new_state[KEPT][0, 1:], relayed[0, 1:])
    assert new_state[KEPT_AVAILABLE].tolist() == [[1.0] * C]


def test_bootstrap_random_draws_its_prototypes_and_pool_from_the_run_seed():
    # the same run seed gives the same random start whatever the global random state; another
    # seed gives another
    import dataclasses

    starts = {}
    for seed, global_seed in ((0, 1), (0, 2), (1, 1)):
        torch.manual_seed(global_seed)
        ctx = dataclasses.replace(strategy_context(), seed=seed)
        starts[seed, global_seed] = make_strategy("colearn", ctx, bootstrap="random").init()
    same, other = starts[0, 1], starts[1, 1]
    for key in ("prototypes", "pool"):
        assert torch.equal(starts[0, 2][key], same[key]), key
        assert not torch.equal(other[key], same[key]), key


@pytest.mark.parametrize("relay", ["sets", "pool"])
def test_a_float64_relay_is_taken_in_the_networks_float32(build, relay):
    # another server may relay float32 values held in float64: the client trains exactly as on
    # the float32 broadcast (it used to stop at its first matrix product with a dtype error)
    strategy, clients, state = build("colearn", relay=relay)
    state, _ = run_round(strategy, clients, state, 1)
    down = wire(strategy.configure(state, 2).broadcast)
    down64 = wire(strategy.down_message(2, {k: v.double() if v.is_floating_point() else v
                                            for k, v in down.tensors.items()}))
    c = clients[1]
    runs = [strategy.fit(c.config, c.state, c.data, d, torch.Generator().manual_seed(4))
            for d in (down, down64)]
    (state_32, up_32), (state_64, up_64) = runs
    assert any(v.dtype == torch.float64 for v in down64.tensors.values())
    for key, tensor in up_32.tensors.items():
        assert up_64.tensors[key].dtype == tensor.dtype, key
        assert torch.equal(up_64.tensors[key], tensor), key
    assert [k for k in state_32 if not torch.equal(state_64[k], state_32[k])] == []
