"""The ``calibrate`` setting: `parse_calibrate` and its `CalibrationSpec`.

A small module of its own so that what reads a run's settings (the run config, the CLI, the
Flower run config) parses the setting without importing the step itself
(`bayesfl.calibrate`), as `bayesfl.conformal_spec` does for ``conformal``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bayesfl.errors import ConfigError

METHODS = ("temperature",)
"""Calibration steps a run can end with."""
DEFAULT_HELD_OUT_FRACTION = 0.2
"""Share of each client's training data held out to fit T, unless the spec gives one."""


@dataclass(frozen=True)
class CalibrationSpec:
    """A parsed ``calibrate`` setting: the method and the held-out share of training data."""

    method: str
    held_out_fraction: float = DEFAULT_HELD_OUT_FRACTION


def parse_calibrate(value: Any) -> CalibrationSpec | None:
    """``None`` (no calibration step) or ``"temperature"`` / ``"temperature:FRACTION"``.

    Raises:
        ConfigError: another method, or a fraction outside (0, 1).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"calibrate must be None or one of {METHODS} (optionally "
                          f"'temperature:FRACTION'), got {value!r}")
    method, sep, fraction_text = value.strip().partition(":")
    if method not in METHODS:
        raise ConfigError(f"unknown calibrate method {method!r}; valid: {', '.join(METHODS)} "
                          "(e.g. 'temperature' or 'temperature:0.2')")
    if not sep:
        return CalibrationSpec(method)
    try:
        fraction = float(fraction_text)
    except ValueError:
        fraction = math.nan
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"the held-out fraction in calibrate={value!r} must be a number in "
                          "(0, 1), e.g. 'temperature:0.2'")
    return CalibrationSpec(method, fraction)


__all__ = ["DEFAULT_HELD_OUT_FRACTION", "METHODS", "CalibrationSpec", "parse_calibrate"]
