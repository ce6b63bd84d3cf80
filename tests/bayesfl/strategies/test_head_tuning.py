"""Head fine-tuning stopped by held-out NLL (bayesfl.strategies.head_tuning): the epoch count is
the held-out NLL's argmin, the final head is trained on every row for that many epochs, and
"fixed" is the plain schedule. A linear head on CPU features takes the written-out gradient
(tune_linear_head): the same schedule as the autograd path up to float rounding. A group of
clients' heads (tune_heads) is tuned together where they have the same shapes: each client's
own draws, epoch count and head, as tune_head gives them."""

import pytest
import torch
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.strategies.head_tuning import (
    HeadTuning,
    fine_tune_stopped,
    linear_ce_gradient,
    linear_head_tunable,
    mean_nll,
    tune_head,
    tune_heads,
)
from bayesfl.strategies.networks import cross_entropy_per_sample
from bayesfl.training import LocalTraining, LocalTrainingWarning, train_plain

# tune_head on a linear head against the autograd path (train_plain): the same float32
# gradient rounded in another order (~1e-7 relative a step), through Adam's normalised steps
# of size ~lr; over these tests' <= 500 steps at lr <= 0.05 the parameters (O(1)) measured
# within 2e-6 of each other. 2e-5 leaves room for other CPUs' rounding; a wrong gradient
# (sign, a missing row, the bias) moves them by > 1e-2 (linear_ce_gradient is checked
# against autograd on its own, where Adam's scale invariance cannot hide a wrong 1 / B).
CLOSE = {"atol": 2e-5, "rtol": 0}


def problem(n=60, d=5, classes=3, noise=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, :classes].argmax(1) if noise == 0 else torch.randint(classes, (n,), generator=g))
    head = nn.Linear(d, classes)
    with torch.no_grad():
        head.weight.copy_(0.1 * torch.randn(classes, d, generator=g))
        head.bias.zero_()
    return head, x, y


def test_fixed_is_the_plain_schedule_on_every_row():
    head, x, y = problem()
    other = nn.Linear(5, 3)
    other.load_state_dict(head.state_dict())
    used = tune_head(head, x, y, HeadTuning(7, 0.05, 16, stop="fixed"),
                     torch.Generator().manual_seed(3))
    train_plain(other, x, y, cross_entropy_per_sample,
                LocalTraining(epochs=7, lr=0.05, batch_size=16, reset_optimizer_each_epoch=False),
                generator=torch.Generator().manual_seed(3))
    assert used == 7
    torch.testing.assert_close(head.weight, other.weight, **CLOSE)
    torch.testing.assert_close(head.bias, other.bias, **CLOSE)


def test_heldout_nll_picks_the_epoch_count_then_trains_on_every_row():
    # the same steps by hand: the split is the generator's first permutation (12 of 60 rows
    # held out), the search trains on the other 48 and records the held-out NLL after each
    # epoch; the final head restarts from the initial one on all 60 rows
    head, x, y = problem()
    start = {k: v.clone() for k, v in head.state_dict().items()}
    tuning = HeadTuning(15, 0.05, 16)
    used = tune_head(head, x, y, tuning, torch.Generator().manual_seed(3))

    g = torch.Generator().manual_seed(3)
    order = torch.randperm(60, generator=g)
    held, fit = order[:12], order[12:]
    by_hand = nn.Linear(5, 3)
    by_hand.load_state_dict(start)
    nlls = [mean_nll(by_hand, x[held], y[held])]
    train_plain(by_hand, x[fit], y[fit], cross_entropy_per_sample, tuning.training(15),
                generator=g, after_epoch=lambda _: nlls.append(mean_nll(by_hand, x[held], y[held])))
    best = min(range(16), key=nlls.__getitem__)
    assert used == best
    by_hand.load_state_dict(start)
    train_plain(by_hand, x, y, cross_entropy_per_sample, tuning.training(best), generator=g)
    torch.testing.assert_close(head.weight, by_hand.weight, **CLOSE)
    torch.testing.assert_close(head.bias, by_hand.bias, **CLOSE)


