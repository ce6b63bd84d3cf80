"""FedRep (Collins et al. 2021): a shared representation (the body) and a personal head.
Each round a client first trains its head for ``head_epochs`` with the body frozen (10 in the
FedLog paper's MNIST/CIFAR-10 runs, spec fedlog.md §7.1), then the body for the local epochs
with the head frozen; only the body is uploaded and averaged (unweighted, as FedRep's code)."""

from __future__ import annotations

from bayesfl.errors import ConfigError
from bayesfl.strategies.base import StrategyContext
from bayesfl.strategies.parameter_averaging import ParameterAveraging, is_body, is_head, with_epochs
from bayesfl.training import LocalTraining, ParameterFilter


class FedRep(ParameterAveraging):
    """Shared body, personal head; head phase then body phase; unweighted averaging."""

    name = "fedrep"
    weighted = False

    def __init__(self, context: StrategyContext, *, head_epochs: int = 10) -> None:
        super().__init__(context)
        if head_epochs < 0:
            raise ConfigError(f"fedrep head_epochs must be >= 0, got {head_epochs}")
        self.head_epochs = head_epochs

    def shared(self, name: str) -> bool:
        return is_body(name)

    def phases(self) -> list[tuple[ParameterFilter, LocalTraining]]:
        training = self.context.training
        return [(is_head, with_epochs(training, self.head_epochs)), (is_body, training)]
