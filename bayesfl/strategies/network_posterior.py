"""Upload checks shared by the whole-network Bayesian baselines (pFedBayes, FedPA, FedPop).

The Gaussian posterior over a whole network they predict with is
:class:`inference.network_gaussian.NetworkGaussian`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from bayesfl.messages import Message
from inference.network_gaussian import (  # noqa: F401 - until fedpa/pfedbayes import them there
    NetworkGaussian,
    flatten,
    parameter_layout,
    unflatten,
)


def difference_norms(reference: Mapping[str, Tensor], messages: Sequence[Message],
                     names: Mapping[str, str]) -> Tensor:
    """(K,) float64 L2 norm of each upload's tensors ``names[key]`` minus ``reference[key]``
    (``names`` maps server-state keys to upload keys)."""
    norms = torch.zeros(len(messages), dtype=torch.float64)
    for key, up in names.items():
        start = reference[key].detach().to("cpu", torch.float64)
        for k, m in enumerate(messages):
            norms[k] += (m.tensors[up].to(torch.float64) - start).square().sum()
    return norms.sqrt()
