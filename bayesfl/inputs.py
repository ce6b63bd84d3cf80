"""What a user hands a trained federation: a client id and a batch of that client's inputs.

`bayesfl.simulate.SimulationResult.predict_proba`, ``SimulationResult.posterior`` and
the posteriors it returns (`bayesfl.posterior.client_posterior`, the whole-network
baselines' `inference.NetworkGaussian`) check them here, so that a bad one is a
[`ConfigError`][bayesfl.errors.ConfigError] (the client id) or `DataError` (the
inputs) saying what was wrong and what to pass.

Inputs may be a torch tensor, a NumPy array or a nested list of numbers, of any real dtype:
they are converted to the dtype and device of the client's data (float32 for the bundled data
sets), so float64 inputs work with a float32 network. Booleans, complex numbers, strings and
objects are refused (`inference.inputs` does the conversion).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bayesfl.errors import ConfigError, DataError
from inference.errors import InvalidInputError
from inference.inputs import as_tensor, check_finite


def client_index(client_id: Any, num_clients: int) -> int:
    """``client_id`` as an int in ``[0, num_clients)`` (NumPy integers accepted).

    Raises:
        ConfigError: not an integer (a bool, a float, a string) or out of range.
    """
    if isinstance(client_id, bool | np.bool_) or not isinstance(client_id, numbers.Integral) \
            or not 0 <= int(client_id) < num_clients:
        raise ConfigError(
            f"client_id must be an integer in [0, {num_clients}) (the run has {num_clients} "
            f"clients); got {client_id!r}"
        )
    return int(client_id)


def client_inputs(
    x: Any,
    *,
    input_shape: tuple[int, ...] | None,
    dtype: torch.dtype,
    device: torch.device | str,
    name: str = "x",
) -> Tensor:
    """A batch ``x`` of shape ``(B, *input_shape)`` as a finite ``dtype`` tensor on ``device``.

    Args:
        x: tensor, NumPy array or nested list.
        input_shape: the shape of one input of the client (None: not checked).
        dtype: the floating dtype of the client's network.
        device: where the client's network lives.
        name: what the caller calls the argument, for messages.

    Raises:
        DataError: not real numbers, no batch axis or an empty batch, a per-sample shape that
            differs from ``input_shape``, or NaN / inf (also after the conversion to ``dtype``).
    """
    try:
        tensor = as_tensor(x, name)
    except InvalidInputError as error:
        raise DataError(str(error)) from None
    shape = tuple(tensor.shape)
    if input_shape is not None and shape == tuple(input_shape):
        raise DataError(f"{name} has the shape of one input {shape}; pass a batch "
                        f"(B, {', '.join(map(str, input_shape))}), e.g. {name}[None]")
    if tensor.ndim == 0 or shape[0] == 0:
        raise DataError(f"{name} must be a non-empty batch (B, ...); got shape {shape}")
    if input_shape is not None and shape[1:] != tuple(input_shape):
        want = ", ".join(["B", *map(str, input_shape)])
        raise DataError(f"{name} has shape {shape} but this client's inputs have shape ({want}); "
                        "pass inputs shaped like the data set the run was trained on")
    try:
        check_finite(tensor, name)
    except InvalidInputError as error:
        raise DataError(str(error)) from None
    converted = tensor.to(device=device, dtype=dtype)
    if converted.is_floating_point() and not bool(torch.isfinite(converted).all()):
        largest = torch.finfo(dtype).max
        raise DataError(f"{name} has values beyond ±{largest:.3g}, which overflow the client's "
                        f"{dtype}; rescale the inputs as the training data were")
    return converted


__all__ = ["client_index", "client_inputs"]
