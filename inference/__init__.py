"""Posteriors over probabilistic heads: conjugate (FedLog), Laplace / subnet Laplace (FedSI),
MFVI (pyro-ppl) and SGLD, behind one protocol (:class:`inference.posterior.Posterior`).

This package knows nothing about clients, rounds or messages.
"""

from inference.errors import InferenceError, InvalidInputError, MemoryBudgetError, NumericalError
from inference.posterior import Posterior

__all__ = [
    "InferenceError",
    "InvalidInputError",
    "MemoryBudgetError",
    "NumericalError",
    "Posterior",
]
