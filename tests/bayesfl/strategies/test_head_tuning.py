"""Head fine-tuning stopped by held-out NLL (bayesfl.strategies.head_tuning): the epoch count is
the held-out NLL's argmin, the final head is trained on every row for that many epochs, and
"fixed" is the plain schedule."""

import pytest
import torch
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.strategies.head_tuning import HeadTuning, mean_nll, tune_head
from bayesfl.strategies.networks import cross_entropy_per_sample
from bayesfl.training import LocalTraining, train_plain


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
    assert torch.equal(head.weight, other.weight) and torch.equal(head.bias, other.bias)


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
    assert torch.equal(head.weight, by_hand.weight) and torch.equal(head.bias, by_hand.bias)


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
