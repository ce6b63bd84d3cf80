"""Calibration metrics, mergeable accumulators, reliability diagrams and reports.

Takes probabilities (or logits, when told so) and integer labels; knows nothing about
federation or posteriors. Plotting (seaborn) is imported only when a diagram is drawn.
"""

from typing import Any

from calibration.accumulator import Accumulator
from calibration.bin_stats import BinStats
from calibration.binning import Binning
from calibration.bootstrap import ECEInterval, bootstrap_ece
from calibration.errors import (
    CalibrationError,
    CalibrationWarning,
    FileFormatError,
    InvalidInputError,
    NativeKernelError,
)
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
from calibration.smooth_ece import (
    SmoothECE,
    SmoothReliabilityCurve,
    smooth_calibration_error,
    smooth_ece,
    smooth_ece_details,
    smooth_reliability_curve,
)
from calibration.temperature import (
    NLLDerivatives,
    TemperatureAtBoundWarning,
    TemperatureFit,
    TemperatureReport,
    apply_temperature,
    fit_temperature,
    minimize_temperature,
    nll_derivatives,
    temperature_report,
    temperature_search,
)

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
    "CalibrationWarning",
    "ECEInterval",
    "FileFormatError",
    "InvalidInputError",
    "NLLDerivatives",
    "NativeKernelError",
    "Predictions",
    "ReportRow",
    "SmoothECE",
    "SmoothReliabilityCurve",
    "TemperatureAtBoundWarning",
    "TemperatureFit",
    "TemperatureReport",
    "accuracy",
    "apply_temperature",
    "bootstrap_ece",
    "brier",
    "classwise_ece",
    "ece",
    "evaluate",
    "fit_temperature",
    "l2_calibration_error",
    "load_predictions",
    "mce",
    "minimize_temperature",
    "nll",
    "nll_derivatives",
    "positive_class_ece",
    "positive_class_stats",
    "reliability_diagram",
    "reliability_stats",
    "report",
    "save_figure",
    "smooth_calibration_error",
    "smooth_ece",
    "smooth_ece_details",
    "smooth_reliability_curve",
    "temperature_report",
    "temperature_search",
]
