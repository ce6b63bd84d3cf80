"""Adam without ``torch.optim``: the update of ``torch.optim.Adam``, bit for bit, for one client.

Why not ``torch.optim.Adam`` itself: every ``torch.optim`` optimizer wraps
``add_param_group`` and ``step`` in ``torch._disable_dynamo``, which imports ``torch._dynamo``
(and sympy) the first time an optimizer is built — 1.7 s on a quiet 2-core machine, 4-10 s
under load — and there is no supported switch to avoid it. A Flower ClientApp is a fresh
process per message, so it paid that import at every message. `Adam` is the same
algorithm and imports nothing beyond torch.

What is the same as ``torch.optim.Adam(params, lr, betas, eps, weight_decay, amsgrad,
foreach=False)`` (its single-tensor path, the default on CPU): the arithmetic, operation by
operation (`adam_update_`), hence the parameters after every step (tested with
``torch.equal``); and the per-parameter state, ``optimizer.state[p]`` with ``"step"`` (a
0-dim float32 CPU tensor, float64 when that is the default dtype), ``"exp_avg"``,
``"exp_avg_sq"`` (and ``"max_exp_avg_sq"`` with ``amsgrad``), so code that reads or seeds
Adam's moments works with either. What it leaves out: parameter groups, ``state_dict()``,
``maximize``, complex parameters, decoupled weight decay (AdamW), ``foreach``/``fused``
kernels (on CUDA, ``torch.optim.Adam`` defaults to ``foreach``, which rounds differently).

`StackedAdam` is this update over many clients' stacked parameters that all step
together (the batched trainer's uniform case), equal to each client's own `Adam` bit for
bit. The batched trainer's per-client masked Adam over stacked parameters
(`bayesfl.training` ``_AdamState``, for clients with different numbers of steps) is the
same formula rearranged for fewer passes over memory and per-client step counts; it agrees
with this one up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from bayesfl.errors import ConfigError


def adam_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: float,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    max_exp_avg_sq: Tensor | None = None,
) -> Tensor:
    """One Adam step of ``param`` in place, ``step`` being the count after this step (>= 1);
    returns the denominator it divided by, ``sqrt(v_hat) + eps`` (a fresh tensor of
    ``param``'s shape: Adam's per-entry step size is ``lr / denominator``, which the exact
    proximal step of `bayesfl.training.GaussianProx` reads).

    The operations of ``torch.optim.adam._single_tensor_adam`` (torch 2.x, not capturable,
    not differentiable), in its order and with its Python-float coefficients, so that the
    float rounding is the same. ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` for
    AMSGrad) are updated in place.
    """
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = adam_denominator(exp_avg_sq, bias_correction2, eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    return denom


def adam_denominator(exp_avg_sq: Tensor, bias_correction2: float, eps: float) -> Tensor:
    """``sqrt(exp_avg_sq / bias_correction2) + eps`` as `adam_update_` computes it
    (``exp_avg_sq.sqrt() / sqrt(bias_correction2)``, then ``+ eps``): the same bits wherever it
    is recomputed from the same second moment."""
    return (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)


class Adam:
    """Adam over ``params`` (one group): ``zero_grad()``, ``step()`` and ``state[p]`` as
    ``torch.optim.Adam`` (module docstring); parameters without a gradient are skipped and
    take no step, as there.

    Raises:
        ConfigError: a learning rate, epsilon or weight decay below 0, a beta outside
            ``[0, 1)``, or a complex or sparse parameter.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ConfigError(f"Adam needs lr, eps and weight_decay >= 0, got lr={lr}, "
                              f"eps={eps}, weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"Adam's betas must lie in [0, 1), got {betas}")
        self.params: list[Tensor] = list(params)
        for p in self.params:
            if torch.is_complex(p):
                raise ConfigError("bayesfl.adam.Adam does not take complex parameters")
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), eps
        self.weight_decay, self.amsgrad = float(weight_decay), bool(amsgrad)
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (``None``, or zeros with ``set_to_none=False``)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step of every parameter that has a gradient."""
        beta1, beta2 = self.betas
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 \
            else torch.float32  # torch.optim's _get_scalar_dtype()
        for p in self.params:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ConfigError("bayesfl.adam.Adam does not take sparse gradients")
            state = self.state.get(p)
            if not state:
                state = self.state[p] = {
                    "step": torch.tensor(0.0, dtype=step_dtype),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if self.amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
            state["step"] += 1
            adam_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                         state["step"].item(), lr=self.lr, beta1=beta1, beta2=beta2,
                         eps=self.eps, weight_decay=self.weight_decay,
                         max_exp_avg_sq=state.get("max_exp_avg_sq"))


# elements of one slice of `StackedAdam`'s update: its passes over a slice of 256 KiB
# (float32) and its temporaries stay in a core's L2 cache (512 KiB here; with 1 MiB slices
# the update of 16,000 mlp:100 clients took 1.5x as long)
_SLICE = 1 << 16


def client_slices(stacked: Tensor) -> Iterator[slice]:
    """Slices of whole clients (rows of the leading axis of ``stacked`` (K, ...)) of about
    256 KiB of float32 each (one client where a client is larger): elementwise passes over a
    slice and their temporaries stay in a core's L2 cache, where passes over the whole stack
    would stream it from memory and allocate stack-sized temporaries."""
    rows = max(1, _SLICE // max(1, stacked[0].numel()))
    for start in range(0, stacked.shape[0], rows):
        yield slice(start, start + rows)


class StackedAdam:
    """Adam over many clients' parameters stacked on a leading client axis ``(K, ...)``, all
    of them stepping at every step (one step count, shared): ``m[name]``, ``v[name]`` (the
    moments, stacked like the parameters) and ``steps``.

    `step` applies `adam_update_` to slices of whole clients. Every operation of
    it is elementwise with Python-float coefficients that depend only on the step count, so
    each client's rows get exactly the arithmetic its own `Adam` (hence
    ``torch.optim.Adam(foreach=False)``) does on them: given the same gradients, the same
    parameters and moments bit for bit (tested). ``torch.optim.Adam(fused=True)`` over the
    stack, which the batched trainer used before, rounds differently and imports
    ``torch._dynamo`` on first use. No weight decay, no AMSGrad (what local training uses).

    The moments are allocated by the first step that keeps them (`zeros` allocates
    nothing): a fresh state whose only step is its last (``step(..., last=True)``: one
    mini-batch per epoch with the optimiser reset each epoch, or one step in all) runs the
    update on zeroed moments of one slice at a time instead of zeroing and keeping two
    buffers as large as the parameters (2 x 470 MB at 16,000 ``mlp:100`` clients).
    """

    def __init__(self, m: dict[str, Tensor], v: dict[str, Tensor], steps: int = 0) -> None:
        self.m, self.v, self.steps = m, v, steps
        self._spent = False

    @classmethod
    def zeros(cls, params: dict[str, Tensor]) -> StackedAdam:
        """A fresh state (zero moments, no step yet) for stacked ``params``; the moment
        buffers are allocated by the first step that keeps them."""
        return cls({}, {})

    def moments(self, params: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """``(m, v)`` for every name of ``params``: the state's buffers, allocated (zeros) if
        no step has kept them yet."""
        if self._spent:
            raise ConfigError("this StackedAdam took its last step: its moments were not kept")
        for n, p in params.items():
            if n not in self.m:
                self.m[n], self.v[n] = torch.zeros_like(p), torch.zeros_like(p)
        return self.m, self.v

    def reset(self) -> None:
        """Back to a fresh state (zero moments, no step), in place: buffers already allocated
        are zeroed (cheaper than new ones), none are allocated."""
        for t in [*self.m.values(), *self.v.values()]:
            t.zero_()
        self.steps, self._spent = 0, False

    @torch.no_grad()
    def step(self, params: dict[str, Tensor], grads: dict[str, Tensor], *, lr: float,
             b1: float, b2: float, eps: float, last: bool = False,
             after: Callable[[str, slice, Tensor, Tensor], None] | None = None) -> None:
        """One Adam step of every client: ``params`` and the moments updated in place, in
        slices of whole clients of about 256 KiB (cache-sized passes, small temporaries).

        ``last``: no step follows on this state before `reset` (its moments will not
        be read). A fresh state then keeps no moments: each slice's update runs on zeroed
        moments of that slice's size, the same arithmetic as on zeroed buffers.
        ``after(name, cut, param, denominator)``: called on each slice right after its update
        (while it is in cache), with ``param = params[name][cut]`` and the update's
        `adam_update_` denominator (a proximal step after Adam's)."""
        if self._spent:
            raise ConfigError("this StackedAdam took its last step; reset() it first")
        fresh = last and self.steps == 0 and not self.m
        m_all, v_all = ({}, {}) if fresh else self.moments(params)
        self.steps += 1
        self._spent = last
        step = float(self.steps)
        for n, p in params.items():
            g = grads[n]
            for cut in client_slices(p):
                param, grad = p[cut], g[cut]
                if grad.stride() != param.stride():
                    # laid out otherwise (a vmapped linear layer's weight gradient is each
                    # client's transpose): read once into the parameter's layout, so the
                    # update's passes run on vectors (3x faster than each reading it strided)
                    grad = torch.empty_like(param).copy_(grad)
                if fresh:
                    m = torch.zeros_like(param)
                    v = torch.zeros_like(m)
                else:
                    m, v = m_all[n][cut], v_all[n][cut]
                denom = adam_update_(param, grad, m, v, step, lr=lr, beta1=b1, beta2=b2, eps=eps)
                if after is not None:
                    after(n, cut, param, denom)


__all__ = ["Adam", "StackedAdam", "adam_denominator", "adam_update_", "client_slices"]
