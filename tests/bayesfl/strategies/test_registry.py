"""The strategy registry: options declared as data, checked against the signature they
declare, and user-given options validated from the declaration with the project's errors."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import pytest

from bayesfl.errors import ConfigError
from bayesfl.strategies import STRATEGIES, make_strategy, options_of, strategy_options
from bayesfl.strategies.averaging.fedavg import FedAvg
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.registry import (
    FAMILIES,
    Option,
    check_options,
    register_strategy,
)


def keywords(cls: type) -> dict[str, Any]:
    """The keyword-only ``__init__`` parameters over ``cls``'s classes -> defaults (an
    independent reading of what the declarations must equal)."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    found[p.name] = p.default
    return found


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_declares_exactly_its_keywords_with_their_defaults(name):
    cls = STRATEGIES[name]
    declared = options_of(cls)
    assert {n: o.default for n, o in declared.items()} == keywords(cls)
    assert strategy_options(name) == keywords(cls)
    for option in declared.values():  # every default passes its own declaration
        option.check(name, option.default)
        if option.choices is not None and option.shown_default is not None:
            assert option.shown_default in option.choices, (name, option.name)
    assert cls.registration.family in FAMILIES and cls.name == name


def test_the_registry_lists_families_in_order_with_fedlog_first():
    families = [cls.registration.family for cls in STRATEGIES.values()]
    ranks = [list(FAMILIES).index(f) for f in families]
    assert ranks == sorted(ranks) and next(iter(STRATEGIES)) == "fedlog"


@pytest.mark.parametrize(("options", "message"), [
    ({"alpah": 0.1}, r"unknown option\(s\) \['alpah'\] for strategy 'fedlog-c' \(did you mean "
                     r"'alpha'\?\); valid: "),
    ({"alpha": "big"}, r"fedlog-c alpha must be a finite number, got 'big'"),
    ({"alpha": True}, r"fedlog-c alpha must be a finite number, got True"),
    ({"mc_samples": 2.5}, r"fedlog-c mc_samples must be an integer, got 2\.5"),
    ({"predictive": 3}, r"fedlog-c predictive must be a string, got 3"),
    ({"feature_scale": [1]},
     r"fedlog-c feature_scale must be a finite number or a string, got \[1\]"),
    ({"sample_screening_ratio": "x"},
     r"fedlog-c sample_screening_ratio must be a finite number or none, got 'x'"),
])
def test_user_options_are_checked_against_the_declaration(options, message):
    with pytest.raises(ConfigError, match=message):
        check_options("fedlog-c", options)


def test_none_is_taken_where_declared_and_refused_elsewhere():
    check_options("fedlog", {"sample_screening_ratio": None})  # declared nullable
    check_options("fedsi", {"subnet_size": None})              # a None default
    with pytest.raises(ConfigError, match="fedlog mc_samples must be an integer, got None"):
        check_options("fedlog", {"mc_samples": None})


def test_an_unknown_strategy_names_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown strategy 'fedprxo'; valid names: fedlog, "
                                          r".*\(did you mean 'fedprox'\?\)"):
        check_options("fedprxo", {})


def test_bounds_and_choices_give_one_error_each():
    number = Option("rate", float, 0.5, "a rate", minimum=0.0, maximum=1.0)
    count = Option("count", int, 1, "a count", minimum=1)
    word = Option("mode", str, "sum", "a mode", choices=("sum", "median"))
    number.check("s", 0.0), number.check("s", 1), count.check("s", 1), word.check("s", "median")
    for option, value, message in [
        (number, 1.5, r"s rate must be a finite number in \[0, 1\], got 1\.5"),
        (number, float("nan"), r"s rate must be a finite number in \[0, 1\], got nan"),
        (number, "0.5", r"s rate must be a finite number in \[0, 1\], got '0\.5'"),
        (count, 0, r"s count must be an integer >= 1, got 0"),
        (count, 2.0, r"s count must be an integer >= 1, got 2\.0"),
        (word, "mean", r"s mode must be one of 'sum', 'median', got 'mean'"),
        (word, "medain", r"got 'medain' \(did you mean 'median'\?\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            option.check("s", value)


def test_make_strategy_refuses_what_the_strategy_itself_lets_through(monkeypatch):
    built = []
    monkeypatch.setattr(FedAvg, "__init__", lambda self, *a, **k: built.append(k))
    with pytest.raises(ConfigError, match="fedavg trim_fraction must be a finite number"):
        make_strategy("fedavg", StrategyContext(num_classes=3, feature_dim=4),
                      trim_fraction="half")
    with pytest.raises(ConfigError, match=r"did you mean 'trim_fraction'"):
        make_strategy("fedavg", StrategyContext(num_classes=3, feature_dim=4),
                      trim_fractoin=0.1)
    assert built == [{"trim_fraction": "half"}]  # the unknown name never reached the class


def test_a_declaration_that_differs_from_the_signature_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"undeclared \['beta'\], not keywords \[\], other "
                                        r"defaults \['alpha'\]"):
        @register_strategy("test-mismatch", family="averaging", broadcast="", upload="",
                           aggregate="")
        class Mismatch(FedAvg):
            OPTIONS: ClassVar[tuple[Option, ...]] = (Option("alpha", float, 1.0, "a"),)

            def __init__(self, context, *, alpha: float = 2.0, beta: int = 1, **kw):
                super().__init__(context, **kw)
    assert "test-mismatch" not in STRATEGIES


def test_an_option_without_help_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"options without help \['alpha'\]"):
        @register_strategy("test-silent", family="averaging", broadcast="", upload="",
                           aggregate="")
        class Silent(FedAvg):
            OPTIONS: ClassVar[tuple[Option, ...]] = (Option("alpha", float, 1.0, " "),)

            def __init__(self, context, *, alpha: float = 1.0, **kw):
                super().__init__(context, **kw)
    assert "test-silent" not in STRATEGIES


def test_a_taken_name_and_an_unknown_family_are_refused():
    with pytest.raises(TypeError, match="'fedavg' is taken by"):
        @register_strategy("fedavg", family="averaging", broadcast="", upload="", aggregate="")
        class Other(FedAvg):
            pass
    with pytest.raises(TypeError, match="family 'nowhere' is not one of"):
        @register_strategy("test-nowhere", family="nowhere", broadcast="", upload="",
                           aggregate="")
        class Nowhere(FedAvg):
            pass
    assert STRATEGIES["fedavg"] is FedAvg and "test-nowhere" not in STRATEGIES
