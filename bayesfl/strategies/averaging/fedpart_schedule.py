"""The FedPart schedule: which layer group each round trains.

The schedule (the [FedPart paper](https://arxiv.org/abs/2410.11559), section 3.2 "Strategy for
Selecting Trainable Layers", and the schedule of its experiments) is a pure function of the round
(and, for random orders, the run's seed), so a resumed run follows it exactly:

* rounds 1..W are FULL (warm-up, ``warmup_rounds`` W, default 5);
* then a sweep of R rounds (``rounds_per_group``, default 2) on each of the G groups, in
  ``order``; every later cycle starts with F FULL rounds (``full_rounds_per_cycle``, default
  5) before its sweep. W = F = 5, R = 2 is the paper's main schedule (ResNet-8: 25-round
  cycles); W = 5, F = 0 its ablation schedule (back-to-back sweeps);
* ``cycles``: the number of cycles (None: repeat until the run ends; a run longer than the
  cycles is a ConfigError);
* ``order``: ``"seq"`` (shallow to deep, the paper's default), ``"rev"`` (deep to shallow),
  ``"random"`` (a uniformly drawn group every round, the paper's ablation) or
  ``"random-perm"`` (a random permutation of the groups per sweep, R rounds each).

Any parameter-averaging strategy takes it with the option ``schedule="fedpart"`` (or
``schedule={"kind": "fedpart", "rounds_per_group": 1, ...}``); the strategy holds a
`PartialTraining` that answers what each round trains, uploads and broadcasts, and a
`LocalFlops` that counts the local training's analytic FLOPs;
`bayesfl.strategies.averaging.fedpart` has the named strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from bayesfl.errors import ConfigError
from bayesfl.flops import step_flops
from bayesfl.layer_groups import LayerGroup, describe_groups, layer_groups
from bayesfl.strategies.base import ClientState, StrategyContext, derived_seed
from bayesfl.training import LocalTraining, ParameterFilter

Phases = list[tuple[ParameterFilter, LocalTraining]]

ORDERS = ("seq", "rev", "random", "random-perm")
DOWNLINKS = ("changed", "full")
SYNCED = "sync.round"
"""Client-state key of a scheduled strategy: the round whose broadcast the client last
received (a ``downlink="changed"`` broadcast is complete only for a client synced the round
before)."""
FULL = -1
"""`FedPartSchedule.group_at` of a FULL (whole-network) round."""
_RANDOM_KEY = 1_000_015


@dataclass(frozen=True)
class FedPartSchedule:
    """Round -> layer group map of FedPart (module docstring).

    Attributes:
        num_groups: G.
        rounds_per_group: R >= 1.
        full_rounds_per_cycle: F >= 0, at the start of every cycle after the first.
        warmup_rounds: W >= 0, the FULL rounds of the first cycle.
        cycles: C >= 1, or None for as many as the run has rounds.
        order: one of `ORDERS`.
        seed: the run's seed (random orders only).
    """

    num_groups: int
    rounds_per_group: int = 2
    full_rounds_per_cycle: int = 5
    warmup_rounds: int = 5
    cycles: int | None = None
    order: str = "seq"
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("num_groups", 1), ("rounds_per_group", 1),
                          ("full_rounds_per_cycle", 0), ("warmup_rounds", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"fedpart {name} must be an integer >= {low}, got {value!r}")
        if self.cycles is not None and (isinstance(self.cycles, bool)
                                        or not isinstance(self.cycles, int) or self.cycles < 1):
            raise ConfigError(f"fedpart cycles must be an integer >= 1 or None, got "
                              f"{self.cycles!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"fedpart order must be one of {ORDERS}, got {self.order!r}")

    @property
    def sweep_rounds(self) -> int:
        """P = G R: the partial rounds of one cycle."""
        return self.num_groups * self.rounds_per_group

    @property
    def total_rounds(self) -> int | None:
        """Rounds of ``cycles`` cycles: W + P + (C - 1)(F + P); None without ``cycles``."""
        if self.cycles is None:
            return None
        return (self.warmup_rounds + self.sweep_rounds
                + (self.cycles - 1) * (self.full_rounds_per_cycle + self.sweep_rounds))

    def position(self, round: int) -> tuple[int, int | None]:
        """``(cycle, j)`` of training round ``round`` (1-based): the 0-based cycle and the
        0-based sweep slot (None in a FULL round)."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 1:
            raise ConfigError(f"fedpart rounds are 1-based integers, got {round!r}")
        total = self.total_rounds
        if total is not None and round > total:
            raise ConfigError(f"round {round} is past the schedule's {self.cycles} cycle(s) "
                              f"({total} rounds): raise cycles or run fewer rounds")
        t = round - 1
        if t < self.warmup_rounds:
            return 0, None
        u = t - self.warmup_rounds
        if u < self.sweep_rounds:
            return 0, u // self.rounds_per_group
        u -= self.sweep_rounds
        length = self.full_rounds_per_cycle + self.sweep_rounds
        cycle, s = 1 + u // length, u % length
        if s < self.full_rounds_per_cycle:
            return cycle, None
        return cycle, (s - self.full_rounds_per_cycle) // self.rounds_per_group

    def group_at(self, round: int) -> int:
        """The 0-based group trained in ``round`` (1-based), or `FULL`."""
        cycle, j = self.position(round)
        if j is None:
            return FULL
        g = self.num_groups
        if self.order == "seq":
            return j
        if self.order == "rev":
            return g - 1 - j
        if self.order == "random":
            gen = torch.Generator().manual_seed(derived_seed(self.seed, _RANDOM_KEY, round))
            return int(torch.randint(g, (1,), generator=gen).item())
        gen = torch.Generator().manual_seed(derived_seed(self.seed, _RANDOM_KEY, -1, cycle))
        return int(torch.randperm(g, generator=gen)[j].item())

    def upload_fraction(self) -> float:
        """(F + R) / (F + R G): one cycle's uplink relative to full rounds when the groups
        partition the model (the paper's Eq. 5 leaves the FULL rounds out), for W = F."""
        f, r = self.full_rounds_per_cycle, self.rounds_per_group
        return (f + r) / (f + r * self.num_groups)

    def describe(self, rounds: int, group_names: list[str] | None = None) -> str:
        """The schedule of a run of ``rounds`` rounds as text, one line per block."""
        lines = [f"FedPart schedule: G={self.num_groups} groups, R={self.rounds_per_group}, "
                 f"F={self.full_rounds_per_cycle}, warm-up={self.warmup_rounds}, "
                 f"cycles={self.cycles}, order={self.order}"]
        groups = [self.group_at(r) for r in range(1, rounds + 1)]
        start = 1
        for r in range(1, rounds + 1):
            if r < rounds and groups[r] == groups[r - 1]:
                continue
            g = groups[r - 1]
            label = "FULL" if g == FULL else f"group {g + 1}" + (
                f" ({group_names[g]})" if group_names else "")
            span = f"{start}" if start == r else f"{start}-{r}"
            lines.append(f"  rounds {span}: {label}")
            start = r + 1
        return "\n".join(lines)


