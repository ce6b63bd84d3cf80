"""Gaussian posteriors over a whole client network, and upload checks shared by the
whole-network Bayesian baselines (pFedBayes, FedPA).

:class:`NetworkGaussian` is ``N(mean, diag(variance) + Dᵀ D)`` over the flat vector of a
network's parameters (``D`` (r, P) an optional low-rank factor, r = 0 for mean-field). It
samples flat parameter vectors, and its predictive is the Monte Carlo average of the softmax
of the network under those draws (``"mc"``) or the softmax at the mean (``"map"``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from bayesfl.errors import ConfigError
from bayesfl.inputs import client_inputs
from bayesfl.messages import Message
from bayesfl.strategies.base import RoundPlan, num_samples_problem
from bayesfl.strategies.robust import declared_problems, first_reasons, screening_reasons

PREDICTIVES = ("mc", "map")


def parameter_layout(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """``[(name, shape)]`` of ``model``'s parameters in registration order (the flat order)."""
    return [(name, p.shape) for name, p in model.named_parameters()]


def flatten(tensors: Mapping[str, Tensor], layout: Sequence[tuple[str, torch.Size]]) -> Tensor:
    """The tensors of ``layout``'s names concatenated into one flat (P,) vector."""
    return torch.cat([tensors[name].reshape(-1) for name, _ in layout])


def unflatten(flat: Tensor, layout: Sequence[tuple[str, torch.Size]]) -> dict[str, Tensor]:
    """Inverse of :func:`flatten`: ``flat`` (..., P) -> ``{name: (..., *shape)}``."""
    out, start = {}, 0
    lead = flat.shape[:-1]
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = flat[..., start : start + size].reshape(*lead, *shape)
        start += size
    return out


class NetworkGaussian:
    """A Gaussian over every parameter of ``model``: ``N(mean, diag(variance) + Dᵀ D)``.

    Args:
        model: the network (its structure; its values are never used). Taken in eval mode.
        mean: (P,) flat mean, in :func:`parameter_layout` order.
        variance: (P,) non-negative diagonal part.
        factor: (r, P) low-rank factor ``D`` (None: mean-field).
        method: the default predictive, ``"mc"`` or ``"map"``.
        n_samples: draws of the MC predictive.
        input_shape: the shape of one input (checked on every batch).
    """

    kind = "network-gaussian"

    def __init__(self, model: nn.Module, mean: Tensor, variance: Tensor,
                 factor: Tensor | None = None, *, method: str = "mc", n_samples: int = 32,
                 input_shape: tuple[int, ...] | None = None) -> None:
        self.model = copy.deepcopy(model).eval()
        self.layout = parameter_layout(self.model)
        size = sum(math.prod(s) for _, s in self.layout)
        if mean.shape != (size,) or variance.shape != (size,):
            raise ConfigError(f"mean and variance must be ({size},), got {tuple(mean.shape)} and "
                              f"{tuple(variance.shape)}")
        if not bool((variance >= 0).all()) or not bool(torch.isfinite(variance).all()):
            raise ConfigError("variances must be finite and non-negative")
        if factor is not None and (factor.ndim != 2 or factor.shape[1] != size):
            raise ConfigError(f"factor must be (r, {size}), got {tuple(factor.shape)}")
        if method not in PREDICTIVES:
            raise ConfigError(f"method must be one of {PREDICTIVES}, got {method!r}")
        self._mean, self.variance, self.factor = mean, variance, factor
        self.method, self.n_samples = method, int(n_samples)
        self.input_shape = input_shape

    @property
    def mean(self) -> Tensor:
        """(P,) the flat posterior mean."""
        return self._mean

    def parameters(self, flat: Tensor) -> dict[str, Tensor]:
        """The named parameters of a flat vector (P,) (or a stack (S, P))."""
        return unflatten(flat, self.layout)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` flat parameter draws (n, P): ``mean + sqrt(variance) ε₁ + Dᵀ ε₂``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"the number of draws must be an integer >= 1, got {n!r}")
        mean = self._mean
        eps = torch.randn((n, mean.shape[0]), generator=generator, dtype=mean.dtype)
        draws = mean + self.variance.sqrt() * eps.to(mean.device)
        if self.factor is not None and self.factor.shape[0] > 0:
            low = torch.randn((n, self.factor.shape[0]), generator=generator, dtype=mean.dtype)
            draws = draws + low.to(mean.device) @ self.factor
        return draws

    @torch.no_grad()
    def logits(self, flat: Tensor, x: Tensor) -> Tensor:
        """The network's outputs (B, C) with the flat parameters ``flat`` (P,)."""
        params = {k: v.to(x.dtype) for k, v in self.parameters(flat).items()}
        return functional_call(self.model, params, (x,))

    @torch.no_grad()
    def predict_proba(self, inputs, method: str | None = None, *,
                      n_samples: int | None = None,
                      generator: torch.Generator | None = None) -> Tensor:
        """Predictive probabilities (B, C) float64 of inputs (B, *input): the MC average of
        the softmax over ``n_samples`` draws (``"mc"``), or the softmax at the mean
        (``"map"``)."""
        method = method or self.method
        if method not in PREDICTIVES:
            raise ConfigError(f"method must be one of {PREDICTIVES}, got {method!r}")
        like = next(self.model.parameters())
        x = client_inputs(inputs, input_shape=self.input_shape, dtype=like.dtype,
                          device=self._mean.device, name="inputs")
        if method == "map":
            return torch.softmax(self.logits(self._mean, x).double(), -1)
        draws = self.sample(n_samples or self.n_samples, generator)
        total = torch.zeros(x.shape[0], 0, dtype=torch.float64)
        for flat in draws:
            probs = torch.softmax(self.logits(flat, x).double(), -1)
            total = probs if total.shape[1] == 0 else total + probs
        return total / draws.shape[0]

    def state_dict(self) -> dict[str, Tensor]:
        out = {"mean": self._mean, "variance": self.variance}
        if self.factor is not None:
            out["factor"] = self.factor
        return out

    def __repr__(self) -> str:
        rank = 0 if self.factor is None else self.factor.shape[0]
        return (f"NetworkGaussian(parameters={self._mean.shape[0]}, low_rank={rank}, "
                f"method={self.method!r})")


def count_problems(plan: RoundPlan, messages: Sequence[Message],
                   screening_ratio: float | None) -> list[str | None]:
    """Per upload: a sample count >= 1, not above the client's first declared one, and within
    ``screening_ratio`` times the round's median (None: no screening)."""
    ids = [m.header.client_id for m in messages]
    counts = [int(m.tensors["num_samples"].item()) for m in messages]
    return first_reasons(
        [num_samples_problem(m) for m in messages],
        declared_problems(plan.state, ids, counts),
        screening_reasons(torch.tensor(counts, dtype=torch.float64), screening_ratio,
                          "num_samples"))


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
