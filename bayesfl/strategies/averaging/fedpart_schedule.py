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
``schedule={"kind": "fedpart", "rounds_per_group": 1, ...}``;
`ParameterAveraging` runs the partial
rounds);
`bayesfl.strategies.averaging.fedpart` has the named strategies.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from bayesfl.errors import ConfigError
from bayesfl.strategies.base import derived_seed

ORDERS = ("seq", "rev", "random", "random-perm")
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
