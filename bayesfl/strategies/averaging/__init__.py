"""Parameter averaging: the strategies that upload (part of) their network's parameters and
aggregate them by a sample-weighted mean — FedAvg (and FedAvg-FT), FedProx, FedPer, FedRep,
LG-FedAvg, FedBABU, local-only training, and FedPart with its layer-group schedule. The shared
machinery is `bayesfl.strategies.averaging.parameter_averaging`; local fine-tuning lives
in `bayesfl.strategies.averaging.finetuning`."""
