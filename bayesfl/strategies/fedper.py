"""FedPer (Arivazhagan et al. 2019): base layers are federated, personalisation layers stay
on the client. Here the body is shared and the linear head is personal; local training
updates both jointly; the server averages the bodies weighted by sample counts (as FedAvg)."""

from __future__ import annotations

from bayesfl.strategies.parameter_averaging import ParameterAveraging, is_body


class FedPer(ParameterAveraging):
    """Shared body, personal head, joint local training, weighted averaging."""

    name = "fedper"
    weighted = True

    def shared(self, name: str) -> bool:
        return is_body(name)
