"""A Gaussian posterior over every parameter of a network: `NetworkGaussian`.

``N(mean, diag(variance) + Dᵀ D)`` over the flat vector of a network's parameters (``D`` (r, P)
an optional low-rank factor, r = 0 for mean-field), as the whole-network Bayesian baselines
(pFedBayes: mean-field; FedPA: diagonal plus the IASG samples' low rank) hold one. It samples
flat parameter vectors; its predictive is the Monte Carlo average of the softmax of the network
under those draws (``"mc"``) or the softmax at the mean (``"map"``).

The network is the posterior's *architecture*: its parameter values are never used (every
prediction substitutes a flat vector with `torch.func.functional_call`). So the state is
tensors only (``mean``, ``variance``, ``factor``, and the predictive settings as integer
tensors), saved and loaded like any posterior (`inference.save_posterior`), and the
network comes back as an argument: ``NetworkGaussian.from_state_dict(state, model=net)`` or
``load_posterior(path).bind(net)``, as `SubnetLaplacePosterior` binds
its model. A posterior without a network samples and has a mean, but cannot predict.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from inference.errors import InvalidInputError
from inference.inputs import as_model_inputs, module_dtype
from inference.posterior import check_num_draws, draw_device, register_posterior

#: The predictive methods, in the order their index is saved (``state_dict()["method"]``).
PREDICTIVES = ("mc", "map")

#: What converts a user's batch to the network's input tensor:
#: ``prepare(inputs, *, input_shape, dtype, device, name) -> Tensor``, raising on a bad batch.
#: The default is `inference.inputs.as_model_inputs`; bayesfl passes its own, whose
#: errors are its ``DataError`` naming the client's input shape.
Prepare = Callable[..., Tensor]

Layout = Sequence[tuple[str, torch.Size]]


def parameter_layout(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """``[(name, shape)]`` of ``model``'s parameters in registration order (the flat order)."""
    return [(name, p.shape) for name, p in model.named_parameters()]


def flatten(tensors: Mapping[str, Tensor], layout: Layout) -> Tensor:
    """The tensors of ``layout``'s names concatenated into one flat (P,) vector."""
    return torch.cat([tensors[name].reshape(-1) for name, _ in layout])


