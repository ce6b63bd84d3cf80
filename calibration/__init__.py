"""Calibration metrics, mergeable accumulators, reliability diagrams and reports.

Takes probabilities (or logits, when told so) and integer labels; knows nothing about
federation or posteriors.
"""

from calibration.errors import CalibrationError, FileFormatError, InvalidInputError

__all__ = ["CalibrationError", "FileFormatError", "InvalidInputError"]
