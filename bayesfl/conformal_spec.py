"""The ``conformal`` run setting, parsed: ``"SCORE:ALPHA[:METHOD]"`` into a `ConformalSpec`.

Kept apart from the step itself (`bayesfl.conformal`, which speaks messages and the
strategies' predictives) so that the run's settings (`bayesfl.config`) can check the value
without importing any strategy: the settings schema sits below the algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bayesfl.errors import ConfigError
from calibration.conformal import ConformalScore, check_alpha
from calibration.errors import CalibrationError

SCORE_NAMES = {"lac": ConformalScore("lac"), "aps": ConformalScore("aps"),
               "aps-randomized": ConformalScore("aps", randomized=True),
               "raps": ConformalScore("raps"),
               "raps-randomized": ConformalScore("raps", randomized=True)}
"""The scores ``conformal=`` names (RAPS with ``k_reg = 1``, ``lam = 0.01``)."""
METHODS = ("exact", "one-shot", "sketch")
"""How the threshold is found: the exact federated search, one-shot quantile of quantiles
(FedCP-QQ; its bound assumes exchangeable clients), or the one-shot quantile sketch (at or above
the pooled threshold whatever the clients' heterogeneity)."""


@dataclass(frozen=True)
class ConformalSpec:
    """A parsed ``conformal`` setting."""

    name: str
    score: ConformalScore
    alpha: float
    method: str = "exact"


def parse_conformal(value: Any) -> ConformalSpec | None:
    """``None`` or ``"SCORE:ALPHA[:METHOD]"`` (e.g. ``"aps:0.1"``, ``"lac:0.05:one-shot"``,
    ``"lac:0.1:sketch"``; METHOD in `METHODS`, default ``exact``).

    Raises:
        ConfigError: an unknown score or method, or alpha outside (0, 1).
    """
    if value is None:
        return None
    example = "e.g. 'aps:0.1', 'lac:0.05', 'raps:0.1:one-shot' or 'lac:0.1:sketch'"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"conformal must be None or SCORE:ALPHA[:METHOD] ({example}); got "
                          f"{value!r}")
    parts = value.strip().split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(f"conformal={value!r} must be SCORE:ALPHA[:METHOD] ({example})")
    name, alpha_text = parts[0], parts[1]
    if name not in SCORE_NAMES:
        raise ConfigError(f"unknown conformal score {name!r}; valid: {', '.join(SCORE_NAMES)}")
    try:
        alpha = check_alpha(float(alpha_text))
    except (ValueError, CalibrationError):
        raise ConfigError(f"the alpha in conformal={value!r} must be a number in (0, 1), the "
                          "miscoverage level (0.1 for 90% sets)") from None
    method = parts[2] if len(parts) == 3 else "exact"
    if method not in METHODS:
        raise ConfigError(f"unknown conformal method {method!r}; valid: {', '.join(METHODS)}")
    return ConformalSpec(name, SCORE_NAMES[name], alpha, method)


__all__ = ["METHODS", "SCORE_NAMES", "ConformalSpec", "parse_conformal"]
