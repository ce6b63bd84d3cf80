"""FedLog: sufficiency of the server step, upload invariants, variants."""

import copy
import math

import pytest
import torch
from scipy.optimize import minimize
from strategy_helpers import NUM_CLASSES, run_round, wire

from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message
from bayesfl.strategies.fedlog import head_logits
from bayesfl.strategies.networks import batched_apply


def pooled_table(clients):
    """Independent reference: one-hot matmul of the pooled augmented features (float64)."""
    feats = torch.cat([batched_apply(c.model, c.data.train_x) for c in clients]).double()
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
    strategy, clients, state = build("fedlog", upload_dtype="float64")
    if round_ == 1:  # train once so the features are not those of the initial bodies
        state, _ = run_round(strategy, clients, state, 0)
    new_state, _ = run_round(strategy, clients, state, round_)
    table, n = pooled_table(clients)
    # sufficiency: sum of client statistics == pooled statistic (exact in float64)
    torch.testing.assert_close(new_state["statistics"], table, atol=1e-9, rtol=1e-12)
    reference = lbfgs_map(table, 1.0 + n)  # prior chi = 0, nu = 1
    head = new_state["head"].double()  # stored in float32: 6e-8 relative rounding
    scale = reference.abs().max()
    assert (head - reference).abs().max() <= 1e-6 * scale
    # the float64 solve itself matches the stationarity condition p_y W_y / 2 = S_y / N
    W = strategy.solve_head(table, n)
    p = torch.softmax(W.pow(2).sum(1) / 4, 0)
    torch.testing.assert_close(p[:, None] * W / 2, table / (1.0 + n), atol=1e-10, rtol=1e-9)


def test_float32_uploads_give_the_same_head_to_float32_rounding(build):
    strategy, clients, state = build("fedlog")
    new_state, ups = run_round(strategy, clients, state, 0)
    assert ups[0].tensors["statistics"].dtype == torch.float32
    table, n = pooled_table(clients)
    W = strategy.solve_head(table, n)
    # float32 statistics: relative rounding 6e-8 per entry, so 1e-6 relative to max |W|
    assert (new_state["head"].double() - W).abs().max() <= 1e-6 * W.abs().max()


def test_upload_bias_column_is_class_counts(build):
    strategy, clients, state = build("fedlog")
    _, ups = run_round(strategy, clients, state, 0)
    for c, u in zip(clients, ups, strict=True):
        counts = torch.bincount(c.data.train_y, minlength=NUM_CLASSES).float()
        assert torch.equal(u.tensors["statistics"][:, 0], counts)
        assert int(u.tensors["num_samples"]) == c.data.num_train


def test_round_zero_does_not_train_and_later_rounds_only_train_the_body(build):
    strategy, clients, state = build("fedlog")
    before = copy.deepcopy(clients[0].model.state_dict())
    state, _ = run_round(strategy, clients, state, 0)
    after0 = clients[0].model.state_dict()
    assert all(torch.equal(before[k], after0[k]) for k in before)
    head = state["head"].clone()
    state, _ = run_round(strategy, clients, state, 1)
    assert not torch.equal(before["1.weight"], clients[0].model.state_dict()["1.weight"])
    assert not torch.equal(head, state["head"])  # new statistics, new head


def test_training_improves_fedlog_training_accuracy(build):
    strategy, clients, state = build("fedlog", sizes=(30, 30, 30))
    state, _ = run_round(strategy, clients, state, 0)

    def train_accuracy():
        correct = sum(int((strategy.predict_proba(c, state, c.data.train_x).argmax(1)
                           == c.data.train_y).sum()) for c in clients)
        return correct / 90

    acc0 = train_accuracy()
    for r in range(1, 5):
        state, _ = run_round(strategy, clients, state, r)
    assert train_accuracy() > max(acc0, 0.6)


def test_predictions_are_softmax_of_head_times_augmented_features(build):
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    c = clients[1]
    probs = strategy.predict_proba(c, state, c.data.test_x)
    feats = c.model(c.data.test_x).detach().double()
    phi = torch.cat([torch.ones(len(feats), 1, dtype=torch.float64), feats], 1)
    torch.testing.assert_close(probs, torch.softmax(phi @ state["head"].double().T, 1))


def test_batched_client_updates_match_the_plain_loop(build):
    strategy, clients, state = build("fedlog")
    state, _ = run_round(strategy, clients, state, 0)
    twins = copy.deepcopy(clients)
    s_plain, _ = run_round(strategy, clients, state, 1, batched=False)
    s_batch, _ = run_round(strategy, twins, state, 1, batched=True)
    torch.testing.assert_close(s_plain["head"], s_batch["head"], atol=1e-5, rtol=1e-5)


def test_heterogeneous_bodies_share_one_head(build):
    strategy, clients, state = build("fedlog", bodies=("mlp:8", "mlp:5-5"))
    assert clients[0].body_spec != clients[1].body_spec
    state, _ = run_round(strategy, clients, state, 0)
    state, _ = run_round(strategy, clients, state, 1, batched=True)  # falls back to a loop
    assert state["head"].shape == (NUM_CLASSES, 5)


def _tampered(upload, **tensors):
    return Message(upload.header, {**upload.tensors, **tensors})


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
    _, ups = run_round(strategy, clients, state, 0)
    bad = wire(_tampered(ups[0], **change(ups[0].tensors)))
    with pytest.raises(MessageRejected, match=reason):
        strategy.validate_upload(bad, round=0, client_id=0)


def test_an_upload_for_another_round_or_client_is_rejected(build):
    strategy, clients, state = build("fedlog")
    _, ups = run_round(strategy, clients, state, 0)
    with pytest.raises(MessageRejected, match="round"):
        strategy.validate_upload(ups[0], round=1, client_id=0)
    with pytest.raises(MessageRejected, match="client_id"):
        strategy.validate_upload(ups[0], round=0, client_id=2)


def test_fedlog_c_broadcasts_statistics_and_clients_rebuild_the_servers_head(build):
    strategy, clients, state = build("fedlog-c")
    state, _ = run_round(strategy, clients, state, 0)
    down = wire(strategy.broadcast(state, 1))
    assert set(down.tensors) == {"statistics", "num_samples"}
    head, means = strategy._head_and_means(down)
    torch.testing.assert_close(head, state["head"], atol=0, rtol=0)  # same deterministic solve
    table = state["statistics"]
    torch.testing.assert_close(means.double(), table[:, 1:] / table[:, :1].clamp_min(1),
                               atol=1e-6, rtol=1e-6)
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
    new_state, ups = run_round(strategy, clients, state, 0)
    clean = sum(u.tensors["statistics"].double() for u in ups)
    noise = new_state["statistics"] - clean
    assert noise.abs().max() > 0
    assert noise.std().item() == pytest.approx(strategy.sigma, rel=0.6)
    feats = batched_apply(clients[0].model, clients[0].data.train_x)
    assert feats.max() <= 0.5
    # an upload that violates the clamp bound is rejected
    t = ups[0].tensors["statistics"].clone()
    t[:, 1:] += 100.0
    with pytest.raises(MessageRejected, match="clamp"):
        strategy.validate_upload(wire(_tampered(ups[0], statistics=t)), round=0, client_id=0)


def test_head_logits_put_the_bias_first():
    head = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    feats = torch.tensor([[3.0]])
    torch.testing.assert_close(head_logits(head, feats), torch.tensor([[7.0, -3.0]]).double())
