"""Federated deep ensembles: M independently seeded runs of one method, predictive averaged.

The standard uncertainty anchor (Lakshminarayanan et al., 2017) in its federated form: M runs
that hold the **same clients** (the same data rows, partition, train/test split, ``calibrate``
hold-out and novel clients) and differ only in the model's randomness (initialisation, batch
order, client sampling, posterior draws). The run setting ``data_seed`` makes that possible:
runs with one ``data_seed`` and different ``seed`` are such members
([`SimulationConfig`][bayesfl.config.SimulationConfig]).

* `simulate_ensemble` runs M members (``simulate(**settings)`` with member seeds derived
  from ``seed``, ``data_seed`` fixed) and returns a [`DeepEnsemble`][bayesfl.ensemble.DeepEnsemble];
* [`DeepEnsemble`][bayesfl.ensemble.DeepEnsemble] takes M finished runs (what `bayesfl.simulate` or
  [`bayesfl.load_run`][bayesfl.load_run] return; `DeepEnsemble.load` reads run directories), checks
  that they hold the same clients (else a [`ConfigError`][bayesfl.errors.ConfigError] that says what
  differs) and predicts for client k with the mean of the members' headline predictives
  (`DeepEnsemble.predict_proba`). The members' probabilities are its posterior draws
  (`DeepEnsemble.member_proba`, one draw per member): their mutual information
  (expected-entropy gap) is the ensemble's epistemic score.
* [`bayesfl.evaluate_shift`][bayesfl.evaluate_shift] takes an ensemble as it takes a run (a
  `ShiftSubject`): the ``predictive`` rows are the ensemble's
  mean; an ensemble has **no plug-in row** (no single model stands beside it; evaluate a member
  for that); the ``mutual_information`` OOD score takes the M members as the draws (whatever
  ``posterior_samples`` > 0 asks).

Federated cost: M times one run's (communication and local work); each client holds M models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bayesfl.errors import ConfigError
from bayesfl.simulate import SimulationResult, simulate
from bayesfl.strategies.base import PREDICTIVE, derived_seed

MEMBER_SEED_KEY = 0xE5E
"""The derived-seed word of the members' seeds (`member_seeds`)."""

DATA_FIELDS = ("dataset", "dataset_options", "clients", "partition", "test_fraction",
               "novel_fraction", "calibrate")
"""The configuration fields (besides the data seed in force) that decide a run's clients:
members must agree on all of them."""


def member_seeds(seed: int, members: int) -> list[int]:
    """The seeds of an ensemble's ``members`` runs: ``seed`` itself for member 0 (so member 0
    is the single run ``simulate(seed=seed)``), ``derived_seed(seed, MEMBER_SEED_KEY, m)`` for
    member ``m >= 1`` (hashed: the members of seeds 0 and 1 do not overlap, as ``seed + m``
    would)."""
    return [int(seed)] + [derived_seed(int(seed), MEMBER_SEED_KEY, m) for m in range(1, members)]