def test_separable_labels_train_long_and_noise_labels_stop_early():
    # labels a function of x: the held-out NLL keeps falling, so (nearly) every epoch is used;
    # labels independent of x: fitting them only hurts the held-out rows, so it stops early
    head, x, y = problem(n=200)
    assert tune_head(head, x, y, HeadTuning(30, 0.05, 20), torch.Generator().manual_seed(0)) >= 20
    head, x, y = problem(n=200, noise=1.0)
    assert tune_head(head, x, y, HeadTuning(30, 0.05, 20), torch.Generator().manual_seed(0)) <= 5


def test_one_row_or_zero_epochs_fall_back_to_the_fixed_schedule():
    head, x, y = problem(n=1)
    assert tune_head(head, x, y, HeadTuning(4, 0.05, 16), torch.Generator()) == 4
    head, x, y = problem()
    before = head.weight.clone()
    assert tune_head(head, x, y, HeadTuning(0, 0.05, 16), torch.Generator()) == 0
    assert torch.equal(head.weight, before)


@pytest.mark.parametrize("options, message", [
    ({"stop": "early"}, "stop must be one of heldout_nll, fixed"),
    ({"heldout_fraction": 0.0}, r"heldout_fraction must be in \(0, 1\)"),
    ({"heldout_fraction": 1.0}, r"heldout_fraction must be in \(0, 1\)"),
    ({"max_epochs": -1}, "epochs must be >= 0"),
])
def test_bad_settings_are_refused(options, message):
    settings = {"max_epochs": 5, "lr": 0.01, "batch_size": 8, **options}
    with pytest.raises(ConfigError, match=message):
        HeadTuning(**settings)


