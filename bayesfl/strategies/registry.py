"""The strategy registry: strategies register where they are defined, with their options
declared as data.

A strategy module declares its options next to its class and registers it with a decorator::

    @register_strategy("fedprox", broadcast="whole network", upload="whole network",
                       aggregate="as FedAvg; proximal local objective")
    class FedProx(ParameterAveraging):
        OPTIONS = (Option("mu", float, 0.01, "proximal weight", minimum=0.0),)

        def __init__(self, context, *, mu=0.01, **kwargs): ...

Everything that lists strategies or options reads this registry: ``bayesfl strategies``, the
CLI help, the README and ``docs/architecture.md`` tables (written by ``tools/strategy_tables.py``
between markers, and checked by a test), and the validation of user-given options
(`check_options`: unknown names with a did-you-mean, types, bounds and choices, with
`ConfigError`). Declared options are the keyword-only parameters of the
class's ``__init__`` (over its base classes), with the same defaults: `register_strategy`
refuses a class whose declaration and signature differ, so the two cannot drift.

Options are inherited: a class's options are those its base classes declare (``OPTIONS`` in each
class body), a later declaration of the same name replacing an earlier one, as Python resolves
the ``__init__`` keywords themselves.

The built-in strategies register when `bayesfl.strategies` is imported (it imports every
module of its family folders); a strategy defined elsewhere (a user's module, a test fixture, a
Flower app's module) registers when its module is imported.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from bayesfl.errors import ConfigError

T = TypeVar("T", bound=type)

Kind = type | tuple[type, ...]
"""What an option's value may be: ``int``, ``float`` (an integer too), ``str``, ``bool``,
``dict`` (a mapping with string keys) or ``list`` (a list or tuple); a tuple of them for
options that take one of several forms (FedLog's ``feature_scale``: a number or a word)."""

_KIND_WORDS = {int: "an integer", float: "a finite number", str: "a string",
               bool: "true or false", dict: "a mapping", list: "a list"}


@dataclass(frozen=True)
class Option:
    """One declared strategy option.

    Attributes:
        name: the keyword (``--option NAME=VALUE``, ``strategy_options={NAME: ...}``).
        kind: the type(s) a value may have (`Kind`).
        default: the ``__init__`` keyword default.
        help: what the option means (shown by ``bayesfl strategies NAME``).
        minimum, maximum: inclusive bounds of a number; None: unbounded on that side. A bounded
            number must be finite.
        choices: the values a string option may take; None: any string.
        nullable: whether None is accepted (always, when the default is None).
        shown: what a None default stands for, shown instead of None (FedSI's ``posterior``
            defaults to None, meaning ``subnet_full``).
    """

    name: str
    kind: Kind
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None
    nullable: bool = False
    shown: str | None = None

    @property
    def kinds(self) -> tuple[type, ...]:
        return self.kind if isinstance(self.kind, tuple) else (self.kind,)

    @property
    def shown_default(self) -> Any:
        """The default as the listings show it (`shown` for a None default)."""
        return self.shown if self.default is None and self.shown is not None else self.default

    def type_words(self) -> str:
        """The accepted kinds in words, e.g. ``"a number or a string"``."""
        words = " or ".join(_KIND_WORDS.get(k, k.__name__) for k in self.kinds)
        return words + (" or none" if self.nullable or self.default is None else "")

    def check(self, strategy: str, value: Any) -> None:
        """Refuse a ``value`` this option cannot take.

        Raises:
            ConfigError: naming the strategy, the option, the value and what is valid.
        """
        if value is None:
            if self.nullable or self.default is None:
                return
            raise ConfigError(f"{strategy} {self.name} must be {self.type_words()}, got None")
        fits = any(_is_kind(value, k) for k in self.kinds)
        if set(self.kinds) <= {int, float} and (self.minimum is not None
                                                or self.maximum is not None):
            low = -math.inf if self.minimum is None else self.minimum
            high = math.inf if self.maximum is None else self.maximum
            if not fits or not math.isfinite(value) or not low <= value <= high:
                what = "a finite number" if float in self.kinds else "an integer"
                bounds = (f">= {_number(low)}" if high == math.inf else
                          f"<= {_number(high)}" if low == -math.inf else
                          f"in [{_number(low)}, {_number(high)}]")
                raise ConfigError(f"{strategy} {self.name} must be {what} {bounds}, got "
                                  f"{value!r}")
        if not fits:
            raise ConfigError(f"{strategy} {self.name} must be {self.type_words()}, got "
                              f"{value!r}")
        if isinstance(value, str) and self.choices is not None and value not in self.choices:
            near = difflib.get_close_matches(value, [str(c) for c in self.choices], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{strategy} {self.name} must be one of "
                              f"{', '.join(map(repr, self.choices))}, got {value!r}{hint}")


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return _is_number(value)
    if kind is dict:
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if kind is list:
        return isinstance(value, list | tuple)
    return isinstance(value, kind)


@dataclass(frozen=True)
class Family:
    """A strategy family: one folder of ``bayesfl/strategies/`` and one docs page.

    Attributes:
        key: the folder name (``averaging``), what `register_strategy`'s ``family`` names.
        label: its name in ``docs/architecture.md``'s table.
        title: its name in the README's table.
        page: its docs page, relative to ``docs/``.
        link: the page's title in the README's link.
        note: words the README adds after the names, or "".
    """

    key: str
    label: str
    title: str
    page: str
    link: str
    note: str = ""


FAMILIES: dict[str, Family] = {f.key: f for f in (
    Family("fedlog", "FedLog", "FedLog (conjugate heads)", "strategies/fedlog.md", "FedLog"),
    Family("averaging", "parameter averaging", "parameter averaging",
           "strategies/parameter-averaging.md", "Parameter averaging",
           note="(FedPart's partial updates: `schedule=\"fedpart\"` on any of them); a "
                "probabilistic head on any of them (`head=laplace`)"),
    Family("fedsi", "FedSI", "FedSI (subnetwork posteriors)", "strategies/fedsi.md", "FedSI"),
    Family("bayes", "whole-network Bayesian", "whole-network Bayesian",
           "strategies/bayesian-baselines.md", "Bayesian baselines"),
    Family("representation", "representation sharing", "representation sharing",
           "strategies/representation-sharing.md", "Representation sharing"),
)}
"""The families in the order every listing shows them."""


@dataclass(frozen=True)
class Registration:
    """What a strategy registered with: its name, family and the round's messages in words
    (``docs/architecture.md``'s table).

    Attributes:
        name: the registered name.
        family: a key of `FAMILIES`.
        broadcast: what the server sends (down).
        upload: what a client sends back (up).
        aggregate: what the server does with the uploads.
        order: registration order (listings sort by family, then this).
    """

    name: str
    family: str
    broadcast: str
    upload: str
    aggregate: str
    order: int


STRATEGIES: dict[str, type] = {}
"""Registry: strategy name -> class, in the order of `FAMILIES`, then of registration
(strategies registered after the built-ins follow them). The FedLog paper's named baseline
variants are entries of their own: ``fedrep`` (its "FedRep" / "FedRep 2", two local layers),
``fedrep-1`` ("FedRep 1"), ``lg-fedavg`` ("LG-FedAvg 1", one global layer) and ``lg-fedavg-2``
("LG-FedAvg 2")."""

_ORDER = [0]


def register_strategy(name: str, *, broadcast: str, upload: str, aggregate: str,
                      family: str | None = None) -> Callable[[T], T]:
    """Class decorator: register a strategy class under ``name``.

    Sets the class's ``name``; records its family and messages (`Registration`, the
    ``registration`` class attribute). ``family`` defaults to the folder of
    ``bayesfl/strategies/`` the class is defined in; a class defined elsewhere names one of
    `FAMILIES`.

    Raises:
        TypeError: the name is taken by another class, the family is unknown, a declared option
            has no help, or the declared options differ from the keyword-only parameters of the
            class's ``__init__`` (names or defaults): a programming error, raised when the
            module is imported.
    """

    def register(cls: T) -> T:
        key = family or _folder_family(cls)
        if key not in FAMILIES:
            raise TypeError(f"strategy {name!r} ({cls.__qualname__}): family {key!r} is not one "
                            f"of {', '.join(FAMILIES)} (pass family=...)")
        taken = STRATEGIES.get(name)
        if taken is not None and taken.__qualname__ != cls.__qualname__:
            raise TypeError(f"strategy name {name!r} is taken by {taken.__module__}."
                            f"{taken.__qualname__}")
        _check_declaration(name, cls)
        cls.name = name
        cls.registration = Registration(name, key, broadcast, upload, aggregate, _ORDER[0])
        _ORDER[0] += 1
        STRATEGIES[name] = cls
        return cls

    return register


def _folder_family(cls: type) -> str | None:
    parts = cls.__module__.split(".")
    if parts[:2] == ["bayesfl", "strategies"] and len(parts) > 3:
        return parts[2]
    return None


def sort_registry() -> None:
    """Put `STRATEGIES` in listing order (family, then registration), in place."""
    ranks = {key: i for i, key in enumerate(FAMILIES)}
    ordered = sorted(STRATEGIES.items(), key=lambda item: _sort_key(item[1], ranks))
    STRATEGIES.clear()
    STRATEGIES.update(ordered)


def _sort_key(cls: type, ranks: Mapping[str, int]) -> tuple[int, int]:
    registration = getattr(cls, "registration", None)
    if registration is None:
        return (len(ranks), 0)
    return (ranks.get(registration.family, len(ranks)), registration.order)


def options_of(cls: type) -> dict[str, Option]:
    """The options of strategy class ``cls``: option name -> `Option`, over its
    base classes (a subclass's declaration replaces its base's)."""
    options: dict[str, Option] = {}
    for klass in reversed(cls.__mro__):
        for option in vars(klass).get("OPTIONS", ()):
            options[option.name] = option
    return options


def _keywords(cls: type) -> dict[str, Any]:
    """The keyword-only ``__init__`` parameters of ``cls`` over its classes -> defaults."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                found[p.name] = p.default
    return found


def _check_declaration(name: str, cls: type) -> None:
    undocumented = sorted(n for n, o in options_of(cls).items() if not o.help.strip())
    if undocumented:
        raise TypeError(f"strategy {name!r} ({cls.__qualname__}): options without help "
                        f"{undocumented} (every declared option says what it means)")
    declared = {n: o.default for n, o in options_of(cls).items()}
    signature = _keywords(cls)
    if declared != signature:
        missing = sorted(set(signature) - set(declared))
        extra = sorted(set(declared) - set(signature))
        differ = sorted(n for n in set(declared) & set(signature)
                        if declared[n] != signature[n])
        raise TypeError(f"strategy {name!r} ({cls.__qualname__}): its OPTIONS and its __init__ "
                        f"keywords differ: undeclared {missing}, not keywords {extra}, other "
                        f"defaults {differ}")


def lookup(name: str) -> type:
    """The class registered as ``name`` (case, ``_`` for ``-`` and spaces forgiven).

    Raises:
        ConfigError: no such strategy; the message lists the valid names and the nearest.
    """
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in STRATEGIES:
        near = difflib.get_close_matches(str(key), list(STRATEGIES), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown strategy {name!r}; valid names: {', '.join(STRATEGIES)}"
                          f"{hint}")
    return STRATEGIES[key]


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Check user-given ``options`` of strategy ``name`` against its declaration.

    Raises:
        ConfigError: an unknown strategy, an unknown option (the message lists the valid ones
            and the nearest), or a value of the wrong type, out of bounds or not one of the
            choices.
    """
    cls = lookup(name)
    declared = options_of(cls)
    unknown = sorted(set(options) - set(declared))
    if unknown:
        near = [m for u in unknown for m in difflib.get_close_matches(u, list(declared), n=1)]
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise ConfigError(f"unknown option(s) {unknown} for strategy {cls.name!r}{hint}; "
                          f"valid: {', '.join(sorted(declared)) or 'none'}")
    for key, value in options.items():
        declared[key].check(cls.name, value)


def check_option_names(name: str, options: Mapping[str, Any]) -> None:
    """Check that strategy ``name`` exists and declares every name of ``options`` (not their
    values): what a run checks at its start, before any data is loaded.

    Raises:
        ConfigError: an unknown strategy or option (the message lists the valid ones and the
            nearest).
    """
    declared = options_of(lookup(name))
    check_options(name, {k: v for k, v in options.items() if k not in declared})


def strategy_defaults(name: str) -> dict[str, Any]:
    """The options of strategy ``name`` with their ``__init__`` defaults."""
    return {n: o.default for n, o in options_of(lookup(name)).items()}


__all__ = ["FAMILIES", "STRATEGIES", "Family", "Kind", "Option", "Registration",
           "check_option_names", "check_options", "lookup", "options_of", "register_strategy",
           "sort_registry", "strategy_defaults"]
