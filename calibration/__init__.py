"""Calibration metrics, mergeable accumulators, reliability diagrams and reports; uncertainty
scores, out-of-distribution detection and selective-prediction metrics.

Takes probabilities (or logits, when told so) and integer labels; knows nothing about
federation or posteriors. Plotting (seaborn) is imported only when a diagram is drawn.
"""

from typing import Any

from calibration.accumulator import Accumulator
from calibration.bin_stats import BinStats
from calibration.binning import Binning
from calibration.bootstrap import ECEInterval, bootstrap_ece
from calibration.conformal import (
    ConformalScore,
    CoverageAccumulator,
    conformal_threshold,
    conformity_scores,
    prediction_sets,
)
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
from calibration.ood import AurocAccumulator, ScoreCounts, aupr, auroc, fpr_at_tpr, ood_report
from calibration.prediction_files import Predictions, load_predictions
from calibration.report import CalibrationReport, ReportRow, report
from calibration.selective import (
    accuracy_at_coverage,
    aurc,
    e_aurc,
    optimal_aurc,
    risk_coverage,
)
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
from calibration.uncertainty import (
    entropy_decomposition,
    max_probability,
    ood_scores,
    predictive_entropy,
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
    "AurocAccumulator",
    "BinStats",
    "Binning",
    "CalibrationError",
    "CalibrationReport",
    "CalibrationWarning",
    "ConformalScore",
    "CoverageAccumulator",
    "ECEInterval",
    "FileFormatError",
    "InvalidInputError",
    "NLLDerivatives",
    "NativeKernelError",
    "Predictions",
    "ReportRow",
    "ScoreCounts",
    "SmoothECE",
    "SmoothReliabilityCurve",
    "TemperatureAtBoundWarning",
    "TemperatureFit",
    "TemperatureReport",
    "accuracy",
    "accuracy_at_coverage",
    "apply_temperature",
    "aupr",
    "aurc",
    "auroc",
    "bootstrap_ece",
    "brier",
    "classwise_ece",
    "conformal_threshold",
    "conformity_scores",
    "e_aurc",
    "ece",
    "entropy_decomposition",
    "evaluate",
    "fit_temperature",
    "fpr_at_tpr",
    "l2_calibration_error",
    "load_predictions",
    "max_probability",
    "mce",
    "minimize_temperature",
    "nll",
    "nll_derivatives",
    "ood_report",
    "ood_scores",
    "optimal_aurc",
    "positive_class_ece",
    "positive_class_stats",
    "prediction_sets",
    "predictive_entropy",
    "reliability_diagram",
    "reliability_stats",
    "report",
    "risk_coverage",
    "save_figure",
    "smooth_calibration_error",
    "smooth_ece",
    "smooth_ece_details",
    "smooth_reliability_curve",
    "temperature_report",
    "temperature_search",
]
