"""Exceptions raised by the inference package.

Every error subclasses :class:`InferenceError`; bad input is also a ``ValueError``.
"""


class InferenceError(Exception):
    """Base class of every error raised by :mod:`inference`."""


class InvalidInputError(InferenceError, ValueError):
    """Features, labels, statistics, priors or options that the method cannot accept."""


class NumericalError(InferenceError, ArithmeticError):
    """A solve, factorisation or sampler that diverged or produced non-finite values."""


class MemoryBudgetError(InferenceError, MemoryError):
    """A Jacobian, Hessian or covariance that would not fit in the memory available."""
