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

from bayesfl.errors import DataError
from bayesfl.inputs import client_inputs, module_device, module_dtype


class ClientPosterior:
    """``head`` (an :mod:`inference` posterior over a head on body features) behind ``body``.

    Inputs may be tensors, NumPy arrays or lists of any real dtype; they are cast to the body's
    dtype and device (:func:`bayesfl.inputs.client_inputs`), and a bad batch is a
    :class:`~bayesfl.errors.DataError`. To save the posterior, save its head:
    ``inference.save_posterior(post.head, path)`` (the body is the client's own network).

    Args:
        body: the client's network up to the head's features (B, *input) -> (B, m).
        head: the head posterior (``mean``, ``sample``, ``predict_proba(features, method)``).
        method: the predictive method used when ``predict_proba`` is given none.
        input_shape: the shape of one input, checked on every batch (None: the body decides).
        **defaults: default keyword options of the head's ``predict_proba`` (e.g.
            ``n_samples``).
    """

    kind = "client"

    def __init__(self, body: nn.Module, head: Any, method: str, *,
                 input_shape: tuple[int, ...] | None = None, **defaults: Any) -> None:
        self.body = body.eval()
        self.head = head
        self.method = method
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.defaults = defaults

    @property
    def mean(self) -> Tensor:
        """The head posterior's point estimate (FedLog: the MAP head (C, m + 1))."""
        return self.head.mean

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` head draws, shape ``(n, *mean.shape)``."""
        return self.head.sample(n, generator=generator)

    def features(self, inputs: Any) -> Tensor:
        """The body's features (B, m) float64 of ``inputs`` (B, *input).

        Raises:
            DataError: inputs that are not a finite batch of real numbers shaped like the
                client's inputs (or that the body cannot take).
        """
        inputs = client_inputs(inputs, input_shape=self.input_shape, dtype=module_dtype(self.body),
                               device=module_device(self.body), name="inputs")
        try:
            with torch.no_grad():
                return torch.cat([self.body(inputs[i : i + 4096])
                                  for i in range(0, inputs.shape[0], 4096)]).double()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            if self.input_shape is not None:  # the shape was checked: not a bad input
                raise
            # a shape the body cannot take (the expected input shape is unknown)
            raise DataError(f"the client's body cannot take inputs of shape "
                            f"{tuple(inputs.shape)}: {error}") from None

    def predict_proba(self, inputs: Any, method: str | None = None, **options: Any) -> Tensor:
        """Predictive probabilities (B, C) float64 of ``inputs`` (B, *input), a tensor, NumPy
        array or list; ``method`` and ``options`` as the head posterior names them (default:
        the strategy's predictive).

        Raises:
            DataError: bad inputs (see :meth:`features`).
        """
        method = method or self.method
        if method == self.method:
            options = {**self.defaults, **options}
        return self.head.predict_proba(self.features(inputs), method=method, **options)

    def to(self, device: torch.device | str) -> ClientPosterior:
        """A copy on ``device``."""
        return ClientPosterior(copy.deepcopy(self.body).to(device), self.head.to(device),
                               self.method, input_shape=self.input_shape, **self.defaults)

    def state_dict(self) -> dict[str, Tensor]:
        """The head posterior's tensors (the body is the client's own network)."""
        return self.head.state_dict()

    def __repr__(self) -> str:
        return f"ClientPosterior(head={self.head!r}, method={self.method!r})"
