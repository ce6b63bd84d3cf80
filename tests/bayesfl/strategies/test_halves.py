"""A strategy's server half and client half are apart in structure, not by convention (issue 42).

* Every method of the base classes belongs to exactly one part: the server half
  (``ServerStrategy``), the client half (``ClientStrategy``) or the shared configuration
  (``StrategyConfig``); ``Strategy`` adds nothing of its own.
* The views each side holds (``ServerView`` in the engine, ``ClientView`` in the client
  runner) refuse the other half's methods.
* Static: the server side's modules name no client-half method, the client side's no
  server-half method.
* Dynamic, for every registered strategy (and the probabilistic head and FedPart's schedule,
  which add their own paths): a real simulated run of two rounds in which the engine holds the
  server view and the executor the client view. The same run is then made with ONE strategy
  object behind both views, every attribute access and every change of the object traced per
  half: no attribute a server-half call changes is read by a client-half call, nor the other
  way round, except the declared memos (``StrategyConfig.MEMOS``), which only gain entries.
  Its figures equal those of the run with two objects, bit for bit.
"""

from __future__ import annotations

import ast
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bayesfl.config import SimulationConfig
from bayesfl.simulate import _Run
from bayesfl.strategies import STRATEGIES, StrategyContext, make_strategy
from bayesfl.strategies.base import (
    CLIENT_API,
    SERVER_API,
    SHARED_API,
    ClientStrategy,
    ServerStrategy,
    Strategy,
    StrategyConfig,
)
from bayesfl.strategies.halves import ClientView, HalfError, ServerView, client_half, server_half

ROOT = Path(__file__).resolve().parents[3]

DATA = {"n": 90, "num_classes": 3, "dim": 5}
SMALL = dict(dataset="gaussian_mixture", clients=3, partition="iid", rounds=2, seed=3,
             body="mlp:8", feature_dim=4, local_epochs=1, dataset_options=DATA)
FAST = {"fedpop": {"sgld_burn_in": 2, "sgld_samples": 2, "final_samples": 3},
        "fedsi": {"finetune_epochs": 2}, "fedsi-fac": {"finetune_epochs": 2},
        "pfedbayes": {"personal_steps": 1, "mc_samples": 4}}
"""Options that shorten a strategy's chains (the paths run are the same)."""
CASES = [(name, FAST.get(name, {})) for name in STRATEGIES]
CASES += [("fedavg", {"head": "laplace"}), ("fedavg", {"schedule": "fedpart"})]
IDS = [name + "".join(f"-{v}" for k, v in o.items() if k in ("head", "schedule"))
       for name, o in CASES]


def _methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items()
            if not n.startswith("__") and (callable(v) or isinstance(v, property))}


# ---- the shape ------------------------------------------------------------------------------
def test_every_base_method_is_in_exactly_one_part():
    server, client, shared = (_methods(c) for c in (ServerStrategy, ClientStrategy,
                                                    StrategyConfig))
    assert server == SERVER_API and client == CLIENT_API and shared < SHARED_API
    assert not (server & client or server & shared or client & shared)
    assert not _methods(Strategy)  # the composition adds nothing: its halves are all it has
    assert Strategy.__mro__[1:4] == (ServerStrategy, ClientStrategy, StrategyConfig)
    # the counts the docs give (docs/architecture.md, "Strategy contract")
    assert (len(server), len(client), len(shared | {"__init__"})) == (13, 14, 7)


REQUIRED = {ServerStrategy: ("init", "broadcast_tensors", "upload_schema", "aggregate"),
            ClientStrategy: ("fit", "predict")}
"""What each half's base leaves to the strategy (its defaults raise TypeError)."""


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_registered_strategy_implements_both_halves(name):
    cls = STRATEGIES[name]
    assert issubclass(cls, Strategy)
    for half, methods in REQUIRED.items():
        for method in methods:
            assert getattr(cls, method) is not getattr(half, method), (half.__name__, method)


def _context() -> StrategyContext:
    return StrategyContext(num_classes=3, feature_dim=4, input_shape=(5,), bodies=("mlp:8",),
                           clients=3)


