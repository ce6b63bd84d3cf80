"""Layer groups: the units FedPart trains and sends one at a time (spec fedpart.md §1.2, §6.2).

Rule (the paper's Appendix A and its code): **one group = one weight-bearing layer (Conv,
Linear, Embedding, MultiheadAttention, ...) plus the affine parameters of the normalisation
layer registered directly after it**. A residual shortcut (1x1 conv + BN) is a group of its
own, in the place its block registers it (after the main path in
`ResNet8`, as in Fling), and a classifier network's ``head`` is the
last group. Groups follow module registration order, which is the forward order for the
bodies of `bayesfl.bodies` wrapped in
`ClassifierNet`: ``resnet8`` with its head gives the
paper's ten groups. A normalisation layer's running statistics (``running_mean``,
``running_var``) belong to its group as buffers; its ``num_batches_tracked`` counter does not
(it only matters with ``momentum=None`` and is never sent).

Overrides: ``prefixes`` lists the groups by parameter-name prefix instead (every parameter
in exactly one group), and ``min_group_size`` merges a group smaller than that into the next
one (the last into the one before), since group sizes can differ by 250x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from bayesfl.errors import ConfigError

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm)
"""Normalisation layers: they join the group of the weight layer before them."""

STATISTICS = ("running_mean", "running_var")
"""Buffer names of a normalisation layer that belong to its group."""


@dataclass(frozen=True)
class LayerGroup:
    """One layer group of a network.

    Attributes:
        name: the module name of its weight layer (or the first prefix), e.g. ``body.pre_conv``.
        parameters: its parameter names, in registration order.
        buffers: the running statistics of its normalisation layers.
        numel: the number of parameter elements (what one upload of it carries).
        kind: ``"head"`` for the classifier (names under ``head.``), else ``"body"``.
    """

    name: str
    parameters: tuple[str, ...]
    buffers: tuple[str, ...]
    numel: int
    kind: str

    @property
    def names(self) -> tuple[str, ...]:
        """Parameters then buffers: everything of the group that travels."""
        return self.parameters + self.buffers


def is_statistic(name: str) -> bool:
    """Whether a state name is a normalisation layer's running statistic."""
    return name.rsplit(".", 1)[-1] in STATISTICS


def layer_groups(
    model: nn.Module,
    *,
    prefixes: Sequence[str] | None = None,
    min_group_size: int = 0,
) -> list[LayerGroup]:
    """The ordered layer groups of ``model`` (module docstring), shallow to deep.

    Args:
        model: the network (parameters are read, never changed).
        prefixes: manual groups by parameter-name prefix, in order; None: the automatic rule.
        min_group_size: merge groups with fewer parameter elements than this into the next.

    Raises:
        ConfigError: prefixes that miss a parameter, match one twice or match nothing.
    """
    raw = _by_prefix(model, prefixes) if prefixes is not None else _automatic(model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    groups = [LayerGroup(name, tuple(ps), tuple(bs), sum(numel[p] for p in ps),
                         "head" if all(p.startswith("head.") for p in ps) else "body")
              for name, ps, bs in raw]
    return _merge_small(groups, min_group_size)


def group_sizes(model: nn.Module, **options) -> list[tuple[str, int]]:
    """``[(group name, parameter elements)]`` of `layer_groups`."""
    return [(g.name, g.numel) for g in layer_groups(model, **options)]


def describe_groups(groups: Sequence[LayerGroup]) -> str:
    """A table of the groups: index, name, parameter count, share of the model."""
    total = sum(g.numel for g in groups) or 1
    lines = [f"  {i + 1:>3}  {g.name:<32} {g.numel:>10,d}  {100 * g.numel / total:5.1f}%"
             for i, g in enumerate(groups)]
    return "\n".join(lines)


def _own(module: nn.Module, prefix: str, kind: str) -> list[str]:
    items = module.named_parameters(recurse=False) if kind == "p" else \
        module.named_buffers(recurse=False)
    return [f"{prefix}.{n}" if prefix else n for n, _ in items]


def _automatic(model: nn.Module) -> list[tuple[str, list[str], list[str]]]:
    groups: list[tuple[str, list[str], list[str]]] = []
    previous_was_weight_layer = False
    for prefix, module in model.named_modules():
        params = _own(module, prefix, "p")
        if not params:
            continue
        stats = [b for b in _own(module, prefix, "b") if is_statistic(b)]
        if isinstance(module, NORM_TYPES) and previous_was_weight_layer:
            groups[-1][1].extend(params)
            groups[-1][2].extend(stats)
            previous_was_weight_layer = False
            continue
        groups.append((prefix, list(params), stats))
        previous_was_weight_layer = not isinstance(module, NORM_TYPES)
    return groups


def _by_prefix(
    model: nn.Module, prefixes: Sequence[str]
) -> list[tuple[str, list[str], list[str]]]:
    if isinstance(prefixes, str) or not prefixes \
            or not all(isinstance(p, str) and p for p in prefixes):
        raise ConfigError(f"layer-group prefixes must be a non-empty list of names, got "
                          f"{prefixes!r}")
    params = [n for n, _ in model.named_parameters()]
    stats = [n for n, _ in model.named_buffers() if is_statistic(n)]

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    groups = [(p, [n for n in params if under(n, p)], [n for n in stats if under(n, p)])
              for p in prefixes]
    counts = {n: sum(under(n, p) for p in prefixes) for n in params}
    missed = [n for n, c in counts.items() if c == 0]
    twice = [n for n, c in counts.items() if c > 1]
    empty = [p for p, ps, _ in groups if not ps]
    if missed or twice or empty:
        raise ConfigError(f"layer-group prefixes must put every parameter in exactly one group: "
                          f"missed {missed[:4]}, in several {twice[:4]}, empty prefixes "
                          f"{empty[:4]}")
    return groups


def _merge_small(groups: list[LayerGroup], min_size: int) -> list[LayerGroup]:
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ConfigError(f"min_group_size must be an integer >= 0, got {min_size!r}")
    out: list[LayerGroup] = []
    pending: list[LayerGroup] = []
    for g in groups:
        pending.append(g)
        if sum(p.numel for p in pending) >= min_size:
            out.append(_join(pending))
            pending = []
    if pending:
        out = [*out[:-1], _join(out[-1:] + pending)]
    return out


def _join(parts: Sequence[LayerGroup]) -> LayerGroup:
    if len(parts) == 1:
        return parts[0]
    return LayerGroup("+".join(p.name for p in parts),
                      tuple(n for p in parts for n in p.parameters),
                      tuple(n for p in parts for n in p.buffers),
                      sum(p.numel for p in parts),
                      "head" if all(p.kind == "head" for p in parts) else "body")
