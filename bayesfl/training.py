"""Local training loops of federated clients.

Two interchangeable paths train one or many client models on their own data with mini-batch
Adam and a per-sample objective:

* `train_plain` — one client at a time, `bayesfl.adam.Adam` (``torch.optim.Adam``'s
  update bit for bit, without the ``torch._dynamo`` import that ``torch.optim`` pays on first
  use); works for any module, so it is the path for heterogeneous bodies.
* `train_batched` — many clients that share one architecture at once: their parameters
  are stacked on a leading client axis and one backward of the ``torch.func.vmap``-ped losses
  computes every client's gradient. Clients with fewer samples get padded mini-batches
  whose padding is masked out of the loss, and a client with no batch left in an epoch takes
  no optimiser step. Adam is applied to the stacked tensors without ``torch.optim`` (so without
  its ``torch._dynamo`` import): when every client steps at every step, with
  `bayesfl.adam.adam_update_`, the plain path's update, elementwise over the stack (each
  client's rows get exactly the arithmetic of its own Adam); otherwise with a masked Adam that
  skips idle clients (same formula, rounded differently). Both paths give the same parameters
  up to float rounding (the gradients of the vmapped and the plain call round differently).

Both consume each client's ``torch.Generator`` identically (one ``randperm`` per epoch), so a
client's mini-batch order does not depend on which path trained it.
Both apply a `GaussianProx` (the batched path one per client) after every Adam step of
the client, with that client's own second moments and step count.

An *objective* maps a module's output and the labels of a mini-batch to per-sample losses of
shape ``(B,)``; it may close over tensors that are constant during local training (a frozen
global head, global class means, prototypes).

**A loss that becomes non-finite** (NaN or infinite: a learning rate too large for the data,
inputs with extreme values) stops that client's training before the step it would poison: its
parameters stay those of the last finite mini-batch, and the other clients of a batched group
train on unchanged. The client is identified by its generator: inside
`watch_divergence` (what the simulator does) the reason is recorded for the caller, who
decides what becomes of the client's round; elsewhere a `LocalTrainingWarning` says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from bayesfl.adam import Adam, StackedAdam, adam_denominator, client_slices
from bayesfl.errors import ConfigError, LocalTrainingWarning
from bayesfl.stacked_rows import row_views, stack_rows

Objective = Callable[[object, Tensor], Tensor]
"""``objective(model_output, labels) -> per-sample losses (B,)``."""

ParameterFilter = Callable[[str], bool]
"""``trainable(parameter_name) -> bool``: which parameters local training updates."""

Penalty = Callable[[dict[str, Tensor]], Tensor]
"""``penalty(trainable parameters by name) -> scalar`` added to every mini-batch loss (e.g.
FedProx's proximal term); under `train_stacked` it sees one client's parameters."""


@dataclass(frozen=True)
class GaussianProx:
    """A diagonal Gaussian term ``0.5 * sum_r precision_r * (theta_r - mean_r)^2`` of the
    mini-batch loss, applied *exactly* after each Adam step rather than through its gradient.

    ``mean`` and ``precision`` map trainable parameter names to tensors of their shapes;
    ``precision`` is per sample (a prior's precision divided by the client's n, as in a
    batch-mean objective). After Adam's step, each parameter ``theta`` becomes the minimiser
    of ``0.5 * (theta - z)^2 / eta + 0.5 * precision * (theta - mean)^2`` where ``z`` is the
    Adam iterate and ``eta = lr / (sqrt(v_hat) + eps)`` the step size Adam gave that entry
    (its denominator as `bayesfl.adam.adam_update_` computed it, bit for bit):

        theta = (z + eta * precision * mean) / (1 + eta * precision)

    Why: Adam normalises every coordinate's step to about ``lr``. When the Gaussian is stiff
    (a prior std ``1 / sqrt(n * precision)`` at or below ``lr``, e.g. FedSI's prior variance
    1e-4 with Adam at 1e-2), its gradient makes Adam oscillate around the prior mean with an
    amplitude of ``lr`` and ends the round *farther* from the optimum than it started (FedSI on
    MNIST: objective 2.33 -> 3.86, exact MAP 2.26). The proximal step is stable for any
    precision, and its fixed point satisfies ``precision * (theta - mean) = -grad`` — the
    stationarity condition of the full objective (the MAP).
    """

    mean: dict[str, Tensor]
    precision: dict[str, Tensor]

    def apply(self, optimizer: Adam, named: Sequence[tuple[str, Tensor]],
              config: LocalTraining) -> None:
        """The exact proximal step of every parameter in ``named`` after ``optimizer.step()``."""
        beta2 = config.betas[1]
        with torch.no_grad():
            for name, p in named:
                if name not in self.precision:
                    continue
                state = optimizer.state[p]
                denom = adam_denominator(state["exp_avg_sq"],
                                         1 - beta2 ** float(state["step"]), config.eps)
                _proximal_step_(p, denom, config.lr * self.precision[name], self.mean[name])


def _proximal_step_(param: Tensor, denom: Tensor, lr_precision: Tensor,
                    mean: Tensor, active: Tensor | None = None) -> None:
    """`GaussianProx`'s exact step of ``param`` in place, after an Adam step (learning rate
    ``lr``) whose denominator was ``denom = sqrt(v_hat) + eps`` (`bayesfl.adam.adam_update_`'s,
    ``param``'s shape: Adam's step size ``eta = lr / denom``); ``lr_precision`` is ``lr *
    precision``. Four elementwise passes: ``theta = (z + s mean) / (1 + s)``, ``s = eta
    precision``.

    One parameter of one client, or of K clients stacked on a leading axis: every operation is
    elementwise, so each client's rows get the arithmetic of its own step. ``active`` (``(K,
    1, ...)`` bool): the clients that stepped; the others are left exactly as they are (their
    shrink is 0, even where a client that never stepped divides 0 by 0).
    """
    shrink = lr_precision / denom  # eta * precision
    if active is not None:
        shrink.masked_fill_(~active, 0.0)
    param.addcmul_(shrink, mean).div_(shrink.add_(1.0))


@dataclass(frozen=True)
class LocalTraining:
    """Hyperparameters of one client's local training in one round.

    ``epochs`` full passes over the local training set in shuffled mini-batches of
    ``batch_size``; Adam with learning rate ``lr``. ``reset_optimizer_each_epoch`` rebuilds
    Adam at every epoch, as the FedLog reference code does (spec fedlog.md §3.1); otherwise
    the optimiser state lives for the whole round (it never survives across rounds).
    """

    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 10
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    reset_optimizer_each_epoch: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ConfigError(f"local epochs must be >= 0, got {self.epochs}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")


def cross_entropy_per_sample(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-sample cross-entropy (B,) of logits (B, C) against class indices (B,):
    ``-log_softmax(logits)`` at each label.

    The numbers of ``F.cross_entropy(logits, labels, reduction="none")`` bit for bit, and so
    are its gradients (the same log-softmax, then a gather and a negation where ``nll_loss``
    picks and negates; tested with ``torch.equal``, plain and under ``vmap``). Written out
    because ``F.cross_entropy`` under ``torch.func.vmap`` (`train_stacked`) runs
    torch's ``nll_loss`` decomposition, whose shape checks import sympy: 0.6 s on the first
    batched step of every process."""
    return -logits.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _all_parameters(_: str) -> bool:
    return True


