"""LG-FedAvg (Liang et al. 2020): local representations, global head. The body stays on the
client (so bodies may differ between clients), the linear head is averaged. Local training
updates both; averaging is unweighted over the participating clients (LG-FedAvg's code).
The FedLog paper's "LG-FedAvg 1" (one global layer) is this configuration."""

from __future__ import annotations

from bayesfl.strategies.parameter_averaging import ParameterAveraging, is_head


class LGFedAvg(ParameterAveraging):
    """Personal body, shared head, joint local training, unweighted averaging."""

    name = "lg-fedavg"
    weighted = False

    def shared(self, name: str) -> bool:
        return is_head(name)
