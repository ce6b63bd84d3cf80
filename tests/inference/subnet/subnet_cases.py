"""Tiny models, loaders and the laplace-torch reference of the subnet Laplace tests.

Float64 unless a test says so.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SmallCNN(nn.Module):
    """conv(1->3, 3x3, pad 1), ReLU, conv(3->4, 3x3, stride 2), ReLU, flatten, Linear(36, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 4, 3, stride=2)
        self.fc = nn.Linear(36, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))
        return self.fc(h.flatten(1))


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)
    ).to(dtype)


def make_cnn(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN().to(dtype)


def make_loader(x: torch.Tensor, n_classes: int, seed: int = 0, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (x.shape[0],), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def laplace_subnet_reference(model, loader, idx, prior=1.0, structure="full"):
    """laplace-torch's ``FullSubnetLaplace`` / ``DiagSubnetLaplace`` (AsdlGGN) fitted on a copy
    of ``model``. A float ``prior`` goes to the constructor; a tensor (one precision per subnet
    entry) is set through ``la._prior_precision`` before ``fit`` (spec fedsi.md §7.2.3)."""
    from laplace import Laplace
    from laplace.curvature import AsdlGGN

    per_entry = isinstance(prior, torch.Tensor)
    la = Laplace(
        copy.deepcopy(model),
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure=structure,
        subnetwork_indices=idx,
        backend=AsdlGGN,
        **({} if per_entry else {"prior_precision": prior}),
    )
    if per_entry:
        la._prior_precision = prior.to(next(model.parameters()).dtype)
    la.fit(loader)
    return la