# the records of the innermost watch_divergence block: id(generator) -> why training stopped
_DIVERGED: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "bayesfl_diverged", default=None)


@contextlib.contextmanager
def watch_divergence() -> Iterator[dict[int, str]]:
    """Within the block, a client whose training stops on a non-finite loss is recorded, not
    warned about: the dict yielded maps ``id(generator)`` of that client's generator (the one
    its training was given) to the reason, for the caller to act on."""
    records: dict[int, str] = {}
    token = _DIVERGED.set(records)
    try:
        yield records
    finally:
        _DIVERGED.reset(token)


def record_divergence(generator: torch.Generator, reason: str, *, stacklevel: int = 2) -> None:
    """Say that the local computation of the client whose generator of the round is
    ``generator`` went non-finite and stopped, for ``reason`` (what happened and what to do).

    Inside `watch_divergence` (the simulator) the reason is recorded for the caller, who
    undoes the client's round and sends nothing; elsewhere a `LocalTrainingWarning`
    says so (``stacklevel`` counted from the caller of this function). The one guard of every
    local loop: `train_plain`, `train_stacked` and the strategies with their own
    loops (`loss_diverged`)."""
    records = _DIVERGED.get()
    if records is None:
        warnings.warn(reason, LocalTrainingWarning, stacklevel=stacklevel + 1)
    else:
        records.setdefault(id(generator), reason)


