"""A head posterior seen through a body: [`BodyPosterior`][inference.body_posterior.BodyPosterior].

Heads in [`inference`][inference] are posteriors over a head's parameters on *features*
(``predict_proba(features)``). A `BodyPosterior` puts a network body (inputs -> features)
in front of one, so that ``predict_proba`` takes the *inputs*; the parameters it samples are
still the head's. In federation the body is one client's own network under a shared head
posterior (bayesfl's ``ClientPosterior`` is this class; its input errors are bayesfl's).

State: `BodyPosterior.state_dict` holds the head's tensors (``head.<name>``), the body's
(``body.<name>``: its ``nn.Module.state_dict()``) and ``input_shape``; the architecture of the
body, the head's kind and the predictive settings are code, passed back to
`from_state_dict`. Such a posterior is not registered for
`inference.save_posterior`: a file cannot rebuild a network, so save the head
(``save_posterior(post.head, path)``) and keep the body as a network.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from inference.errors import InvalidInputError
from inference.inputs import as_model_inputs, module_device, module_dtype
from inference.network_gaussian import Prepare
from inference.posterior import posterior_class

#: Inputs run through the body in chunks of this many rows (bounds the activations' memory).
CHUNK_ROWS = 4096


class BodyPosterior:
    """``head`` (an `inference` posterior over a head on body features) behind ``body``.

    ``sample(n)`` draws the *head*: its posterior's draws (for the conjugate and Laplace heads
    ``(n, C, m + 1)``, the bias in column 0); the body is fixed, never drawn.

    Args:
        body: the network up to the head's features, (B, *input) -> (B, m); taken in eval mode
            (not copied: the caller's module).
        head: the head posterior (``mean``, ``sample``, ``predict_proba(features, method)``).
        method: the predictive method used when ``predict_proba`` is given none.
        input_shape: the shape of one input, checked on every batch (None: the body decides).
        prepare: the input boundary (`inference.network_gaussian.Prepare`; default
            `inference.inputs.as_model_inputs`).
        input_error: the exception raised when the body cannot take a batch whose shape was
            not checked (``input_shape`` None); bayesfl passes its ``DataError``.
        **defaults: default keyword options of the head's ``predict_proba`` for ``method``
            (e.g. ``n_samples``).
    """

    kind: ClassVar[str] = "body"

    def __init__(self, body: nn.Module, head: Any, method: str, *,
                 input_shape: tuple[int, ...] | None = None, prepare: Prepare | None = None,
                 input_error: type[Exception] = InvalidInputError, **defaults: Any) -> None:
        self.body = body.eval()
        self.head = head
        self.method = method
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.prepare = prepare
        self.input_error = input_error
        self.defaults = defaults

    @property
    def mean(self) -> Tensor:
        """The head posterior's point estimate (e.g. a conjugate head's MAP (C, m + 1))."""
        return self.head.mean

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` head draws, shape ``(n, *mean.shape)``."""
        return self.head.sample(n, generator=generator)

    def features(self, inputs: Any) -> Tensor:
        """The body's features (B, m) float64 of ``inputs`` (B, *input).

        Bad batches raise what ``prepare`` raises (``InvalidInputError`` by default), and
        ``input_error`` if the body cannot take a batch whose shape was not checked.
        """
        prepare = self.prepare or as_model_inputs
        inputs = prepare(inputs, input_shape=self.input_shape, dtype=module_dtype(self.body),
                         device=module_device(self.body), name="inputs")
        try:
            with torch.no_grad():
                return torch.cat([self.body(inputs[i : i + CHUNK_ROWS])
                                  for i in range(0, inputs.shape[0], CHUNK_ROWS)]).double()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            if self.input_shape is not None:  # the shape was checked: not a bad input
                raise
            # a shape the body cannot take (the expected input shape is unknown)
            raise self.input_error(f"the body cannot take inputs of shape "
                                   f"{tuple(inputs.shape)}: {error}") from None

    def predict_proba(self, inputs: Any, method: str | None = None, **options: Any) -> Tensor:
        """Predictive probabilities (B, C) float64 of ``inputs`` (B, *input), a tensor, NumPy
        array or list; ``method`` and ``options`` as the head posterior names them (default:
        ``self.method`` with ``self.defaults``)."""
        method = method or self.method
        if method == self.method:
            options = {**self.defaults, **options}
        return self.head.predict_proba(self.features(inputs), method=method, **options)

    def to(self, device: torch.device | str) -> BodyPosterior:
        """A copy on ``device`` (the body deep-copied; dtypes kept)."""
        return BodyPosterior(copy.deepcopy(self.body).to(device), self.head.to(device),
                             self.method, input_shape=self.input_shape, prepare=self.prepare,
                             input_error=self.input_error, **self.defaults)

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``head.<name>`` (the head's state), ``body.<name>`` (the body's
        parameters and buffers) and ``input_shape`` (int64, if any)."""
        out = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        out.update({f"body.{k}": v for k, v in self.body.state_dict().items()})
        if self.input_shape is not None:
            out["input_shape"] = torch.tensor(self.input_shape, dtype=torch.int64)
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], *, body: nn.Module,
                        head: type | str, method: str, prepare: Prepare | None = None,
                        input_error: type[Exception] = InvalidInputError,
                        **defaults: Any) -> BodyPosterior:
        """Inverse of [`state_dict`][inference.body_posterior.BodyPosterior.state_dict].

        Args:
            state: what [`state_dict`][inference.body_posterior.BodyPosterior.state_dict] returned.
            body: a network of the body's architecture; a deep copy of it is loaded with the
                state's ``body.*`` tensors (strictly: the same names and shapes), so its own
                values do not matter and it is not modified.
            head: the head posterior's class or registered kind; its ``from_state_dict``
                rebuilds the head from the ``head.*`` tensors. (A head that needs more, such as
                a subnet Laplace posterior's model, is rebuilt by the caller and passed to the
                constructor.)
            method: the predictive method used when ``predict_proba`` is given none.
            prepare: the input boundary, as the constructor takes it.
            input_error: as the constructor takes it.
            **defaults: default options of the head's ``predict_proba``, as the constructor
                takes them.

        Raises:
            InvalidInputError: no ``head.*`` tensors, or body tensors that do not fit ``body``.
        """
        head_state = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
        body_state = {k[len("body."):]: v for k, v in state.items() if k.startswith("body.")}
        if not head_state:
            raise InvalidInputError("state has no head.* tensors; not a body posterior's state")
        head_class = posterior_class(head) if isinstance(head, str) else head
        network = copy.deepcopy(body)
        try:
            network.load_state_dict(body_state, strict=True)
        except RuntimeError as error:
            raise InvalidInputError(f"the state's body.* tensors do not fit the body given: "
                                    f"{error}") from None
        shape = state.get("input_shape")
        return cls(network, head_class.from_state_dict(head_state), method,
                   input_shape=None if shape is None else tuple(shape.tolist()),
                   prepare=prepare, input_error=input_error, **defaults)

    def __repr__(self) -> str:
        return f"BodyPosterior(head={self.head!r}, method={self.method!r})"


__all__ = ["CHUNK_ROWS", "BodyPosterior"]
