"""What a run checks at its start, before any data is loaded, that `bayesfl.config` cannot:
the strategy and its option names (the registry, `bayesfl.strategies.registry`) and the
``calibrate`` spec (`bayesfl.calibrate.parse_calibrate`).

The config is the settings schema, below the algorithms: it checks each setting's type and range
and knows no strategy or calibration module (``tests/test_imports.py`` holds it to that). Every
transport calls `check_run_config` as soon as it has a config (the simulator in
`bayesfl.simulate.simulate`, Flower in `bayesfl.flower.protocol.parse_run_config`).
"""

from __future__ import annotations

from bayesfl.calibration_spec import parse_calibrate
from bayesfl.config import SimulationConfig
from bayesfl.strategies.registry import check_option_names


def check_run_config(config: SimulationConfig) -> None:
    """Refuse a config whose strategy, option names or ``calibrate`` spec no run can take.

    The option *values* are checked where the strategy is built
    (`bayesfl.strategies.make_strategy`: the strategy's own checks, then its
    declaration), after the data are loaded, as they were before this check existed.

    Raises:
        ConfigError: an unknown strategy or option (with the nearest valid name), or a
            ``calibrate`` other than None, ``"temperature"`` or ``"temperature:FRACTION"``.
    """
    check_option_names(config.strategy, config.strategy_options)
    parse_calibrate(config.calibrate)


__all__ = ["check_run_config"]
