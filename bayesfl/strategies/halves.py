"""Each side of a transport holds a strategy through a view of its own half.

A strategy is one class with both halves ([`Strategy`][bayesfl.strategies.base.Strategy], i.e.
``ServerStrategy`` and ``ClientStrategy`` over the shared ``StrategyConfig``), so that it is
written in one module, as a Flower app's strategy and its ClientApp come from one project. The
halves are kept apart where they are *used*: the engine (`bayesfl.engine`, Flower's
ServerApp) holds the strategy as a `ServerView`, and the client runner
(`bayesfl.client.step`, the simulator's executor, Flower's ClientApp) as a
`ClientView`. A view answers its own half's methods (``SERVER_API`` or ``CLIENT_API``)
and the shared configuration (``SHARED_API``: ``name``, ``context``, ``personalizes``, the
network of a body spec, ...) by the strategy's own, and refuses everything else with
`HalfError` (an ``AttributeError``, so ``hasattr(view, "fit")`` is False on the
server side). A view cannot be written to.

What a view proves is what its side *calls*; that the two halves share no mutable state inside
the strategy (a server method never writes what a client method reads) is checked for every
registered strategy over a simulated run by ``tests/bayesfl/strategies/test_halves.py``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from bayesfl.strategies.base import (
    CLIENT_API,
    SERVER_API,
    SHARED_API,
    ClientStrategy,
    ServerStrategy,
    StrategyConfig,
)


class HalfError(AttributeError):
    """A side of a transport asked a strategy for a name its half does not have."""


class _HalfView:
    """A strategy seen from one side (module docstring)."""

    half: ClassVar[str]
    allowed: ClassVar[frozenset[str]]
    other: ClassVar[str]

    def __init__(self, strategy: StrategyConfig) -> None:
        if isinstance(strategy, _HalfView):
            raise TypeError(f"a {type(self).__name__} needs the strategy itself, got a "
                            f"{type(strategy).__name__}")
        object.__setattr__(self, "_strategy", strategy)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            return object.__getattribute__(self, name)
        cls = object.__getattribute__(self, "__class__")
        strategy = object.__getattribute__(self, "_strategy")
        if name in cls.allowed:
            return getattr(strategy, name)
        which = (f"a {cls.other}-half method" if name in (CLIENT_API | SERVER_API)
                 else "not part of the strategy's " + cls.half + " half or its shared "
                 "configuration")
        raise HalfError(f"{name!r} is {which} of strategy {strategy.name!r}: the {cls.half} "
                        f"side may use only {cls.half.capitalize()}Strategy's methods and the "
                        "shared configuration (bayesfl.strategies.halves)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise HalfError(f"a {type(self).__name__} is read-only (a strategy's halves write "
                        "nothing after construction)")

    def __dir__(self) -> list[str]:
        return sorted(type(self).allowed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({object.__getattribute__(self, '_strategy')!r})"


class ServerView(_HalfView, ServerStrategy):
    """A strategy's server half and shared configuration, nothing else (module docstring)."""

    half, other, allowed = "server", "client", SERVER_API | SHARED_API


class ClientView(_HalfView, ClientStrategy):
    """A strategy's client half and shared configuration, nothing else (module docstring)."""

    half, other, allowed = "client", "server", CLIENT_API | SHARED_API


def server_half(strategy: StrategyConfig) -> ServerStrategy:
    """``strategy`` as the server side holds it: a `ServerView` (itself if it is one).

    Raises:
        TypeError: ``strategy`` is a client view.
    """
    return strategy if isinstance(strategy, ServerView) else ServerView(strategy)


def client_half(strategy: StrategyConfig) -> ClientStrategy:
    """``strategy`` as a client step holds it: a `ClientView` (itself if it is one).

    Raises:
        TypeError: ``strategy`` is a server view.
    """
    return strategy if isinstance(strategy, ClientView) else ClientView(strategy)


__all__ = ["ClientView", "HalfError", "ServerView", "client_half", "server_half"]