def loss_diverged(loss: Tensor, generator: torch.Generator, *, epoch: int, step: int,
                  epochs: int, lr: float) -> bool:
    """Whether the mini-batch ``loss`` is non-finite; if so the stop is recorded or warned
    about (`record_divergence`) and the caller's loop must stop before the step it would
    poison. ``epoch`` and ``step`` count from 0; ``epochs`` and ``lr`` are the loop's, named in
    the reason. Strategies with their own training loops call it on every loss they step on,
    before ``backward``::

        if loss_diverged(loss, generator, epoch=epoch, step=step, epochs=E, lr=lr):
            return  # the parameters stay those of the last finite mini-batch
    """
    if bool(torch.isfinite(loss).all()):
        return False
    _stopped(generator, float(loss.detach().reshape(-1)[0]) if loss.numel() == 1 else
             float("nan"), epoch, step, epochs, lr, stacklevel=3)
    return True


def _stopped(generator: torch.Generator, loss: float, epoch: int, step: int, epochs: int,
             lr: float, stacklevel: int = 2) -> None:
    """Record (inside `watch_divergence`) or warn that a client's training stopped."""
    reason = (f"local training loss became {loss} at epoch {epoch + 1} of {epochs}, "
              f"mini-batch {step + 1}, and training stopped there; lower the learning rate "
              f"(lr {lr:g}) or check the client's inputs for extreme values")
    record_divergence(generator, reason, stacklevel=stacklevel + 1)