def test_the_views_refuse_the_other_half_and_cannot_be_written():
    strategy = make_strategy("fedlog", _context())
    server, client = server_half(strategy), client_half(strategy)
    assert isinstance(server, ServerStrategy) and not isinstance(server, ClientStrategy)
    assert isinstance(client, ClientStrategy) and not isinstance(client, ServerStrategy)
    for name in CLIENT_API:
        assert not hasattr(server, name)
        with pytest.raises(HalfError, match="client-half method"):
            getattr(server, name)
    for name in SERVER_API:
        assert not hasattr(client, name)
        with pytest.raises(HalfError, match="server-half method"):
            getattr(client, name)
    # a strategy's own helpers and option attributes belong to neither side's surface
    with pytest.raises(HalfError, match="not part of"):
        server.feature_scale  # noqa: B018
    for view in (server, client):
        assert view.name == "fedlog" and view.context is strategy.context
        assert view.personalizes == strategy.personalizes
        assert view.template("mlp:8") is strategy.template("mlp:8")
        with pytest.raises(HalfError, match="read-only"):
            view.name = "x"
    assert server_half(server) is server and client_half(client) is client
    with pytest.raises(TypeError, match="the strategy itself"):
        server_half(client)
    init = server.init()  # the view forwards to the strategy's own methods
    assert init.keys() == strategy.init().keys()


# ---- static: what each side's modules name --------------------------------------------------
SERVER_SIDE = [*sorted((ROOT / "bayesfl" / "engine").glob("*.py")),
               ROOT / "bayesfl" / "flower" / "server_app.py",
               ROOT / "bayesfl" / "flower" / "channel.py"]
CLIENT_SIDE = [*sorted((ROOT / "bayesfl" / "client").glob("*.py")),
               ROOT / "bayesfl" / "executor.py", ROOT / "bayesfl" / "flower" / "client_app.py"]


OTHER_SIDE = {"phases.py": {"Site"}}
"""Classes of a server-side module that are the client's side of an exchange: a final phase's
``Site`` answers a request on a client, with the client half (``bayesfl.engine.phases``)."""
HOLDERS = {"server", "strategy", "client_half", "server_half", "half"}
"""Names that hold a strategy (``self.server``, ``node.strategy``, ...); a parameter or
variable annotated with a strategy class is one too (`_strategy_uses`)."""


def _tree(path: Path) -> tuple[ast.Module, set[int]]:
    """The module's syntax tree and the nodes inside the classes `OTHER_SIDE` names."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               and c.name in OTHER_SIDE.get(path.name, ()) for n in ast.walk(c)}
    return tree, skipped


def _strategy_uses(path: Path) -> tuple[set[str], set[str]]:
    """(the names every strategy holder is asked for, the strategy classes annotated)."""
    tree, skipped = _tree(path)
    holders, classes = set(HOLDERS), set()
    for node in ast.walk(tree):
        annotation, name = None, None
        if isinstance(node, ast.arg):
            annotation, name = node.annotation, node.arg
        elif isinstance(node, ast.AnnAssign):
            annotation, target = node.annotation, node.target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id",
                                                                                None)
        if annotation is not None and id(node) not in skipped:
            found = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)
                     and n.id.endswith("Strategy")} | {
                n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and n.value.endswith("Strategy")}
            if found and name:
                holders.add(name)
                classes |= found
    asked = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in skipped:
            base = node.value
            last = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if last in holders:
                asked.add(node.attr)
    return asked, classes


@pytest.mark.parametrize("path", SERVER_SIDE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_server_side_modules_hold_and_call_only_the_server_half(path):
    asked, classes = _strategy_uses(path)
    assert not asked & CLIENT_API
    assert classes <= {"ServerStrategy", "StrategyConfig"}


@pytest.mark.parametrize("path", CLIENT_SIDE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_client_side_modules_hold_and_call_only_the_client_half(path):
    asked, classes = _strategy_uses(path)
    assert not asked & SERVER_API
    assert classes <= {"ClientStrategy", "StrategyConfig"}


def test_the_static_check_sees_a_call_of_the_other_half(tmp_path):
    module = tmp_path / "engine_like.py"
    module.write_text("def step(server, x):\n    return server.predict(x)\n\n\n"
                      "def other(s: 'Strategy', plan):\n    return s.aggregate(plan)\n")
    asked, classes = _strategy_uses(module)
    assert asked & CLIENT_API == {"predict"} and asked & SERVER_API == {"aggregate"}
    assert classes == {"Strategy"}


# ---- dynamic: real runs ---------------------------------------------------------------------
def _config(name: str, options: dict[str, Any]) -> SimulationConfig:
    settings = {**SMALL, "local_epochs": 3} if name == "fedpa" else SMALL  # FedPA: samples
    return SimulationConfig(strategy=name, strategy_options=options, **settings)


def _run(config: SimulationConfig, tracer: Tracer | None = None) -> dict[str, Any]:
    with torch.random.fork_rng():
        run = _Run(config, None, None, threads=1)
        run.progress = False
        # the engine holds the server view, the client runner the client view
        assert type(run.server) is ServerView and run.loop.server is run.server
        assert type(run.executor.strategy) is ClientView
        if tracer is not None:  # ONE object behind both views, traced
            strategy = object.__getattribute__(run.server, "_strategy")
            run.server, run.executor.strategy = tracer.attach(strategy)
            run.loop.server, run.client_half = run.server, strategy
        summary = run.execute()
    return {"metrics": run.metrics_log.records, "summary": summary}


def _figures(records: list[dict[str, Any]]) -> str:
    """The rounds' figures without their timings (as text: a NaN equals a NaN)."""
    return json.dumps([{k: v for k, v in r.items() if "seconds" not in k} for r in records],
                      sort_keys=True, default=repr)


