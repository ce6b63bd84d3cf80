"""Exceptions raised by the calibration package.

Every error subclasses `CalibrationError`; input problems are also ``ValueError`` so
callers that already catch ``ValueError`` keep working.
"""


class CalibrationError(Exception):
    """Base class of every error raised by [`calibration`][calibration]."""


class InvalidInputError(CalibrationError, ValueError):
    """Probabilities, logits or labels that cannot be scored (shape, NaN, range, sum, ...)."""


class FileFormatError(CalibrationError, ValueError):
    """A prediction file that cannot be read safely or lacks the expected keys/columns."""


class CalibrationWarning(UserWarning):
    """Something in the input was set aside or reinterpreted, and the result depends on it
    (e.g. a pandas index column ignored in a CSV file)."""


class NativeKernelError(CalibrationError, RuntimeError):
    """The compiled calibration kernel was required (``BAYESFL_REQUIRE_NATIVE=1``) but could not
    be built or loaded safely."""
