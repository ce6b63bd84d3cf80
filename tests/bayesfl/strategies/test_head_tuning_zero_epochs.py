"""Head fine-tuning stopped by held-out NLL counts zero epochs among its choices: when any
training only hurts the held-out rows, it returns 0 and leaves the head as it was."""

import math

import pytest
import torch
from torch import nn

from bayesfl.strategies.head_tuning import HeadTuning, fine_tune_stopped, mean_nll, tune_head
from bayesfl.strategies.networks import cross_entropy_per_sample


def noise_problem(seed, n=60, d=40, classes=3):
    """Labels independent of the features (balanced, in turn), a zero head: its held-out NLL
    is exactly log 3, the best any head can do in expectation on such labels. With 40 features
    for 48 fitted rows and Adam at lr 0.5, one epoch already fits the fitted rows' noise: the
    held-out NLL after it was 3.4 to 9.4 nats over eight splits (against 1.10), so zero epochs
    wins by more than 2 nats, a margin no CPU's rounding moves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.arange(n) % classes
    head = nn.Linear(d, classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head, x, y


@pytest.mark.parametrize("seed", range(4))
def test_zero_epochs_is_chosen_when_every_epoch_hurts_the_heldout_rows(seed):
    head, x, y = noise_problem(seed)
    assert mean_nll(head, x, y) == pytest.approx(math.log(3), rel=1e-12)
    used = tune_head(head, x, y, HeadTuning(10, 0.5, 8), torch.Generator().manual_seed(seed))
    assert used == 0
    # the final training on every row ran for zero epochs: the head is the one it started as
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0


def test_zero_epochs_is_chosen_for_a_head_inside_a_larger_module():
    # the same rule through fine_tune_stopped with only the head trainable (FedBABU, FedAvg-FT)
    head, x, y = noise_problem(0)
    body = nn.Linear(40, 40)
    with torch.no_grad():
        body.weight.copy_(torch.eye(40))
        body.bias.zero_()
    model = nn.Sequential(body, head)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    used = fine_tune_stopped(model, x, y, cross_entropy_per_sample, HeadTuning(10, 0.5, 8),
                             torch.Generator().manual_seed(0),
                             trainable=lambda name: name.startswith("1."))
    assert used == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
