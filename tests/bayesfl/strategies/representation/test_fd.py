"""FD (federated distillation): per-class mean logits up, the aggregate (without the client's
own contribution) down, a distillation term equal to its hand computation."""

import math

import pytest
import torch
from strategy_helpers import NUM_CLASSES, network_output, run_round, wire

from bayesfl.errors import MessageRejected
from bayesfl.messages import Message
from bayesfl.simulate import simulate
from bayesfl.strategies.representation.fd import distillation_terms, teacher_logits


def test_uploads_are_class_mean_logits_and_the_aggregate_is_count_weighted(build):
    strategy, clients, state = build("fd")
    new, ups = run_round(strategy, clients, state, 1)
    logits = torch.cat([network_output(strategy, c) for c in clients]).double()
    labels = torch.cat([c.data.train_y for c in clients])
    for y in range(NUM_CLASSES):
        torch.testing.assert_close(new["logits"][y].double(), logits[labels == y].mean(0),
                                   atol=1e-5, rtol=1e-5)  # float32 sums of ~40 logits
    assert {k: tuple(v.shape) for k, v in ups[0].tensors.items()} == {
        "logits": (NUM_CLASSES, NUM_CLASSES), "counts": (NUM_CLASSES,)}
    assert new["counts"].sum() == len(labels) and int(new["round"]) == 1


def test_teacher_without_own_contribution_is_the_mean_of_the_others():
    own = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    other = torch.tensor([[3.0, -1.0], [4.0, 4.0]], dtype=torch.float64)
    own_n, other_n = torch.tensor([2, 0]), torch.tensor([1, 3])
    mean = (own * own_n[:, None] + other * other_n[:, None]) / (own_n + other_n)[:, None]
    teacher, present = teacher_logits(mean, own_n + other_n, own, own_n)
    torch.testing.assert_close(teacher, other.double(), rtol=0, atol=1e-12)
    assert present.tolist() == [True, True]
    alone, present = teacher_logits(own, own_n, own, own_n)
    assert present.tolist() == [False, False] and torch.equal(alone, torch.zeros(2, 2).double())


def test_distillation_term_equals_a_hand_computation():
    z, g, T = [0.3, -0.2, 1.0], [2.0, 0.0, -1.0], 2.0

    def softmax(v):
        e = [math.exp(a / T) for a in v]
        return [a / sum(e) for a in e]

    q, p = softmax(g), softmax(z)
    expected = T * T * sum(a * math.log(a / b) for a, b in zip(q, p, strict=True))
    teacher = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, -1.0], [0.0, 0.0, 0.0]],
                           dtype=torch.float64)
    got = distillation_terms(torch.tensor([z, z], dtype=torch.float64), teacher,
                             torch.tensor([False, True, True]), torch.tensor([1, 0]), T)
    assert abs(float(got[0]) - expected) < 1e-12 and float(got[1]) == 0.0  # class 0: no teacher


def test_poisoned_and_parameter_uploads_are_rejected(build):
    strategy, clients, state = build("fd")
    plan = strategy.configure(state, 1)
    _, ups = run_round(strategy, clients, state, 1)
    t = ups[0].tensors
    cases = {"unexpected": {**t, "model.head.bias": clients[0].state["model.head.bias"]},
             "max_abs": {**t, "logits": t["logits"] * 1e6},
             "negative": {**t, "counts": -t["counts"]}}
    for reason, tensors in cases.items():
        with pytest.raises(MessageRejected, match=reason):
            strategy.validate_upload(plan, wire(Message(ups[0].header, tensors)), 0)


@pytest.mark.trained
def test_fd_runs_on_digits_and_uploads_c_by_c_floats():
    result = simulate("fd", "digits", clients=5, partition="iid", rounds=3, seed=0,
                      progress=False, body="mlp:64", feature_dim=32, local_epochs=1,
                      batch_size=16, threads=1)
    for m in result.metrics:
        assert m["rejections"] == [] and m["floats_up"] == 5 * (10 * 10 + 10)
    header = result.metrics[-1]["bytes_up_per_client"][0] - 4 * 100 - 8 * 10
    assert 0 < header < 1024
    # chance is 0.1 (standard error 0.014 on 450 test digits); FD learns well above it
    assert result.summary["accuracy"] > 0.3