class Tracer:
    """Which instance attributes each half's calls read and change (module docstring).

    The strategy object's class is swapped for a subclass that records every read of an
    instance attribute while a half's call is under way; a change is any attribute bound,
    rebound or deleted, or any value reachable from it changed in place (a tensor's version
    counter, a container's items, a module's tensors), seen by fingerprinting the object's
    attributes before and after each call a view forwards.
    """

    def __init__(self) -> None:
        self.half: str | None = None
        self.reads: dict[str, set[str]] = {"server": set(), "client": set()}
        self.writes: dict[str, set[str]] = {"server": set(), "client": set()}
        self.memo_changes: list[str] = []

    def attach(self, strategy: Any) -> tuple[Any, Any]:
        """Trace ``strategy``; returns its (server view, client view), each call traced."""
        tracer = self

        class Traced(type(strategy)):  # type: ignore[misc, valid-type]
            def __getattribute__(self, name: str) -> Any:
                if tracer.half is not None and name in object.__getattribute__(self,
                                                                               "__dict__"):
                    tracer.reads[tracer.half].add(name)
                return object.__getattribute__(self, name)

        Traced.__name__ = type(strategy).__name__
        strategy.__class__ = Traced
        return (_traced_view(ServerView, "server", strategy, self),
                _traced_view(ClientView, "client", strategy, self))

    def shared(self) -> tuple[set[str], set[str]]:
        """(what server calls changed and client calls read, the other way round)."""
        return (self.writes["server"] & self.reads["client"],
                self.writes["client"] & self.reads["server"])

    @contextlib.contextmanager
    def calling(self, half: str, strategy: Any):
        if self.half is not None:  # a call inside a call: the outer one's half
            yield
            return
        before = _fingerprints(strategy)
        self.half = half
        try:
            yield
        finally:
            self.half = None
            after = _fingerprints(strategy)
            for name in before.keys() | after.keys():
                if name in StrategyConfig.MEMOS:
                    old, new = before.get(name, {}), after.get(name, {})
                    if any(new.get(k) != v for k, v in old.items()):
                        self.memo_changes.append(f"{half}: {name}")
                elif before.get(name) != after.get(name):
                    self.writes[half].add(name)


