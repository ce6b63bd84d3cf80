"""The linearised (GLM) predictive of a Gaussian over network parameters, written once.

Both subnet posteriors (`inference.subnet.SubnetLaplacePosterior`, full covariance over
a subnet; `inference.subnet.DiagonalLaplacePosterior`, diagonal over every parameter)
predict by linearising the network at the mean: ``f(x, theta) ~ f(x) + J(x) (theta - mean)``.
With ``theta - mean = T z``, ``z ~ N(0, I)`` for a square root ``T`` of the covariance
(``Sigma = T T^T``), the logits are Gaussian with covariance ``J Sigma J^T``. The two
posteriors differ only in ``T``, written as a column scale folded into the Jacobian engine and a
map of the scaled Jacobian:

- full (``Sigma = L^{-T} L^{-1}``, ``L = D L_eq``): scale ``D^{-1}``; logit variance
  ``||L_eq^{-1} D^{-1} J_o^T||^2`` (a triangular solve); draws ``L_eq^{-T} z``;
- diagonal (``Sigma = diag(v)``): scale ``sqrt(v)``; logit variance ``sum_r (J_or sqrt(v_r))^2``;
  draws ``z``.

`glm_predict` does the rest once: the methods (``"glm_probit"``: ``softmax(kappa f)``,
``kappa_o = (1 + pi/8 var_o)^{-1/2}``, as laplace-torch's ``link_approx="probit"``;
``"glm_mc"``: the average softmax of ``f + J T z`` over weight-space draws; ``"map"``:
``softmax(f)``), the checks of its arguments, the inputs' conversion, the chunking of the rows
within a memory budget, and eval mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from inference.errors import InvalidInputError
from inference.inputs import as_network_inputs
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.memory import check_memory
from inference.subnet.training_mode import eval_mode

__all__ = ["DEFAULT_CHUNK_BYTES", "METHODS", "PredictiveMethod", "glm_predict", "probit_softmax"]

PredictiveMethod = Literal["glm_probit", "glm_mc", "map"]
METHODS = ("glm_probit", "glm_mc", "map")
DEFAULT_CHUNK_BYTES = 512 * 2**20
"""Working memory one predictive chunk may take by default (Jacobian + its solve)."""

LogitVariance = Callable[[Tensor], Tensor]
"""``(S, C, B)`` scaled Jacobian transpose ``T^T J^T`` -> ``(B, C)`` logit variances."""
FastVariance = Callable[[SubnetJacobian, Tensor], "tuple[Tensor, Tensor] | None"]
"""``(engine, x)`` -> ``(variances (B, C), logits (B, C))`` by a cheaper route, or None."""


def check_method(method: str | None, n_samples: int) -> str:
    """The method (``None`` -> ``"glm_probit"``), refused unless one of `METHODS`;
    ``n_samples`` refused unless a positive int (whatever the method: a bad value is a bug
    of the caller's either way)."""
    method = "glm_probit" if method is None else method
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise InvalidInputError(f"n_samples must be a positive int, got {n_samples!r}")
    return method


@torch.no_grad()
def glm_predict(
    model: nn.Module,
    engine: SubnetJacobian,
    inputs: Tensor,
    method: str,
    *,
    column_scale: Tensor,
    logit_variance: LogitVariance,
    draws: Callable[[int], Tensor] | None = None,
    n_samples: int = 100,
    extra_row_bytes: int = 0,
    chunk_size: int | None = None,
    max_memory_bytes: int | None = None,
    fast_variance: FastVariance | None = None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """Predictive class probabilities (B, C) of a linearised Gaussian, rows summing to one.

    Args:
        model: the network (put in eval mode for the passes, flags restored after).
        engine: its Jacobian engine over the posterior's entries (S of them).
        inputs: (B, ...) model inputs (tensor, NumPy array or list), moved to ``device``;
            floating inputs cast to ``dtype``.
        method: a checked method (`check_method`).
        column_scale: (S,) the covariance root's scale folded into the Jacobian.
        logit_variance: the scaled Jacobian's map to the logit variances (module docstring).
        draws: ``n -> (S, n)`` weight-space draws in the scaled space, for ``"glm_mc"``.
        n_samples: draws for ``"glm_mc"``.
        extra_row_bytes: working memory per input row beyond the Jacobian and the draws' logits
            (e.g. a triangular solve's output).
        chunk_size: rows per chunk; ``None`` picks the largest within ``DEFAULT_CHUNK_BYTES``.
        max_memory_bytes: memory budget override for the preflight.
        fast_variance: an optional cheaper route to the probit's variances, tried first.
        dtype: the network's dtype (of the returned probabilities).
        device: the posterior's device.
    """
    x = as_network_inputs(inputs, dtype).to(device)
    weight_draws = None
    if method == "glm_mc":
        if draws is None:
            raise InvalidInputError("glm_mc needs weight-space draws")
        weight_draws = draws(n_samples)
    rows = _chunk_rows(model, engine, x, chunk_size, n_samples, extra_row_bytes,
                       max_memory_bytes)
    out = []
    with eval_mode(model):
        for start in range(0, x.shape[0], rows):
            out.append(_predict_chunk(engine, x[start : start + rows], method, column_scale,
                                      logit_variance, weight_draws, fast_variance))
    return torch.cat(out)


def _predict_chunk(engine: SubnetJacobian, x: Tensor, method: str, column_scale: Tensor,
                   logit_variance: LogitVariance, weight_draws: Tensor | None,
                   fast_variance: FastVariance | None) -> Tensor:
    if method == "map":
        return torch.softmax(engine.logits(x), dim=-1)
    if method == "glm_probit" and fast_variance is not None:
        fast = fast_variance(engine, x)
        if fast is not None:
            return probit_softmax(*fast)
    Jt, logits = engine(x, column_scale=column_scale)  # (S, C, B): T^T J^T
    if method == "glm_probit":
        return probit_softmax(logit_variance(Jt), logits)
    S, C, B = Jt.shape
    # J T z for every draw: (n, B, C)
    f_samples = (weight_draws.T @ Jt.reshape(S, C * B)).reshape(-1, C, B).transpose(1, 2)
    return torch.softmax(logits.unsqueeze(0) + f_samples, dim=-1).mean(0)


def probit_softmax(f_var: Tensor, logits: Tensor) -> Tensor:
    """The probit approximation of the GLM predictive: ``softmax(kappa f)`` with ``kappa =
    (1 + pi/8 var)^{-1/2}`` per logit, for logit variances ``f_var`` and means ``logits``, both
    ``(B, C)``."""
    kappa = torch.rsqrt(1.0 + math.pi / 8.0 * f_var)
    return torch.softmax(kappa * logits, dim=-1)


def _chunk_rows(model: nn.Module, engine: SubnetJacobian, x: Tensor, chunk_size: int | None,
                n_samples: int, extra_row_bytes: int, max_memory_bytes: int | None) -> int:
    """Rows per chunk: the caller's, or the most within ``DEFAULT_CHUNK_BYTES``; preflighted."""
    with eval_mode(model):  # one single-row forward pass for C
        C = engine.logits(x[:1]).shape[1]
    itemsize = engine.mean.element_size()
    # Jacobian temporaries, the caller's extra (e.g. its solve) and the sampled logits, a row
    per_row = sum(engine.workspace_bytes(1, C).values()) + extra_row_bytes * C
    per_row += 2 * C * n_samples * itemsize
    if chunk_size is None:
        chunk_size = max(1, min(x.shape[0], DEFAULT_CHUNK_BYTES // per_row))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_memory(
        {"subnet Jacobian chunk and its solve": per_row * chunk_size},
        device=engine.mean.device,
        max_memory_bytes=max_memory_bytes,
        advice="Pass a smaller chunk_size, predict on fewer inputs at once, or use a "
        "smaller subnet.",
    )
    return chunk_size
