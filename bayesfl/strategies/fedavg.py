"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data"): every client trains the whole network; the server averages all
parameters. Evaluation uses the global network.

Aggregation: weighted by the clients' sample counts, w <- sum_c (n_c / n) w_c, as FedAvg's
Algorithm 1 does (n = the participating clients' total).
"""

from __future__ import annotations

from bayesfl.strategies.parameter_averaging import ParameterAveraging


class FedAvg(ParameterAveraging):
    """Average the whole network (body and head), weighted by ``n_c``."""

    name = "fedavg"
    weighted = True