def unflatten(flat: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Inverse of `flatten`: ``flat`` (..., P) -> ``{name: (..., *shape)}``."""
    out, start = {}, 0
    lead = flat.shape[:-1]
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = flat[..., start : start + size].reshape(*lead, *shape)
        start += size
    return out


@register_posterior
class NetworkGaussian:
    """A Gaussian over every parameter of ``model``: ``N(mean, diag(variance) + Dᵀ D)``.

    ``sample(n)`` draws the whole network as flat vectors ``(n, P)``, in
    `parameter_layout` order.

    Args:
        model: the network (its architecture; its values are never used), or None for a
            posterior that only samples (`bind` one later). Deep-copied, in eval mode.
        mean: (P,) flat mean, in `parameter_layout` order.
        variance: (P,) non-negative diagonal part.
        factor: (r, P) low-rank factor ``D`` (None: mean-field).
        method: the default predictive, ``"mc"`` or ``"map"``.
        n_samples: draws of the MC predictive.
        input_shape: the shape of one input (checked on every batch; None: not checked).
        prepare: the input boundary (`Prepare`; default
            `inference.inputs.as_model_inputs`).

    Raises:
        InvalidInputError: shapes that disagree with each other or with ``model``, negative or
            non-finite variances, an unknown ``method``.
    """

    kind: ClassVar[str] = "network_gaussian"

    def __init__(self, model: nn.Module | None, mean: Tensor, variance: Tensor,
                 factor: Tensor | None = None, *, method: str = "mc", n_samples: int = 32,
                 input_shape: tuple[int, ...] | None = None,
                 prepare: Prepare | None = None) -> None:
        if mean.ndim != 1 or variance.shape != mean.shape:
            raise InvalidInputError(f"mean and variance must be (P,) alike, got "
                                    f"{tuple(mean.shape)} and {tuple(variance.shape)}")
        size = mean.shape[0]
        if not bool((variance >= 0).all()) or not bool(torch.isfinite(variance).all()):
            raise InvalidInputError("variances must be finite and non-negative")
        if factor is not None and (factor.ndim != 2 or factor.shape[1] != size):
            raise InvalidInputError(f"factor must be (r, {size}), got {tuple(factor.shape)}")
        if method not in PREDICTIVES:
            raise InvalidInputError(f"method must be one of {PREDICTIVES}, got {method!r}")
        self._mean, self.variance, self.factor = mean, variance, factor
        self.method, self.n_samples = method, check_num_draws(int(n_samples))
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        self.prepare = prepare
        self.model: nn.Module | None = None
        self.layout: list[tuple[str, torch.Size]] | None = None
        if model is not None:
            self._attach(copy.deepcopy(model))

    def _attach(self, model: nn.Module) -> None:
        layout = parameter_layout(model)
        size = sum(math.prod(s) for _, s in layout)
        if size != self._mean.shape[0]:
            raise InvalidInputError(f"the network has {size} parameters but the posterior is "
                                    f"over {self._mean.shape[0]}; pass the network it was fitted "
                                    "for")
        self.model, self.layout = model.eval(), layout

    def bind(self, model: nn.Module) -> NetworkGaussian:
        """A copy of this posterior (sharing its tensors) that predicts with ``model``'s
        architecture (deep-copied)."""
        other = copy.copy(self)
        other._attach(copy.deepcopy(model))
        return other

    @property
    def mean(self) -> Tensor:
        """(P,) the flat posterior mean."""
        return self._mean

    def marginal_variance(self) -> Tensor:
        """(P,) the marginal variances: ``variance`` plus the column sums of ``D²``."""
        if self.factor is None:
            return self.variance
        return self.variance + self.factor.square().sum(0)

    def parameters(self, flat: Tensor) -> dict[str, Tensor]:
        """The named parameters of a flat vector (P,) (or a stack (S, P))."""
        return unflatten(flat, self._layout())

    def _layout(self) -> list[tuple[str, torch.Size]]:
        if self.layout is None:
            raise InvalidInputError(
                "this posterior holds no network: use NetworkGaussian.from_state_dict(state, "
                "model=...) or posterior.bind(model) before predicting")
        return self.layout

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` flat parameter draws (n, P): ``mean + sqrt(variance) ε₁ + Dᵀ ε₂``. The normal
        draws are made on ``generator``'s device (CPU without one), so a seeded generator gives
        the same draws wherever the posterior lives."""
        n = check_num_draws(n)
        mean = self._mean
        where = draw_device(generator, torch.device("cpu"))
        eps = torch.randn((n, mean.shape[0]), generator=generator, dtype=mean.dtype,
                          device=where)
        draws = mean + self.variance.sqrt() * eps.to(mean.device)
        if self.factor is not None and self.factor.shape[0] > 0:
            low = torch.randn((n, self.factor.shape[0]), generator=generator, dtype=mean.dtype,
                              device=where)
            draws = draws + low.to(mean.device) @ self.factor
        return draws

    @torch.no_grad()
    def logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """The network's outputs (B, C) with the flat parameters ``flat`` (P,)."""
        params = {k: v.to(x.dtype) for k, v in self.parameters(flat).items()}
        return functional_call(self.model, params, (x,))

    @torch.no_grad()
    def predict_proba(self, inputs: Any, method: str | None = None, *,
                      n_samples: int | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
        """Predictive probabilities (B, C) float64 of inputs (B, *input) (a tensor, NumPy array
        or list, cast to the network's dtype): the MC average of the softmax over
        ``n_samples`` draws (``"mc"``), or the softmax at the mean (``"map"``)."""
        method = method or self.method
        if method not in PREDICTIVES:
            raise InvalidInputError(f"method must be one of {PREDICTIVES}, got {method!r}")
        self._layout()
        prepare = self.prepare or as_model_inputs
        x = prepare(inputs, input_shape=self.input_shape, dtype=module_dtype(self.model),
                    device=self._mean.device, name="inputs")
        if method == "map":
            return torch.softmax(self.logits(self._mean, x).double(), -1)
        draws = self.sample(n_samples or self.n_samples, generator)
        total: Tensor | None = None
        for flat in draws:
            probs = torch.softmax(self.logits(flat, x).double(), -1)
            total = probs if total is None else total + probs
        return total / draws.shape[0]

    def to(self, device: torch.device | str) -> NetworkGaussian:
        """A copy on ``device`` (tensors and network; dtypes kept)."""
        moved = NetworkGaussian(
            None, self._mean.to(device), self.variance.to(device),
            None if self.factor is None else self.factor.to(device), method=self.method,
            n_samples=self.n_samples, input_shape=self.input_shape, prepare=self.prepare)
        if self.model is not None:
            moved._attach(copy.deepcopy(self.model).to(device))
        return moved

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only: ``mean``, ``variance``, ``factor`` (if any), ``method`` (int64 index
        into `PREDICTIVES`), ``n_samples`` (int64) and ``input_shape`` (int64, if any).
        The network is not in it (pass it to `from_state_dict`)."""
        out = {"mean": self._mean, "variance": self.variance,
               "method": torch.tensor(PREDICTIVES.index(self.method), dtype=torch.int64),
               "n_samples": torch.tensor(self.n_samples, dtype=torch.int64)}
        if self.factor is not None:
            out["factor"] = self.factor
        if self.input_shape is not None:
            out["input_shape"] = torch.tensor(self.input_shape, dtype=torch.int64)
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor], model: nn.Module | None = None, *,
                        prepare: Prepare | None = None) -> NetworkGaussian:
        """Inverse of `state_dict`, predicting with ``model``'s architecture (None: a
        posterior that samples; `bind` a network later).

        Raises:
            InvalidInputError: a missing entry, an entry of the wrong kind, or what the
                constructor refuses.
        """
        missing = [k for k in ("mean", "variance", "method", "n_samples") if k not in state]
        if missing:
            raise InvalidInputError(f"state lacks {missing}; not a network Gaussian posterior")
        for name in ("method", "n_samples", "input_shape"):
            value = state.get(name)
            if value is not None and (value.is_floating_point() or value.is_complex()
                                      or value.ndim != (1 if name == "input_shape" else 0)):
                raise InvalidInputError(f"state's {name!r} must be an integer "
                                        f"{'vector' if name == 'input_shape' else 'scalar'}")
        index = int(state["method"])
        if not 0 <= index < len(PREDICTIVES):
            raise InvalidInputError(f"state's 'method' must index {PREDICTIVES}, got {index}")
        shape = state.get("input_shape")
        return cls(model, state["mean"], state["variance"], state.get("factor"),
                   method=PREDICTIVES[index], n_samples=int(state["n_samples"]),
                   input_shape=None if shape is None else tuple(shape.tolist()),
                   prepare=prepare)

    def __repr__(self) -> str:
        rank = 0 if self.factor is None else self.factor.shape[0]
        return (f"NetworkGaussian(parameters={self._mean.shape[0]}, low_rank={rank}, "
                f"method={self.method!r})")


__all__ = ["PREDICTIVES", "NetworkGaussian", "Prepare", "flatten", "parameter_layout",
           "unflatten"]