def train_plain(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    objective: Objective,
    config: LocalTraining,
    *,
    generator: torch.Generator,
    trainable: ParameterFilter | None = None,
    penalty: Penalty | None = None,
    prox: GaussianProx | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> None:
    """Train ``model`` in place on ``(x (N, ...), y (N,))`` with mini-batch Adam.

    Only parameters selected by ``trainable`` (default: all) are updated; the others are
    frozen for the duration of the call (``requires_grad=False``, so backpropagation stops at
    the first trainable layer). The mini-batch loss is the mean of the objective's per-sample
    losses, plus ``penalty`` of the trainable parameters if given, plus ``prox``'s Gaussian
    term, which is applied exactly after each step (`GaussianProx`). A non-finite loss
    stops the training before its step (module docstring). ``after_epoch(epochs_done)`` is
    called after each complete epoch (early stopping reads the model there).
    """
    trainable = trainable or _all_parameters
    named = list(model.named_parameters())
    params = [p for name, p in named if trainable(name)]
    train_names = [name for name, _ in named if trainable(name)]
    trained = list(zip(train_names, params, strict=True))
    if not params or config.epochs == 0:
        return
    flags = {name: p.requires_grad for name, p in named}
    for name, p in named:
        p.requires_grad_(trainable(name))
    model.train()
    n = x.shape[0]
    optimizer = None
    try:
        for epoch in range(config.epochs):
            if optimizer is None or (config.reset_optimizer_each_epoch and epoch > 0):
                optimizer = Adam(params, lr=config.lr, betas=config.betas, eps=config.eps)
            order = torch.randperm(n, generator=generator).to(x.device)
            for step, start in enumerate(range(0, n, config.batch_size)):
                idx = order[start : start + config.batch_size]
                loss = objective(model(x[idx]), y[idx]).mean()
                if penalty is not None:
                    loss = loss + penalty(dict(zip(train_names, params, strict=True)))
                # its gradient would poison every weight
                if loss_diverged(loss, generator, epoch=epoch, step=step,
                                 epochs=config.epochs, lr=config.lr):
                    return
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if prox is not None:
                    prox.apply(optimizer, trained, config)
            if after_epoch is not None:
                after_epoch(epoch + 1)
    finally:
        for name, p in named:
            p.requires_grad_(flags[name])


def architecture_key(model: nn.Module) -> tuple:
    """A hashable signature of a module's structure: its module types, parameter and buffer
    names, shapes, dtypes and devices.

    Models with equal keys can be trained together by `train_batched`. Cached per module
    object (a model's structure does not change while it trains).
    """
    key = _ARCHITECTURE_KEYS.get(model)
    if key is None:
        modules = tuple((n, type(m).__name__) for n, m in model.named_modules())
        params = tuple((n, tuple(p.shape), p.dtype, p.device)
                       for n, p in model.named_parameters())
        buffers = tuple((n, tuple(b.shape), b.dtype, b.device) for n, b in model.named_buffers())
        key = _ARCHITECTURE_KEYS[model] = (modules, params, buffers)
    return key


_ARCHITECTURE_KEYS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def named_tensors(model: nn.Module, kind: str = "parameters") -> dict[str, Tensor]:
    """``dict(model.named_parameters())`` (``kind="parameters"``) or
    ``dict(model.named_buffers())`` (``kind="buffers"``), read through a per-module cache of
    where each tensor is stored (owning submodule's ``_parameters`` / ``_buffers`` and key).

    Walking the module tree costs ~10 us a call, which adds up over a thousand clients per
    stacking; the cache assumes what `architecture_key` assumes — the module structure
    does not change — while a parameter or buffer *re-assigned* on a submodule is still seen.
    """
    slots = _TENSOR_SLOTS.get(model)
    if slots is None:
        slots = _TENSOR_SLOTS[model] = {
            "parameters": _slots(model, model.named_parameters(), "_parameters"),
            "buffers": _slots(model, model.named_buffers(), "_buffers"),
        }
    return {name: store[key] for name, store, key in slots[kind]}


def _slots(model: nn.Module, named, attribute: str) -> list[tuple[str, dict, str]]:
    out = []
    for name, _ in named:
        path, _, key = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        out.append((name, getattr(owner, attribute), key))
    return out


_TENSOR_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def pad_stack(tensors: Sequence[Tensor]) -> Tensor:
    """Stack tensors with different first dimensions, zero-padding them to the longest.

    Returns shape ``(K, N_max, *rest)``, of the first tensor's dtype and device. Tensors of
    one length are stacked; otherwise their rows are concatenated and written to their
    places with one indexing (not one copy per tensor: the simulator stacks thousands).
    """
    first = tensors[0]
    sizes = [t.shape[0] for t in tensors]
    longest = max(sizes)
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        out = first.new_zeros((len(tensors), longest, *first.shape[1:]))
        for k, t in enumerate(tensors):
            out[k, : t.shape[0]] = t
        return out
    if min(sizes) == longest:
        return torch.stack(list(tensors))
    out = first.new_zeros((len(tensors), longest, *first.shape[1:]))
    counts = torch.tensor(sizes, device=first.device)
    rows = torch.repeat_interleave(torch.arange(len(sizes), device=first.device), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    out[rows, torch.arange(rows.shape[0], device=first.device) - starts] = torch.cat(
        list(tensors))
    return out


def _batch_schedule(
    sizes: Sequence[int], batch_size: int, generators: Sequence[torch.Generator]
) -> tuple[Tensor, Tensor, int]:
    """Per-client shuffled indices padded to a common number of steps.

    Returns ``index (K, steps * batch_size)`` int64, ``mask (K, steps * batch_size)`` float
    (1 for a real sample) and ``steps``.
    """
    steps = max(math.ceil(n / batch_size) for n in sizes)
    width = steps * batch_size
    counts = torch.tensor(list(sizes))
    flat = torch.cat([torch.randperm(n, generator=g)
                      for n, g in zip(sizes, generators, strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    cols = torch.arange(len(flat)) - starts
    index = torch.zeros(len(sizes), width, dtype=torch.int64)
    mask = torch.zeros(len(sizes), width)
    index[rows, cols] = flat
    mask[rows, cols] = 1.0
    return index, mask, steps


def train_batched(
    models: Sequence[nn.Module],
    xs: Sequence[Tensor],
    ys: Sequence[Tensor],
    objective: Objective,
    config: LocalTraining,
    *,
    generators: Sequence[torch.Generator],
    trainable: ParameterFilter | None = None,
    prox: Sequence[GaussianProx] | None = None,
) -> None:
    """Train K models of one architecture in place, each on its own ``(xs[k], ys[k])``.

    Equivalent to calling `train_plain` on every model with its own generator (and its own
    ``prox[k]``) up to float rounding, but computes all K gradients per step with one vmapped
    call (see `train_stacked`, which this calls with the models' own tensors and whose
    results it copies into them).
    """
    if not models:
        return
    if len({architecture_key(m) for m in models}) != 1:
        raise ConfigError("train_batched needs models of one architecture; use train_plain")
    own = [named_tensors(m, "parameters") for m in models]
    trained = [dict(p) for p in own]
    train_stacked(models[0], trained, [named_tensors(m, "buffers") for m in models], xs, ys,
                  objective, config, generators=generators, trainable=trainable, prox=prox)
    with torch.no_grad():
        for before, after in zip(own, trained, strict=True):
            for name, value in after.items():
                if value is not before[name]:
                    before[name].copy_(value)


def train_stacked(
    template: nn.Module,
    parameters: Sequence[dict[str, Tensor]],
    buffers: Sequence[dict[str, Tensor]],
    xs: Sequence[Tensor],
    ys: Sequence[Tensor],
    objective: Objective,
    config: LocalTraining,
    *,
    generators: Sequence[torch.Generator],
    trainable: ParameterFilter | None = None,
    penalty: Penalty | None = None,
    prox: Sequence[GaussianProx] | None = None,
) -> None:
    """Train K clients of one architecture, given as tensors: ``parameters[k]`` and
    ``buffers[k]`` name every parameter and buffer of ``template`` (whose own tensors are not
    used). The trained values replace the trainable entries of the ``parameters[k]`` dicts:
    new tensors, client ``k``'s being row ``k`` of one new stacked tensor per name (views
    sharing its memory, `bayesfl.stacked_rows.row_views`: the next stacking of these
    clients takes them as they lie); the tensors the dicts held are never written, so they
    may be a client state's own. A client whose loss becomes non-finite stops there
    (module docstring): its parameters are no longer updated, while the others train on (the
    masked Adam takes over from the stacked one, same formula).

    The objective must be the same function for every client (constants it closes over are
    shared). Buffers are carried along read-only (no batch-norm statistics updates), except
    for a template with batch-norm running statistics (`has_running_stats`): vmapped
    training would normalise with statistics over the padded rows and drop the running-stat
    updates, so such clients are trained one by one with `train_plain` (same generator
    use, same result as each client alone) and each ``buffers[k]`` entry is *replaced* by the
    client's updated buffer (the dicts are changed, never the tensors they held).

    ``prox``: one `GaussianProx` per client (the same parameter names for all), applied as
    `train_plain` applies it: after each Adam step, to each client that took the step, with
    that client's own second moments and step count (its rows of the stacked Adam state).
    """
    if not parameters:
        return
    if prox is not None and len(prox) != len(parameters):
        raise ConfigError(f"train_stacked needs one prox term per client, got {len(prox)} "
                          f"for {len(parameters)} clients")
    if has_running_stats(template):
        _train_each(template, parameters, buffers, xs, ys, objective, config,
                    generators=generators, trainable=trainable, penalty=penalty, prox=prox)
        return
    trainable = trainable or _all_parameters
    template.train()
    names = [n for n, _ in template.named_parameters()]
    train_names = [n for n in names if trainable(n)]
    if not train_names or config.epochs == 0:
        return
    frozen_names = [n for n in names if n not in train_names]
    per_model = list(parameters)
    with torch.no_grad():
        stacked = _stack_named(per_model, copy=True)  # written in place below
        # leaves of autograd (the gradient below), updated in place under no_grad by Adam
        train_p = {n: stacked[n].requires_grad_() for n in train_names}
        frozen_p = {n: stacked[n] for n in frozen_names}
        stacked_buffers = _stack_named(list(buffers))
        prox_terms = None if prox is None else _stack_prox(prox, train_names, config.lr)
    device = train_p[train_names[0]].device
    X = pad_stack(list(xs))
    Y = pad_stack(list(ys))
    sizes = [int(x.shape[0]) for x in xs]
    rows = torch.arange(len(per_model), device=device)[:, None]

    def client_loss(tp, fp, bufs, xb, yb, mb):
        out = functional_call(template, ({**tp, **fp}, bufs), (xb,))
        loss = (objective(out, yb) * mb).sum() / mb.sum().clamp_min(1.0)
        return loss if penalty is None else loss + penalty(tp)

    losses_of = vmap(client_loss)
    leaves = list(train_p.values())

    def grads_of(*inputs) -> tuple[dict[str, Tensor], Tensor]:
        # Each client's loss depends on its own rows of the stacked parameters only, so the
        # gradient of the summed losses holds every client's gradient in its rows: one
        # backward of the vmapped forward (torch.func.grad would import torch._dynamo, whose
        # compiled-autograd switch it enters: seconds on first use in every process).
        with torch.enable_grad():
            losses = losses_of(*inputs)
            grads = torch.autograd.grad(losses.sum(), leaves)
        return dict(zip(train_names, grads, strict=True)), losses.detach()
    # Every client takes a step at every step iff all have the same number of batches; then
    # one Adam over the stacked tensors is exactly per-client Adam (it is elementwise, with one
    # shared step count). Otherwise a masked Adam skips idle clients.
    uniform = len({math.ceil(n / config.batch_size) for n in sizes}) == 1
    b1, b2 = config.betas
    state: _AdamState | StackedAdam | None = None
    stopped = torch.zeros(len(per_model), dtype=torch.bool, device=device)
    for epoch in range(config.epochs):
        if state is None:
            state = (StackedAdam.zeros(train_p) if uniform
                     else _AdamState.zeros(train_p, len(per_model), device))
        elif config.reset_optimizer_each_epoch:
            _reset(state)  # in place: cheaper than allocating fresh moments every epoch
        index, mask, steps = _batch_schedule(sizes, config.batch_size, generators)
        index, mask = index.to(device), mask.to(device=device, dtype=X.dtype)
        for s in range(steps):
            cols = slice(s * config.batch_size, (s + 1) * config.batch_size)
            ib, mb = index[:, cols], mask[:, cols]
            g, losses = grads_of(train_p, frozen_p, stacked_buffers, X[rows, ib], Y[rows, ib],
                                 mb)
            finite = torch.isfinite(losses)
            if not bool(finite.all()):  # rare: stop those clients, the others go on
                for k in torch.nonzero(~finite & ~stopped).flatten().tolist():
                    _stopped(generators[k], float(losses[k]), epoch, s, config.epochs,
                             config.lr)
                stopped |= ~finite
                if isinstance(state, StackedAdam):  # it cannot leave rows out
                    m, v = state.moments(train_p)
                    state = _AdamState(m, v, torch.full(
                        (len(per_model),), float(state.steps), device=device,
                        dtype=torch.float64))
            if bool(stopped.any()):  # zero rows: 0 * NaN would still poison the moments
                g = {n: v.masked_fill(stopped.view((-1,) + (1,) * (v.dim() - 1)), 0.0)
                     for n, v in g.items()}
            with torch.no_grad():
                if isinstance(state, StackedAdam):  # the moments are dropped after `last`
                    # every client stepped, at the shared count: each slice's prox right
                    # after its Adam update, with the update's own denominator (in cache)
                    state.step(train_p, g, lr=config.lr, b1=b1, b2=b2, eps=config.eps,
                               last=s == steps - 1 and (config.reset_optimizer_each_epoch
                                                        or epoch == config.epochs - 1),
                               after=None if not prox_terms else _prox_after(prox_terms))
                else:
                    active = (mb.sum(dim=1) > 0) & ~stopped
                    state.step(train_p, g, active, lr=config.lr, b1=b1, b2=b2, eps=config.eps)
                    if prox_terms:  # each client at its own count; idle ones untouched
                        _apply_prox(train_p, state.v, 1 - b2 ** state.t, prox_terms, config,
                                    active)
    state = g = None  # the moments and the last gradients: as large as the parameters
    for n in train_names:  # each client's row of the stack (a view: no copy per client)
        for p, value in zip(per_model, row_views(train_p[n]), strict=True):
            p[n] = value


def has_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` has a batch-norm layer that tracks running statistics."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
               for m in module.modules())


def _train_each(
    template: nn.Module,
    parameters: Sequence[dict[str, Tensor]],
    buffers: Sequence[dict[str, Tensor]],
    xs: Sequence[Tensor],
    ys: Sequence[Tensor],
    objective: Objective,
    config: LocalTraining,
    *,
    generators: Sequence[torch.Generator],
    trainable: ParameterFilter | None,
    penalty: Penalty | None,
    prox: Sequence[GaussianProx] | None,
) -> None:
    """`train_stacked` of a template with running statistics: `train_plain` on a
    copy per client; the parameter and buffer entries replaced by the trained ones."""
    model = copy.deepcopy(template)
    proxes = [None] * len(parameters) if prox is None else prox
    for p, b, x, y, g, term in zip(parameters, buffers, xs, ys, generators, proxes,
                                   strict=True):
        model.load_state_dict({**p, **b}, strict=True)
        train_plain(model, x, y, objective, config, generator=g, trainable=trainable,
                    penalty=penalty, prox=term)
        p.update({name: value.detach().clone() for name, value in model.named_parameters()})
        b.update({name: value.detach().clone() for name, value in model.named_buffers()})


def _stack_prox(prox: Sequence[GaussianProx], train_names: Sequence[str], lr: float
                ) -> dict[str, tuple[Tensor, Tensor]]:
    """``{name: (lr * precision (K, ...), mean (K, ...))}``: the clients' prox terms stacked,
    for the trainable parameters they name (`train_plain` skips the others too); the
    product ``lr * precision`` once, not at every step (the same numbers).

    Raises:
        ConfigError: clients whose terms name different trainable parameters.
    """
    names = [n for n in train_names if n in prox[0].precision]
    if any({n for n in train_names if n in p.precision} != set(names) for p in prox):
        raise ConfigError("train_stacked needs prox terms over the same parameters for "
                          "every client")
    precision = _stack_named([{n: p.precision[n] for n in names} for p in prox])
    mean = _stack_named([{n: p.mean[n] for n in names} for p in prox])
    return {n: (lr * precision[n], mean[n]) for n in names}


def _prox_after(terms: dict[str, tuple[Tensor, Tensor]]
                ) -> Callable[[str, slice, Tensor, Tensor], None]:
    """`StackedAdam.step`'s ``after``: `GaussianProx`'s step of the slice ``cut`` of the
    stacked parameter ``name`` (if ``terms``, `_stack_prox`'s, name it) with the Adam
    update's denominator."""
    def after(name: str, cut: slice, param: Tensor, denom: Tensor) -> None:
        if name in terms:
            lr_precision, mean = terms[name]
            _proximal_step_(param, denom, lr_precision[cut], mean[cut])
    return after


def _apply_prox(params: dict[str, Tensor], v: dict[str, Tensor],
                bias_correction2: Tensor, terms: dict[str, tuple[Tensor, Tensor]],
                config: LocalTraining, active: Tensor) -> None:
    """`GaussianProx`'s step of every client row of the stacked ``params`` (K, ...) named
    in ``terms`` (`_stack_prox`), after the masked Adam step (`_AdamState`) that left the
    stacked second moments ``v``: ``bias_correction2`` (K,) float64, ``1 - beta2^t`` at each
    client's own count; ``active`` (K,) bool, the clients that stepped. Each client's
    denominator as `bayesfl.adam.adam_denominator` computes it (its own correction); cache-sized
    slices of whole clients (`bayesfl.adam.client_slices`).
    """
    for n, (lr_precision, mean) in terms.items():
        p = params[n]
        shape = (-1,) + (1,) * (p.dim() - 1)
        root = bias_correction2.sqrt().to(p.dtype).view(shape)
        for cut in client_slices(p):
            denom = (v[n][cut].sqrt() / root[cut]).add_(config.eps)
            _proximal_step_(p[cut], denom, lr_precision[cut], mean[cut], active.view(shape)[cut])


def _reset(state: _AdamState | StackedAdam) -> None:
    """Zero Adam's moments and step counts in place (same as a freshly built optimiser)."""
    if isinstance(state, StackedAdam):
        state.reset()
        return
    for t in [*state.m.values(), *state.v.values()]:
        t.zero_()
    state.t.zero_()


class _AdamState:
    """Adam moments for stacked parameters, one step counter per client."""

    def __init__(self, m: dict[str, Tensor], v: dict[str, Tensor], t: Tensor) -> None:
        self.m, self.v, self.t = m, v, t

    @classmethod
    def zeros(cls, params: dict[str, Tensor], k: int, device: torch.device) -> _AdamState:
        m = {n: torch.zeros_like(p) for n, p in params.items()}
        v = {n: torch.zeros_like(p) for n, p in params.items()}
        return cls(m, v, torch.zeros(k, device=device, dtype=torch.float64))

    def step(
        self,
        params: dict[str, Tensor],
        grads: dict[str, Tensor],
        active: Tensor,
        *,
        lr: float,
        b1: float,
        b2: float,
        eps: float,
    ) -> None:
        """One Adam step (torch.optim.Adam's formula) for the clients where ``active``.

        Updates ``params`` and the moments in place with few passes over memory:
        ``m.lerp_(g, a (1 - b1))`` is ``b1 m + (1 - b1) g`` for an active client (``a = 1``)
        and leaves an inactive one (``a = 0``) unchanged; the per-client step size is folded
        into the denominator, which is infinite for inactive clients (a zero update).
        """
        self.t += active.to(self.t.dtype)
        t = self.t.clamp_min(1.0)  # inactive clients at t = 0 are masked out below
        neg_inv_step = torch.where(active, -(1.0 - b1**t) / lr, torch.inf)
        bias2_sqrt = (1.0 - b2**t).sqrt()
        a = active.to(next(iter(params.values())).dtype)
        for n, p in params.items():
            shape = (-1,) + (1,) * (p.dim() - 1)
            g, m, v = grads[n], self.m[n], self.v[n]
            m.lerp_(g, (a * (1.0 - b1)).view(shape))
            v.lerp_(g * g, (a * (1.0 - b2)).view(shape))
            denom = v.sqrt().div_(bias2_sqrt.to(p.dtype).view(shape)).add_(eps)
            p.addcdiv_(m, denom.mul_(neg_inv_step.to(p.dtype).view(shape)))


@torch.no_grad()
def forward_stacked(
    models: Sequence[nn.Module], xs: Sequence[Tensor], *, chunk: int = 256
) -> list[Tensor]:
    """``[models[k](xs[k]) for k]`` in eval mode for models of one architecture, computed with
    one vmapped ``functional_call`` per ``chunk`` clients (inputs zero-padded to the longest,
    outputs cut back to each client's length). Modules must return a single tensor."""
    out = forward_stacked_concat(models, xs, chunk=chunk)
    return list(out.split([int(x.shape[0]) for x in xs]))


@torch.no_grad()
def forward_stacked_concat(
    models: Sequence[nn.Module], xs: Sequence[Tensor], *, chunk: int = 256
) -> Tensor:
    """``torch.cat([models[k](xs[k]) for k])`` computed as `forward_stacked` does: the
    outputs of all clients, client after client, in one tensor (the padding rows dropped)."""
    keys = {architecture_key(m) for m in models}
    if len(keys) != 1:
        raise ConfigError("forward_stacked needs models of one architecture")
    return forward_stacked_tensors(models[0], [named_tensors(m, "parameters") for m in models],
                                   [named_tensors(m, "buffers") for m in models], xs,
                                   chunk=chunk)


@torch.no_grad()
def forward_stacked_tensors(
    template: nn.Module,
    parameters: Sequence[dict[str, Tensor]],
    buffers: Sequence[dict[str, Tensor]],
    xs: Sequence[Tensor],
    *,
    chunk: int = 256,
) -> Tensor:
    """The outputs of K clients of ``template``'s architecture, given as tensors
    (``parameters[k]``, ``buffers[k]``), on their inputs ``xs[k]``, concatenated client after
    client: one vmapped ``functional_call`` per ``chunk`` clients in eval mode (inputs
    zero-padded to the longest, the padding rows dropped). The module must return one tensor.
    """
    was_training = template.training
    template.eval()
    outs: list[Tensor] = []
    try:
        for start in range(0, len(parameters), chunk):
            inputs = xs[start : start + chunk]
            params = _stack_named(list(parameters[start : start + chunk]))
            bufs = _stack_named(list(buffers[start : start + chunk]))
            padded = pad_stack(list(inputs))
            out = vmap(lambda p, b, x: functional_call(template, (p, b), (x,)))(
                params, bufs, padded)
            sizes = torch.tensor([int(x.shape[0]) for x in inputs], device=out.device)
            real = torch.arange(padded.shape[1], device=out.device) < sizes[:, None]
            outs.append(out[real])
    finally:
        template.train(was_training)
    return torch.cat(outs) if len(outs) != 1 else outs[0]


def _stack_named(named: Sequence[dict[str, Tensor]], *, copy: bool = False
                 ) -> dict[str, Tensor]:
    """``{name: stack of that tensor over the dicts}``, detached: views of the tensors'
    memory where they already lie stacked (`bayesfl.stacked_rows.stack_rows`) unless
    ``copy``, else copies."""
    if not named:
        return {}
    if not torch.is_grad_enabled():  # the stack is not part of any graph: skip the detaches
        return {n: stack_rows([d[n] for d in named], copy=copy) for n in named[0]}
    return {n: stack_rows([d[n].detach() for d in named], copy=copy) for n in named[0]}