class DeepEnsemble:
    """M finished runs on the same clients, predicting with their mean (module docstring).

    Args:
        runs: at least two runs (`bayesfl.simulate` results or
            [`bayesfl.load_run`][bayesfl.load_run] results) of the same data: the same data set (its
            recorded identity), data seed in force (``data_seed``, or ``seed`` where unset),
            number of clients, partition, test fraction, novel clients and ``calibrate``
            hold-out. Their strategies and bodies may differ (a mixed ensemble); two runs of
            exactly the same configuration are one model twice and are refused.

    Attributes:
        members: the runs, in the order given.
        config: the first member's configuration (the data are rebuilt from it; its
            ``n_bins`` is the evaluation's default).
        novel: the novel clients' ids (shared).
        run_dir: always None (each member has its own).

    Raises:
        ConfigError: fewer than two runs, something that is not a run, runs that do not hold
            the same clients (the message names the member and what differs), or a run given
            twice.
    """

    run_dir = None

    def __init__(self, runs: Sequence[SimulationResult]) -> None:
        runs = list(runs) if not isinstance(runs, SimulationResult) else [runs]
        for m, run in enumerate(runs):
            if not isinstance(run, SimulationResult):
                raise ConfigError(f"ensemble member {m} is a {type(run).__name__}, not a run: "
                                  "give what bayesfl.simulate or bayesfl.load_run return")
        if len(runs) < 2:
            raise ConfigError(f"a deep ensemble needs at least 2 runs, got {len(runs)}; run "
                              "more members (bayesfl.simulate_ensemble(members=5, ...))")
        first = runs[0]
        for m, run in enumerate(runs[1:], start=1):
            differences = _data_differences(first, run)
            if differences:
                raise ConfigError(
                    f"ensemble member {m} does not hold the same clients as member 0: "
                    f"{'; '.join(differences)}. Members must share the data and differ only in "
                    "seed: run them with one data_seed (bayesfl.simulate_ensemble does)")
        configs = [run.config.to_dict() for run in runs]
        for m, config in enumerate(configs):
            if config in configs[:m]:
                raise ConfigError(
                    f"ensemble members {configs.index(config)} and {m} are the same run (the "
                    f"same configuration and seed {runs[m].config.seed}): a second copy adds "
                    "nothing; give each member its own seed")
        self.members: tuple[SimulationResult, ...] = tuple(runs)
        self.config = first.config
        self.novel: tuple[int, ...] = tuple(int(k) for k in first.novel)

    @classmethod
    def load(cls, run_dirs: Sequence[str | Path], *, device: str = "cpu") -> DeepEnsemble:
        """The ensemble of the finished runs in ``run_dirs`` (`bayesfl.load_run` each).

        Raises:
            CheckpointError: a directory without a finished run.
            ConfigError: as the constructor.
        """
        from bayesfl.loaded_run import load_run

        return cls([load_run(d, device=device) for d in run_dirs])

    # ---- what it is -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return (f"DeepEnsemble({self.label}, {len(self)} members, seeds "
                f"{[r.config.seed for r in self.members]}, data_seed "
                f"{self.config.data_rng_seed})")

    @property
    def seeds(self) -> list[int]:
        """The members' seeds."""
        return [run.config.seed for run in self.members]

    @property
    def num_clients(self) -> int:
        return len(self.members[0].clients)

    @property
    def label(self) -> str:
        """``"ensemble of M STRATEGY"`` (the strategies joined with ``+`` when they differ)."""
        names = list(dict.fromkeys(run.config.strategy for run in self.members))
        return f"ensemble of {len(self)} {'+'.join(names)}"

    @property
    def summary(self) -> dict[str, Any]:
        """What the ensemble is: ``data`` (the data's identity the members recorded),
        ``members``, ``seeds``, ``data_seed`` (in force), ``strategies``, and the members'
        communication summed (``bytes_up``, ``bytes_down``: M runs' worth)."""
        summaries = [run.summary for run in self.members]
        return {
            "data": summaries[0].get("data"),
            "members": len(self), "seeds": self.seeds,
            "data_seed": self.config.data_rng_seed,
            "strategies": [run.config.strategy for run in self.members],
            **{key: int(sum(s.get(key, 0) for s in summaries))
               for key in ("bytes_up", "bytes_down")},
        }

    # ---- predictions ------------------------------------------------------------------------
    def member_proba(self, client_id: int, x: Any) -> Tensor:
        """The members' headline probabilities of client ``client_id`` for inputs ``x``
        (B, ...): (M, B, C) float64, member order. These are the ensemble's posterior draws
        (one per member).

        Raises:
            ConfigError: ``client_id`` is not a client.
            DataError: ``x`` is not a finite batch shaped like the client's inputs.
        """
        return torch.stack([run.predict_proba(client_id, x).to(torch.float64).cpu()
                            for run in self.members])

    def predict_proba(self, client_id: int, x: Any) -> Tensor:
        """Client ``client_id``'s ensemble predictive for inputs ``x`` (B, ...): the mean of
        the members' headline probabilities, (B, C) float64 (on the CPU)."""
        return self.member_proba(client_id, x).mean(dim=0)

    # ---- evaluate_shift (bayesfl.shift_evaluation.ShiftSubject) -----------------------------
    def shift_predictor(self, k: int):
        """Client ``k``'s ``predict(x) -> {"predictive": mean probabilities}`` (no plug-in)."""
        draws = self.shift_draws(k, len(self), 0, [])

        def predict(x: Tensor) -> dict[str, Tensor]:
            return {PREDICTIVE: draws(x).mean(dim=0)}

        return predict

    def shift_draws(self, k: int, n: int, seed: int, note: list[str]):
        """Client ``k``'s draws: the M members' headline probabilities (M, B, C) float64
        (``n`` and ``seed`` unused: an ensemble's draws are its members)."""
        parts = []
        for run in self.members:
            config, state = run.clients[k].config, run.client_state(k)
            device = getattr(run.strategy.context, "device", None) or torch.device("cpu")
            parts.append((run.strategy, config, state, run.evaluation_broadcast, device))

        def draws(x: Tensor) -> Tensor:
            with torch.no_grad():
                return torch.stack([
                    strategy.predict(config, state, broadcast, x.to(device))[PREDICTIVE]
                    .detach().to("cpu", torch.float64)
                    for strategy, config, state, broadcast, device in parts])

        return draws

    def shift_settings(self) -> dict[str, Any]:
        """The ensemble's entries of a shift report's settings."""
        return {"ensemble": {"members": len(self), "seeds": self.seeds,
                             "data_seed": self.config.data_rng_seed,
                             "strategies": [r.config.strategy for r in self.members],
                             "run_dirs": [None if r.run_dir is None else str(r.run_dir)
                                          for r in self.members],
                             "plug_in": "none (an ensemble has no plug-in row)",
                             "mutual_information": "the members as the posterior draws"},
                "posterior_samples": len(self),
                "predictive_names": {PREDICTIVE: "ensemble mean"}}


