"""What travels between the halves of a strategy and how the server weighs it: tensors as
they go on the wire, the sample count every upload declares, and the weighted mean over
uploads that most aggregations are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from bayesfl.messages import Message, TensorSpec


def wire(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as they travel: detached, contiguous, on the CPU."""
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def num_samples_tensor(n: int) -> Tensor:
    """The sample count as it travels in uploads: shape (1,), int64."""
    return torch.tensor([n], dtype=torch.int64)


NUM_SAMPLES_SPEC = TensorSpec((1,), torch.int64)


def sample_counts(messages: Sequence[Message]) -> list[int]:
    """The uploads' declared sample counts (their ``num_samples`` entries)."""
    return [int(m.tensors["num_samples"].item()) for m in messages]


def client_weights(counts: Sequence[int], weighted: bool) -> Tensor:
    """(K,) float64 aggregation weights summing to 1: ``n_k / n`` (``weighted``) or ``1 / K``."""
    weights = torch.tensor([float(n) if weighted else 1.0 for n in counts], dtype=torch.float64)
    return weights / weights.sum()


def weighted_mean(messages: Sequence[Message], name: str, weights: Tensor) -> Tensor:
    """float64 ``sum_k weights[k] * messages[k].tensors[name]``."""
    stacked = torch.stack([m.tensors[name].to(torch.float64) for m in messages])
    return (weights.view(-1, *[1] * (stacked.dim() - 1)) * stacked).sum(0)


def num_samples_problem(message: Message) -> str | None:
    """None if the upload's sample count is >= 1, else the reason."""
    n = int(message.tensors["num_samples"].item())
    return None if n >= 1 else f"num_samples must be >= 1, got {n}"
