"""The ground floor of every setting check: integers, numbers and values in words.

These three helpers are what `bayesfl.config` (the run's settings) and the data sets'
option checks (`bayesfl.data.datasets.check_dataset_options`) both use. They live apart
from `bayesfl.config` because that module checks strategy, data set and calibration
names against their registries, which sit above the data sets: a data set importing
`bayesfl.config` would close an import cycle. This module imports nothing of bayesfl
but its errors.
"""

from __future__ import annotations

import numbers
from typing import Any

from bayesfl.errors import ConfigError


def check_integer(name: str, value: Any, low: int, high: int | None) -> int:
    """``value`` as a Python int in ``[low, high]`` (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {describe(value)}")
    number = int(value)
    if number < low or (high is not None and number > high):
        valid = f">= {low}" if high is None else f"between {low} and {high:,}"
        raise ConfigError(f"{name} must be {valid}, got {number:,}")
    return number


def check_number(name: str, value: Any) -> float:
    """``value`` (an int or float, not a bool) as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {describe(value)}")
    return float(value)


def describe(value: Any) -> str:
    """``value`` and its type in words, for error messages (TOML users see these names)."""
    kinds = {bool: "a boolean", str: "a string", float: "a float", int: "an integer",
             list: "a list", dict: "a table", type(None): "nothing"}
    kind = next((v for k, v in kinds.items() if isinstance(value, k)),
                f"a {type(value).__name__}")
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({kind})"


__all__ = ["check_integer", "check_number", "describe"]