SCHEDULE_OPTIONS = tuple(f.name for f in fields(FedPartSchedule)
                         if f.name not in ("num_groups", "seed"))
"""The options of a FedPart schedule (besides G, which the network gives, and the seed)."""


def schedule_from_option(value: Any) -> dict[str, Any] | None:
    """The ``schedule`` strategy option as ``{"kind": "fedpart", **options}`` or None.

    Raises:
        ConfigError: an unknown kind or option.
    """
    if value is None:
        return None
    spec = {"kind": value} if isinstance(value, str) else value
    if not isinstance(spec, dict) or spec.get("kind") != "fedpart":
        raise ConfigError(f"schedule must be None, 'fedpart' or a dict with kind 'fedpart' "
                          f"and options {SCHEDULE_OPTIONS} (plus group_prefixes, "
                          f"min_group_size, downlink), got {value!r}")
    unknown = sorted(set(spec) - {"kind", *SCHEDULE_OPTIONS, "group_prefixes",
                                  "min_group_size", "downlink"})
    if unknown:
        raise ConfigError(f"unknown fedpart schedule option(s) {unknown}; valid: "
                          f"{', '.join(SCHEDULE_OPTIONS)}, group_prefixes, min_group_size, "
                          f"downlink")
    return dict(spec)


class PartialTraining:
    """FedPart's partial rounds for a parameter-averaging strategy (its ``schedule`` option).

    Answers, for a client network of body spec ``body``, what round ``round`` trains, uploads
    (`round_names`) and broadcasts (`broadcast_names`), and the strategy's training phases
    restricted to that (`phases`); without a schedule every round is FULL. It holds the
    validated option and pure functions of the run's configuration (the strategy's shared names,
    statistics, template networks and phases), never client or server state: both halves ask it.

    Args:
        strategy: the strategy's name (for messages).
        schedule: the ``schedule`` option (`schedule_from_option`).
        context: the run configuration (bodies, rounds, seed).
        shared: body -> the shared parameter names of its network.
        statistics: body -> the shared running-statistic names.
        template: body -> a network of that body (structure only).
        phases: shared names -> the strategy's local training phases.

    Raises:
        ConfigError: an unknown schedule option, a bad ``downlink``, or a run longer than the
            schedule's cycles.
    """

    def __init__(
        self,
        strategy: str,
        schedule: Any,
        context: StrategyContext,
        *,
        shared: Callable[[str], frozenset[str]],
        statistics: Callable[[str], frozenset[str]],
        template: Callable[[str], nn.Module],
        phases: Callable[[frozenset[str]], Phases],
    ) -> None:
        self.strategy, self.context = strategy, context
        self.options = schedule_from_option(schedule)
        options = self.options or {}
        self.downlink = options.get("downlink", "changed")
        if self.downlink not in DOWNLINKS:
            raise ConfigError(f"fedpart downlink must be one of {DOWNLINKS}, got "
                              f"{self.downlink!r}")
        self._shared, self._statistics = shared, statistics
        self._template, self._phases = template, phases
        self._groups: dict[str, list[LayerGroup]] = {}
        if self.options is not None:  # fail at construction on bad options
            self.schedule()

    @property
    def active(self) -> bool:
        """Whether the run has a schedule (otherwise every round is FULL)."""
        return self.options is not None

    def groups(self, body: str) -> list[LayerGroup]:
        """The layer groups of the shared parameters (and statistics) of body ``body``."""
        if body not in self._groups:
            options = self.options or {}
            shared, stats = self._shared(body), self._statistics(body)
            params = dict(self._template(body).named_parameters())
            out = []
            for g in layer_groups(self._template(body),
                                  prefixes=options.get("group_prefixes"),
                                  min_group_size=options.get("min_group_size", 0)):
                kept = tuple(n for n in g.parameters if n in shared)
                if kept:
                    out.append(LayerGroup(g.name, kept, tuple(b for b in g.buffers
                                                             if b in stats),
                                          sum(params[n].numel() for n in kept), g.kind))
            self._groups[body] = out
        return self._groups[body]

    def schedule(self) -> FedPartSchedule | None:
        """The run's schedule (its G from the first body's groups), or None."""
        if self.options is None:
            return None
        options = {k: v for k, v in self.options.items() if k in SCHEDULE_OPTIONS}
        schedule = FedPartSchedule(len(self.groups(self.context.bodies[0])),
                                   seed=self.context.seed, **options)
        if schedule.total_rounds is not None and self.context.rounds > schedule.total_rounds:
            raise ConfigError(f"{self.strategy}: {self.context.rounds} rounds exceed the "
                              f"schedule's {schedule.cycles} cycle(s) of "
                              f"{schedule.total_rounds} rounds")
        return schedule

    def group_at(self, round: int) -> int:
        """The 0-based layer group trained in ``round``, or ``FULL`` (every round without a
        schedule; round 0 and earlier too)."""
        schedule = self.schedule()
        return FULL if schedule is None or round < 1 else schedule.group_at(round)

    def everything(self, body: str) -> frozenset[str]:
        """Every shared parameter and statistic of body ``body`` (a FULL round's names)."""
        return self._shared(body) | self._statistics(body)

    def round_names(self, body: str, round: int) -> frozenset[str]:
        """What a client of body ``body`` trains and uploads in ``round``: the shared
        parameters and statistics of the round's group (all of them in a FULL round)."""
        g = self.group_at(round)
        if g == FULL:
            return self.everything(body)
        return frozenset(self.groups(body)[g].names)

    def broadcast_names(self, body: str, round: int) -> frozenset[str]:
        """What the broadcast of ``round`` carries: everything shared, or with
        ``downlink="changed"`` in a partial round after a partial round, the groups of this
        round and the one before (the clients hold the latter only as their local values)."""
        if self.downlink == "full" or round <= 1 or FULL in (self.group_at(round),
                                                             self.group_at(round - 1)):
            return self.everything(body)
        return self.round_names(body, round) | self.round_names(body, round - 1)

    def fit_names(self, client_id: int, state: ClientState, body: str,
                  round: int) -> frozenset[str]:
        """The names a fit broadcast of ``round`` must carry; ConfigError if a
        ``downlink="changed"`` broadcast cannot complete this client's model (it missed the
        previous round: its state's `SYNCED` round)."""
        expected = self.broadcast_names(body, round)
        synced = int(state[SYNCED].item()) if SYNCED in state else None
        if expected != self.everything(body) and synced != round - 1:
            raise ConfigError(f"{self.strategy} with downlink='changed' needs every client in "
                              f"every round: client {client_id} last synced in round "
                              f"{synced}, this is round {round}; use downlink='full' with "
                              f"partial participation")
        return expected

    def synced(self, state: ClientState, round: int) -> ClientState:
        """``state`` marked as synced in ``round`` (under a schedule; unchanged without)."""
        if self.options is not None:
            state[SYNCED] = torch.tensor([round], dtype=torch.int64)
        return state

    def phases(self, body: str, round: int) -> Phases:
        """The strategy's phases restricted to the round's group: a shared parameter trains
        only if the round sends it (personal parameters as the strategy says)."""
        shared = self._shared(body)
        active = self.round_names(body, round)
        out = []
        for trainable, phase in self._phases(shared):
            def allowed(name: str, trainable: ParameterFilter = trainable) -> bool:
                return trainable(name) and (name in active or name not in shared)
            out.append((allowed, phase))
        return out

    def describe(self) -> str | None:
        """The schedule of the run and the layer groups, as text (None without a schedule)."""
        schedule = self.schedule()
        if schedule is None:
            return None
        body = self.context.bodies[0]
        groups = self.groups(body)
        return (f"{self.strategy}: layer groups of {body!r} (shared "
                f"parameters)\n{describe_groups(groups)}\n"
                + schedule.describe(self.context.rounds, [g.name for g in groups]))


class LocalFlops:
    """The analytic FLOPs of local training (`bayesfl.flops`: forward over every layer,
    backward from the output down to the first trainable one), memoised per body and trainable
    set. The server half's (its round metrics); it holds no client state.

    Args:
        template: body -> a network of that body (structure only).
        context: the run configuration (its input shape).
    """

    def __init__(self, template: Callable[[str], nn.Module], context: StrategyContext) -> None:
        self._template, self.context = template, context
        self._steps: dict[tuple[str, frozenset[str]], int] = {}

    def step(self, body: str, trainable: Callable[[str], bool]) -> int:
        """FLOPs of one sample's training step of body ``body`` with ``trainable`` names."""
        names = frozenset(n for n, _ in self._template(body).named_parameters()
                          if trainable(n))
        key = (body, names)
        if key not in self._steps:
            self._steps[key] = step_flops(self._template(body), self.context.input_shape,
                                          names.__contains__).total
        return self._steps[key]

    def local(self, body: str, phases: Sequence[tuple[ParameterFilter, LocalTraining]],
              samples: int) -> int:
        """Sum over ``phases`` of samples x epochs x FLOPs per sample of the phase's step."""
        return sum(samples * phase.epochs * self.step(body, trainable)
                   for trainable, phase in phases)