def _traced_view(view: type, half: str, strategy: Any, tracer: Tracer) -> Any:
    class TracedView(view):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            value = view.__getattribute__(self, name)
            if not callable(value) or name.startswith("__"):
                return value

            def call(*args: Any, **kwargs: Any) -> Any:
                with tracer.calling(half, strategy):
                    return value(*args, **kwargs)

            return call

    return TracedView(strategy)


def _fingerprint(value: Any, seen: set[int]) -> Any:
    """What identifies ``value`` and everything reachable from it that a call could change."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, str | int | float | bool | type(None) | torch.device | torch.dtype):
        return value
    if id(value) in seen:
        return ("seen", id(value))
    seen.add(id(value))
    if isinstance(value, nn.Module):
        return ("module", id(value), tuple((k, _fingerprint(v, seen))
                                           for k, v in value.state_dict(keep_vars=True).items()))
    if isinstance(value, dict):
        return ("dict", id(value), tuple((repr(k), _fingerprint(v, seen))
                                         for k, v in value.items()))
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return (type(value).__name__, id(value), tuple(_fingerprint(v, seen) for v in items))
    if hasattr(value, "__dict__") and not callable(value):
        return ("object", id(value), tuple((k, _fingerprint(v, seen))
                                           for k, v in sorted(vars(value).items())))
    return ("other", id(value))


def _fingerprints(strategy: Any) -> dict[str, Any]:
    """Attribute -> its fingerprint; for a memo, key -> the fingerprint of its value."""
    out: dict[str, Any] = {}
    for name, value in object.__getattribute__(strategy, "__dict__").items():
        if name in StrategyConfig.MEMOS:
            out[name] = {repr(k): _fingerprint(v, set()) for k, v in value.items()}
        else:
            out[name] = _fingerprint(value, set())
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options"), CASES, ids=IDS)
def test_the_halves_share_no_mutable_state_over_a_real_run(name, options):
    config = _config(name, options)
    apart = _run(config)  # the halves as the simulator runs them: two objects
    tracer = Tracer()
    together = _run(config, tracer)  # one object behind both views
    assert tracer.reads["server"] and tracer.reads["client"]  # the tracing saw the calls
    assert not tracer.memo_changes  # memos only gain entries
    assert tracer.shared() == (set(), set()), tracer.writes
    # what sharing would change does not change: the same figures, bit for bit
    assert _figures(together["metrics"]) == _figures(apart["metrics"])


class _Leaky(STRATEGIES["fedavg"]):
    """FedAvg whose aggregate leaves a note that its fit reads: state shared by the halves."""

    def aggregate(self, state, uploads, round, generator):
        self.last_aggregated = round
        return super().aggregate(state, uploads, round, generator)

    def fit(self, config, state, data, broadcast, generator):
        getattr(self, "last_aggregated", None)
        return super().fit(config, state, data, broadcast, generator)


class _InPlace(STRATEGIES["fedavg"]):
    """FedAvg whose client half scales a tensor its server half reads, in place."""

    def __init__(self, context, **options):
        super().__init__(context, **options)
        self.scale = torch.ones(())

    def fit(self, config, state, data, broadcast, generator):
        self.scale.mul_(1.0)  # an in-place write: the version counter moves
        return super().fit(config, state, data, broadcast, generator)

    def aggregate(self, state, uploads, round, generator):
        self.scale  # noqa: B018 - the read
        return super().aggregate(state, uploads, round, generator)


@pytest.mark.parametrize(("cls", "expected"), [(_Leaky, ({"last_aggregated"}, set())),
                                               (_InPlace, (set(), {"scale"}))])
def test_the_tracer_finds_state_the_halves_share(cls, expected):
    from strategy_helpers import context, make_clients

    strategy = cls(context())
    clients = make_clients(strategy)
    tracer = Tracer()
    server, client = tracer.attach(strategy)
    state = server.init()
    for r in (1, 2):
        plan = server.configure(state, r)
        uploads = []
        for c in clients:
            c.state, upload = client.fit(c.config, c.state, c.data, plan.broadcast,
                                         torch.Generator().manual_seed(r))
            uploads.append(upload)
        state = server.aggregate(state, uploads, r, torch.Generator().manual_seed(0))
    assert tracer.shared() == expected
