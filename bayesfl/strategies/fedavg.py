"""FedAvg (McMahan et al. 2017): every client trains the whole network; the server averages
all parameters weighted by client sample counts. Evaluation uses the global network."""

from __future__ import annotations

from bayesfl.strategies.parameter_averaging import ParameterAveraging


class FedAvg(ParameterAveraging):
    """Average the whole network (body and head), weighted by ``n_c``."""

    name = "fedavg"
    weighted = True

    def shared(self, name: str) -> bool:
        return True
