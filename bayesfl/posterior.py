"""A client's posterior as bayesfl hands it to a user: `client_posterior`.

Posterior strategies federate a posterior over a head (FedLog: the conjugate posterior of the
summed statistics). Client k's view of it is an `inference.BodyPosterior`: the client's
own body in front of the head posterior, so that ``predict_proba`` takes the client's *inputs*;
the parameters it samples are the head's. ``bayesfl.ClientPosterior`` is that class (the name
bayesfl's API has always used); `client_posterior` builds one with bayesfl's input
boundary, so a bad batch is a [`DataError`][bayesfl.errors.DataError] naming the client's input
shape (`bayesfl.inputs.client_inputs`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from bayesfl.errors import DataError
from bayesfl.inputs import client_inputs
from inference.body_posterior import BodyPosterior

#: bayesfl's public name of `inference.BodyPosterior`.
ClientPosterior = BodyPosterior


def client_posterior(body: nn.Module, head: Any, method: str, *,
                     input_shape: tuple[int, ...] | None = None,
                     **defaults: Any) -> BodyPosterior:
    """``head`` behind client ``body``, checking inputs as bayesfl does.

    Inputs may be tensors, NumPy arrays or lists of any real dtype; they are cast to the body's
    dtype and device (`bayesfl.inputs.client_inputs`), and a bad batch (or one the body
    cannot take) is a [`DataError`][bayesfl.errors.DataError]. To save the posterior, save its head:
    ``inference.save_posterior(post.head, path)`` (the body is the client's own network).

    Args:
        body: the client's network up to the head's features (B, *input) -> (B, m).
        head: the head posterior (``mean``, ``sample``, ``predict_proba(features, method)``).
        method: the predictive method used when ``predict_proba`` is given none.
        input_shape: the shape of one input, checked on every batch (None: the body decides).
        **defaults: default keyword options of the head's ``predict_proba`` (e.g.
            ``n_samples``).
    """
    return BodyPosterior(body, head, method, input_shape=input_shape, prepare=client_inputs,
                         input_error=DataError, **defaults)


__all__ = ["ClientPosterior", "client_posterior"]
