"""Calibration metrics, mergeable accumulators, reliability diagrams and reports.

Takes probabilities (or logits, when told so) and integer labels; knows nothing about
federation or posteriors. Plotting (seaborn) is imported only when a diagram is drawn.
"""

from typing import Any

from calibration.accumulator import Accumulator
from calibration.bin_stats import BinStats
from calibration.binning import Binning
from calibration.bootstrap import ECEInterval, bootstrap_ece
from calibration.errors import CalibrationError, FileFormatError, InvalidInputError
from calibration.metrics import (
    accuracy,
    brier,
    classwise_ece,
    ece,
    evaluate,
    l2_calibration_error,
    mce,
    nll,
    positive_class_ece,
    positive_class_stats,
    reliability_stats,
)
from calibration.prediction_files import Predictions, load_predictions
from calibration.report import CalibrationReport, ReportRow, report

_PLOTTING = {"reliability_diagram", "save_figure"}


def __getattr__(name: str) -> Any:
    # seaborn/matplotlib take seconds to import; metrics users should not pay for them.
    if name in _PLOTTING:
        from calibration import diagram

        return getattr(diagram, name)
    raise AttributeError(f"module 'calibration' has no attribute {name!r}")


__all__ = [
    "Accumulator",
    "BinStats",
    "Binning",
    "CalibrationError",
    "CalibrationReport",
    "ECEInterval",
    "FileFormatError",
    "InvalidInputError",
    "Predictions",
    "ReportRow",
    "accuracy",
    "bootstrap_ece",
    "brier",
    "classwise_ece",
    "ece",
    "evaluate",
    "l2_calibration_error",
    "load_predictions",
    "mce",
    "nll",
    "positive_class_ece",
    "positive_class_stats",
    "reliability_diagram",
    "reliability_stats",
    "report",
    "save_figure",
]
