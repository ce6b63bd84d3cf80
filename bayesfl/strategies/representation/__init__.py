"""Representation sharing: strategies whose clients keep personal networks and share class
representations instead of parameters — CoLearn (prototypes and observation relay), federated
distillation (FD, per-class logits) and FedProto (per-class feature prototypes). Plumbing of
personal networks: `bayesfl.strategies.representation.personal`."""