def test_linear_ce_gradient_is_autograds():
    # float64: the two agree to rounding (1e-15 measured); 1e-12 catches a missing 1 / B
    g = torch.Generator().manual_seed(4)
    x, theta = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(
        3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    cross_entropy_per_sample(x @ theta.T, y).mean().backward()
    onehot = nn.functional.one_hot(y, 3).to(x.dtype)
    ours = linear_ce_gradient((x @ theta.T).detach(), x, onehot)
    torch.testing.assert_close(ours, theta.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("stop", ["heldout_nll", "fixed"])
def test_linear_fast_path_is_the_module_path_at_fedsis_size(stop):
    # FedSI's per-round view: 250 rows of 100 ReLU features, 10 classes, batch 50, lr 1e-2,
    # up to 100 epochs (~550 Adam steps): the same epoch count, parameters within CLOSE
    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(250, 100, generator=g))
    w = 0.1 * torch.randn(10, 100, generator=g)
    y = (x @ w.T + 0.5 * torch.randn(250, 10, generator=g)).argmax(1)
    head = nn.Linear(100, 10)
    with torch.no_grad():
        head.weight.copy_(0.1 * torch.randn(10, 100, generator=g))
        head.bias.copy_(0.1 * torch.randn(10, generator=g))
    module = nn.Linear(100, 10)
    module.load_state_dict(head.state_dict())
    tuning = HeadTuning(100, 1e-2, 50, stop)
    assert linear_head_tunable(head, x, y)
    fast = tune_head(head, x, y, tuning, torch.Generator().manual_seed(5))
    slow = fine_tune_stopped(module, x, y, cross_entropy_per_sample, tuning,
                             torch.Generator().manual_seed(5))
    assert fast == slow
    torch.testing.assert_close(head.weight, module.weight, **CLOSE)
    torch.testing.assert_close(head.bias, module.bias, **CLOSE)


def test_linear_fast_path_stops_where_the_module_path_does_on_a_non_finite_loss():
    # an infinite feature in one row: the loss of that row's mini-batch is not finite; both
    # paths warn and keep the parameters of the last finite mini-batch
    head, x, y = problem()
    x[17, 2] = float("inf")
    module = nn.Linear(5, 3)
    module.load_state_dict(head.state_dict())
    tuning = HeadTuning(3, 0.05, 16, stop="fixed")
    with pytest.warns(LocalTrainingWarning, match="training stopped"):
        tune_head(head, x, y, tuning, torch.Generator().manual_seed(2))
    with pytest.warns(LocalTrainingWarning, match="training stopped"):
        fine_tune_stopped(module, x, y, cross_entropy_per_sample, tuning,
                          torch.Generator().manual_seed(2))
    torch.testing.assert_close(head.weight, module.weight, **CLOSE)
    assert bool(torch.isfinite(head.weight).all())


def test_heads_the_fast_path_does_not_take_use_the_module_path():
    x, y = torch.randn(8, 5), torch.zeros(8, dtype=torch.int64)
    assert not linear_head_tunable(nn.Linear(5, 3, bias=False), x, y)
    assert not linear_head_tunable(nn.Sequential(nn.Linear(5, 3)), x, y)
    assert not linear_head_tunable(nn.Linear(5, 3), x.double(), y)


# tune_heads against tune_head client by client: the same Adam steps on the same rows, the
# mini-batch products of the group as one batched product of the transposed logits, their
# softmax along the class axis of (K, C, B). Stacking rounds only those products and that
# softmax differently (float32: ~1e-7 a step), so the epoch counts are equal and the heads
# within CLOSE; a client drawing another's shuffles, a wrong Adam state or a head written back
# to the wrong client moves them by > 1e-2.


def _clients(count=4, n=80, d=12, classes=5, seed=0):
    heads, xs, ys = [], [], []
    for k in range(count):
        head, x, y = problem(n, d, classes, noise=0.3 if k % 2 else 0.0, seed=seed + k)
        heads.append(head)
        xs.append(torch.relu(x))
        ys.append(y)
    return heads, xs, ys


def _tuned_one_by_one(heads, xs, ys, tuning, seeds):
    copies = [nn.Linear(h.in_features, h.out_features) for h in heads]
    for copy, head in zip(copies, heads, strict=True):
        copy.load_state_dict(head.state_dict())
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    used = [tune_head(c, x, y, tuning, g)
            for c, x, y, g in zip(copies, xs, ys, generators, strict=True)]
    return copies, used, generators


@pytest.mark.parametrize("max_epochs", [1, 25])
def test_tune_heads_gives_each_client_what_tune_head_gives_it(max_epochs):
    heads, xs, ys = _clients()
    tuning = HeadTuning(max_epochs, 0.05, 16)
    seeds = [11, 3, 7, 5]
    expected, expected_used, alone = _tuned_one_by_one(heads, xs, ys, tuning, seeds)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    used = tune_heads(heads, xs, ys, tuning, generators)
    assert used == expected_used
    if max_epochs > 1:
        assert len(set(used)) > 1  # the final trainings have different lengths
    for head, other in zip(heads, expected, strict=True):
        torch.testing.assert_close(head.weight, other.weight, **CLOSE)
        torch.testing.assert_close(head.bias, other.bias, **CLOSE)
    # each client's generator left where tune_head leaves it (the same draws, no more)
    for generator, other in zip(generators, alone, strict=True):
        assert torch.equal(torch.randperm(50, generator=generator),
                           torch.randperm(50, generator=other))


def test_tune_heads_tunes_clients_of_other_shapes_one_by_one():
    heads, xs, ys = _clients()
    xs[2], ys[2] = xs[2][:50], ys[2][:50]  # another row count
    tuning = HeadTuning(10, 0.05, 16)
    expected, expected_used, _ = _tuned_one_by_one(heads, xs, ys, tuning, [1, 2, 3, 4])
    used = tune_heads(heads, xs, ys, tuning, [torch.Generator().manual_seed(s)
                                              for s in (1, 2, 3, 4)])
    assert used == expected_used
    for head, other in zip(heads, expected, strict=True):
        assert torch.equal(head.weight, other.weight)


def test_tune_heads_starts_again_one_by_one_when_a_client_diverges():
    # an infinite feature in client 1: its loss stops its training (the warning, once), the
    # other clients train on; every head as tune_head leaves it
    heads, xs, ys = _clients()
    xs[1][7, 3] = float("inf")
    tuning = HeadTuning(6, 0.05, 16)
    with pytest.warns(LocalTrainingWarning, match="training stopped"):
        expected, expected_used, _ = _tuned_one_by_one(heads, xs, ys, tuning, [1, 2, 3, 4])
    with pytest.warns(LocalTrainingWarning, match="training stopped") as caught:
        used = tune_heads(heads, xs, ys, tuning, [torch.Generator().manual_seed(s)
                                                  for s in (1, 2, 3, 4)])
    assert len([w for w in caught if issubclass(w.category, LocalTrainingWarning)]) == 1
    assert used == expected_used
    for head, other in zip(heads, expected, strict=True):
        assert torch.equal(head.weight, other.weight)
        assert bool(torch.isfinite(head.weight).all())
