"""SubnetJacobian and diagonal_ggn against an independent reference: torch.func per-sample
Jacobians of all parameters, sliced. Tolerance 1e-12 (float64, same arithmetic up to order)."""

from __future__ import annotations

import pytest
import torch
from subnet_cases import make_cnn, make_loader, make_mlp
from torch import nn
from torch.func import functional_call, jacrev, vmap

from inference.subnet import SubnetJacobian, diagonal_ggn, flat_trainable_parameters


class SequencePooling(nn.Module):
    """Linear over a (B, T, d) sequence, mean-pooled, LayerNorm (generic path), Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, 4)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.proj(x)).mean(1)))


class TiedWeights(nn.Module):
    """The same Linear applied twice (weight sharing) plus a free scale parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0, 1.0]))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.scale * torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class UnusedLayer(nn.Module):
    """A Linear the forward pass never calls (e.g. a training-only projection): zero columns."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 5)
        self.unused = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def cases():
    torch.manual_seed(0)
    return {
        "mlp": (make_mlp(), torch.randn(9, 5, dtype=torch.float64)),
        "cnn": (make_cnn(), torch.randn(6, 1, 8, 8, dtype=torch.float64)),
        "sequence": (SequencePooling().double(), torch.randn(7, 6, 3, dtype=torch.float64)),
        "tied": (TiedWeights().double(), torch.randn(8, 4, dtype=torch.float64)),
        "unused": (UnusedLayer().double(), torch.randn(8, 4, dtype=torch.float64)),
    }


def reference_jacobian(model, x):
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def f(p, xi):
        return functional_call(model, {**p, **frozen}, (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    return torch.cat([jac[k].reshape(x.shape[0], -1, v.numel()) for k, v in params.items()], 2)


@pytest.mark.parametrize("name", ["mlp", "cnn", "sequence", "tied", "unused"])
@pytest.mark.parametrize("subnet", ["random", "all"])
def test_subnet_jacobian_equals_the_sliced_full_jacobian(name, subnet):
    model, x = cases()[name]
    model.eval()
    mean = flat_trainable_parameters(model)
    n = mean.numel()
    g = torch.Generator().manual_seed(1)
    idx = (
        torch.randperm(n, generator=g)[: max(1, n // 3)] if subnet == "random" else torch.arange(n)
    )
    Jt, logits = SubnetJacobian(model, idx, mean)(x)
    expected = reference_jacobian(model, x)[:, :, idx]
    assert Jt.shape == (idx.numel(), expected.shape[1], x.shape[0])
    assert not Jt.requires_grad
    assert torch.allclose(Jt.permute(2, 1, 0), expected, atol=1e-12, rtol=0)
    scale = torch.linspace(0.5, 2.0, idx.numel(), dtype=torch.float64)
    Jt_scaled, _ = SubnetJacobian(model, idx, mean)(x, column_scale=scale)
    assert torch.allclose(Jt_scaled, Jt * scale.view(-1, 1, 1), atol=1e-12, rtol=0)
    assert torch.allclose(logits, model(x), atol=1e-14)


@pytest.mark.parametrize("name", ["cnn", "sequence", "tied", "unused"])
def test_diagonal_ggn_equals_the_reference_on_conv_generic_and_sequence_layers(name):
    model, x = cases()[name]
    model.eval()
    J = reference_jacobian(model, x)  # (B, C, P)
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    pJ = p.unsqueeze(-1) * J
    expected = (pJ * J).sum((0, 1)) - pJ.sum(1).square().sum(0)
    loader = make_loader(x, p.shape[1], batch_size=4)
    assert torch.allclose(diagonal_ggn(model, loader), expected, atol=1e-12, rtol=0)


def test_jacobian_is_taken_at_the_given_mean_not_the_model_weights():
    model, x = cases()["mlp"]
    mean = flat_trainable_parameters(model)
    idx = torch.arange(0, mean.numel(), 3)
    J_before, _ = SubnetJacobian(model, idx, mean.clone())(x)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    J_after, _ = SubnetJacobian(model, idx, mean.clone())(x)
    assert torch.equal(J_before, J_after)
