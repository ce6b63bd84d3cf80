"""A federated posterior as one client holds it: the client's own body under a shared head
posterior.

Posterior strategies federate a posterior over a head (FedLog: the conjugate posterior of the
summed statistics). :class:`ClientPosterior` puts client k's body in front of it, so that
``predict_proba`` takes the client's *inputs*; the parameters it samples are the head's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn


class ClientPosterior:
    """``head`` (an :mod:`inference` posterior over a head on body features) behind ``body``.

    Args:
        body: the client's network up to the head's features (B, *input) -> (B, m).
        head: the head posterior (``mean``, ``sample``, ``predict_proba(features, method)``).
        method: the predictive method used when ``predict_proba`` is given none.
        **defaults: default keyword options of the head's ``predict_proba`` (e.g.
            ``n_samples``).
    """

    kind = "client"

    def __init__(self, body: nn.Module, head: Any, method: str, **defaults: Any) -> None:
        self.body = body.eval()
        self.head = head
        self.method = method
        self.defaults = defaults

    @property
    def mean(self) -> Tensor:
        """The head posterior's point estimate (FedLog: the MAP head (C, m + 1))."""
        return self.head.mean

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` head draws, shape ``(n, *mean.shape)``."""
        return self.head.sample(n, generator=generator)

    def features(self, inputs: Tensor) -> Tensor:
        """The body's features (B, m) float64 of ``inputs`` (B, *input)."""
        with torch.no_grad():
            return torch.cat([self.body(inputs[i : i + 4096])
                              for i in range(0, max(inputs.shape[0], 1), 4096)]).double()

    def predict_proba(self, inputs: Tensor, method: str | None = None, **options: Any) -> Tensor:
        """Predictive probabilities (B, C) float64 of ``inputs`` (B, *input); ``method`` and
        ``options`` as the head posterior names them (default: the strategy's predictive)."""
        method = method or self.method
        if method == self.method:
            options = {**self.defaults, **options}
        return self.head.predict_proba(self.features(inputs), method=method, **options)

    def to(self, device: torch.device | str) -> ClientPosterior:
        """A copy on ``device``."""
        return ClientPosterior(copy.deepcopy(self.body).to(device), self.head.to(device),
                               self.method, **self.defaults)

    def state_dict(self) -> dict[str, Tensor]:
        """The head posterior's tensors (the body is the client's own network)."""
        return self.head.state_dict()

    def __repr__(self) -> str:
        return f"ClientPosterior(head={self.head!r}, method={self.method!r})"