def simulate_ensemble(members: int = 5, *, out: str | Path | None = None,
                      **settings: Any) -> DeepEnsemble:
    """Run a federated deep ensemble: ``members`` runs of ``simulate(**settings)`` on the same
    clients, differing only in their seeds (`member_seeds`: member 0 is the single run
    of ``seed``), with ``data_seed`` fixed to the settings' (default: their ``seed``).

    Args:
        members: M, at least 2 (5 is the usual anchor).
        out: a directory whose ``member-M`` subdirectories hold the members' runs (each then
            loadable: ``DeepEnsemble.load(sorted(Path(out).glob("member-*")))``); None writes
            nothing.
        **settings: `bayesfl.simulate`'s arguments (``strategy``, ``dataset``,
            ``clients``, ``partition``, ``rounds``, ``seed``, ``data_seed``, ``resume``,
            ``force``, ``progress``, ``threads``, ``data``, the other config fields).

    Returns:
        The [`DeepEnsemble`][bayesfl.ensemble.DeepEnsemble] of the members.

    Raises:
        ConfigError: ``members`` < 2, or what `bayesfl.simulate` raises.
    """
    if isinstance(members, bool) or not isinstance(members, int | np.integer) or members < 2:
        raise ConfigError(f"members must be an integer >= 2 (5 is the usual ensemble), got "
                          f"{members!r}")
    seed = settings.pop("seed", 0)
    data_seed = settings.pop("data_seed", None)
    from bayesfl.config import check_setting

    seed = check_setting("seed", seed)
    data_seed = seed if data_seed is None else check_setting("data_seed", data_seed)
    runs = []
    for m, member_seed in enumerate(member_seeds(seed, int(members))):
        where = None if out is None else Path(out) / f"member-{m}"
        runs.append(simulate(seed=member_seed, data_seed=data_seed, out=where, **settings))
    return DeepEnsemble(runs)


# ---- what must agree ---------------------------------------------------------------------------
def _data_differences(a: SimulationResult, b: SimulationResult) -> list[str]:
    """What in ``b``'s clients differs from ``a``'s (empty: the same clients)."""
    out: list[str] = []
    ca, cb = a.config, b.config
    for name in DATA_FIELDS:
        va, vb = getattr(ca, name), getattr(cb, name)
        if name == "dataset_options":  # download is how the files came, not which data
            va = {k: v for k, v in va.items() if k != "download"}
            vb = {k: v for k, v in vb.items() if k != "download"}
        if va != vb:
            out.append(f"{name} {vb!r} vs {va!r}")
    if (ca.conformal is None) != (cb.conformal is None):  # conformal holds rows out too
        out.append(f"conformal {cb.conformal!r} vs {ca.conformal!r} (a conformal step holds "
                   "out part of each client's training rows)")
    if ca.data_rng_seed != cb.data_rng_seed:
        out.append(f"data seed {cb.data_rng_seed} vs {ca.data_rng_seed} (data_seed, or seed "
                   "where data_seed is unset)")
    da, db = _data_identity(a), _data_identity(b)
    if da is not None and db is not None and da != db:
        out.append("the data's recorded identity (summary['data']: shapes or digest)")
    if tuple(a.novel) != tuple(b.novel):
        out.append(f"novel clients {list(b.novel)} vs {list(a.novel)}")
    if len(a.clients) != len(b.clients):
        out.append(f"{len(b.clients)} clients vs {len(a.clients)}")
    elif not out:
        out += _row_differences(a, b)
    return out


def _data_identity(run: SimulationResult) -> Any:
    summary = run.summary if isinstance(run.summary, Mapping) else {}
    return summary.get("data")


def _row_differences(a: SimulationResult, b: SimulationResult) -> list[str]:
    """Clients whose rows differ, where both runs hold their rows (a loaded run holds none;
    its partition's sizes are compared instead)."""
    for ka, kb in zip(a.clients, b.clients, strict=True):
        da, db = ka.data, kb.data
        if da.train_x.shape[0] == 0 or db.train_x.shape[0] == 0:
            continue
        same = all(
            _same(getattr(da, name), getattr(db, name))
            for name in ("train_indices", "test_indices", "train_y", "test_y"))
        if not same:
            return [f"client {ka.client_id}'s training or test rows"]
    pa, pb = getattr(a, "partition", None), getattr(b, "partition", None)
    if pa and pb:
        for key in ("counts", "train_sizes", "test_sizes"):
            if pa.get(key) != pb.get(key):
                return [f"the partition's {key.replace('_', ' ')} (partition.json)"]
    return []


def _same(u: Any, v: Any) -> bool:
    if u is None or v is None:
        return u is None and v is None
    return bool(np.array_equal(np.asarray(u.cpu() if isinstance(u, Tensor) else u),
                               np.asarray(v.cpu() if isinstance(v, Tensor) else v)))


__all__ = ["DATA_FIELDS", "MEMBER_SEED_KEY", "DeepEnsemble", "member_seeds",
           "simulate_ensemble"]
