"""Exceptions raised by the inference package.

Every error subclasses `InferenceError`; bad input is also a ``ValueError``.
"""


class InferenceError(Exception):
    """Base class of every error raised by [`inference`][inference]."""


class InvalidInputError(InferenceError, ValueError):
    """Features, labels, statistics, priors or options that the method cannot accept."""


class NumericalError(InferenceError, ArithmeticError):
    """A solve, factorisation or sampler that diverged or produced non-finite values."""


class MemoryBudgetError(InferenceError, MemoryError):
    """A Jacobian, Hessian or covariance that would not fit in the memory available."""


class UnknownOptionError(InvalidInputError, TypeError):
    """An option name the chosen method does not take (also a ``TypeError``, as Python raises
    for an unexpected keyword argument)."""


class PosteriorFileError(InferenceError, ValueError):
    """A posterior file that cannot be read or does not hold a valid posterior: missing, not a
    regular file, too large, truncated, corrupted (checksum mismatch), of another format or
    schema version, or holding values no posterior can have (NaN, a precision that is not
    positive definite). The message names the file and what to do."""
