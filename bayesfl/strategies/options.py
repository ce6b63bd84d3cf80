"""Checks of a strategy's numeric options, with errors that name the strategy and option."""

from __future__ import annotations

import math

from bayesfl.errors import ConfigError


def option_number(strategy: str, option: str, value: object, minimum: float = 0.0) -> float:
    """A strategy option that must be a finite number >= ``minimum`` (not a bool or string),
    as a float; ConfigError naming the strategy and option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{strategy} {option} must be a finite number >= {minimum:g}, got "
                          f"{value!r}")
    return float(value)


def option_integer(strategy: str, option: str, value: object, minimum: int = 0) -> int:
    """A strategy option that must be an integer >= ``minimum`` (not a bool, float or string);
    ConfigError naming the strategy and option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{strategy} {option} must be an integer >= {minimum}, got {value!r}")
    return value
