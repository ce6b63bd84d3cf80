"""FedLog-C's compactness loss (spec §4.1)."""

import pytest
import torch

from inference.conjugate.compactness import ClassMeans, compactness_loss
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError


def global_statistics(C=4, m=3, seed=0, absent=(3,)):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (200,), generator=g)
    for cls in absent:
        labels[labels == cls] = 0
    features = torch.randn(200, m, generator=g) + labels.unsqueeze(1).float()
    return SufficientStatistics.from_features(features, labels, C), features, labels


def test_loss_is_alpha_times_the_batch_mean_squared_distance_to_global_class_means():
    stats, features, labels = global_statistics()
    x = torch.randn(16, 3, requires_grad=True)
    y = torch.randint(0, 3, (16,))
    loss = compactness_loss(x, y, stats, alpha=0.05)
    means = torch.stack([features[labels == c].mean(0) for c in range(3)])
    expected = 0.05 * sum(float(((x[i].detach() - means[y[i]]) ** 2).sum()) for i in range(16)) / 16
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_gradient_flows_to_features_only():
    stats = global_statistics()[0]
    means = ClassMeans.from_statistics(stats)
    x = torch.randn(8, 3, requires_grad=True)
    y = torch.randint(0, 3, (8,))
    compactness_loss(x, y, means, alpha=0.1).backward()
    expected = 2 * 0.1 * (x.detach() - means.means[y]) / 8
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-7)
    assert not means.means.requires_grad


def test_samples_of_globally_absent_classes_contribute_nothing():
    stats = global_statistics(absent=(3,))[0]
    means = ClassMeans.from_statistics(stats)
    assert means.present.tolist() == [True, True, True, False]
    x = torch.randn(4, 3)
    y = torch.tensor([3, 3, 3, 3])
    assert float(compactness_loss(x, y, means)) == 0.0


def test_precomputed_means_and_statistics_give_the_same_loss():
    stats = global_statistics()[0]
    x, y = torch.randn(10, 3), torch.randint(0, 4, (10,))
    assert torch.equal(compactness_loss(x, y, stats), compactness_loss(
        x, y, ClassMeans.from_statistics(stats, dtype=torch.float32)))


def test_bad_inputs_are_rejected():
    stats = global_statistics()[0]
    with pytest.raises(InvalidInputError, match="features"):
        compactness_loss(torch.randn(4, 5), torch.zeros(4, dtype=torch.int64), stats)
    with pytest.raises(InvalidInputError, match="labels"):
        compactness_loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 4]), stats)
    with pytest.raises(InvalidInputError, match="alpha"):
        compactness_loss(torch.randn(4, 3), torch.zeros(4, dtype=torch.int64), stats, alpha=-1)
