"""FedPart (Wang et al., NeurIPS 2024, "Why Go Full? Elevating Federated Learning Through
Partial Network Updates", [arXiv 2410.11559](https://arxiv.org/abs/2410.11559)): each round trains
and sends one layer group (`bayesfl.layer_groups`) while the rest of the network stays frozen
at the global values, following the schedule of `bayesfl.strategies.averaging.fedpart_schedule`
(warm-up FULL rounds, then shallow-to-deep sweeps of R rounds per group, F FULL rounds at the start
of each later cycle).

Two registry entries carry the schedule by name with flat options: ``fedpart`` (FedAvg +
FedPart) and ``fedprox-part`` (FedProx + FedPart); any other parameter-averaging strategy takes
it with its ``schedule`` option. What a partial round does is the parameter-averaging
machinery's
(`ParameterAveraging`): only the
active group is broadcast (with the group of the round before, which the clients hold only as
their local values), trained, uploaded and averaged; frozen parameters have
``requires_grad=False``, so backpropagation stops at the first trainable group, and stay
bit-identical; BatchNorm running statistics follow the ``bn_stats`` option (default
``"aggregate"``: the trained group's statistics are uploaded and averaged, the frozen groups'
are restored after local training, so the evaluated global model has coherent statistics).

Options: the schedule's (R rounds per group, F FULL rounds per cycle, the warm-up, the order,
the groups, what the downlink carries), declared with their meanings in ``_PartMixin.OPTIONS``
(``bayesfl strategies fedpart``).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from bayesfl.errors import ConfigError
from bayesfl.strategies.averaging.fedavg import FedAvg
from bayesfl.strategies.averaging.fedpart_schedule import DOWNLINKS, ORDERS
from bayesfl.strategies.averaging.fedprox import FedProx
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.registry import Option, register_strategy


class _PartMixin:
    """Flat FedPart options turned into the ``schedule`` option of a parameter-averaging
    strategy."""

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("rounds_per_group", int, 2,
               "R, rounds each layer group trains in a sweep (2)."),
        Option("full_rounds_per_cycle", int, 5,
               "F, FULL rounds (every layer) at the start of each cycle after the first (5)."),
        Option("warmup_rounds", int, 5,
               "FULL rounds before the first sweep (5)."),
        Option("cycles", int, None,
               "how many cycles of sweeps; None: until the run ends."),
        Option("order", str, "seq",
               "the order of the groups in a sweep: `seq` (shallow to deep), `rev`, `random` or "
               "`random-perm`.",
               choices=ORDERS),
        Option("group_prefixes", list, None,
               "manual layer groups, as parameter-name prefixes; None: the groups of "
               "`bayesfl.layer_groups`."),
        Option("min_group_size", int, 0,
               "merge groups smaller than this many parameters into their neighbour (0: none "
               "merged)."),
        Option("downlink", str, "changed",
               "`\"changed\"`: broadcast the groups changed since the previous round (exact "
               "when every client takes part in every round); `\"full\"`: the whole model every "
               "round.",
               choices=DOWNLINKS),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        rounds_per_group: int = 2,
        full_rounds_per_cycle: int = 5,
        warmup_rounds: int = 5,
        cycles: int | None = None,
        order: str = "seq",
        group_prefixes: list[str] | None = None,
        min_group_size: int = 0,
        downlink: str = "changed",
        **options: Any,
    ) -> None:
        if "schedule" in options:
            raise ConfigError(f"{type(self).name} sets its own schedule; give its options "  # type: ignore[attr-defined]
                              f"({', '.join(part_options())}) directly")
        schedule = {"kind": "fedpart", "rounds_per_group": rounds_per_group,
                    "full_rounds_per_cycle": full_rounds_per_cycle,
                    "warmup_rounds": warmup_rounds, "cycles": cycles, "order": order,
                    "group_prefixes": group_prefixes, "min_group_size": min_group_size,
                    "downlink": downlink}
        super().__init__(context, schedule=schedule, **options)  # type: ignore[call-arg]


def part_options() -> tuple[str, ...]:
    """The FedPart options, in their declared order: the keyword-only parameters of
    `_PartMixin` (so a refusal that lists them cannot fall behind a new one)."""
    return tuple(p.name for p in inspect.signature(_PartMixin.__init__).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY)


@register_strategy("fedpart",
                   broadcast="the round's active layer group (all layers in full rounds), plus "
                             "groups changed since the previous round",
                   upload="that group only (the schedule of round r), `num_samples`",
                   aggregate="average of that group (the schedule: "
                             "`averaging/fedpart_schedule.py`)")
class FedPart(_PartMixin, FedAvg):
    """FedAvg with the FedPart schedule (module docstring)."""



@register_strategy("fedprox-part",
                   broadcast="the round's active layer group (all layers in full rounds), plus "
                             "groups changed since the previous round",
                   upload="that group only (the schedule of round r), `num_samples`",
                   aggregate="average of that group (the schedule: "
                             "`averaging/fedpart_schedule.py`)")
class FedProxPart(_PartMixin, FedProx):
    """FedProx with the FedPart schedule (module docstring)."""

