"""The FedLog family: conjugate exponential-family heads on frozen or locally trained bodies,
aggregated exactly from summed sufficient statistics (FedLog, FedLog-C and the two
differentially private variants), in `bayesfl.strategies.fedlog.fedlog`."""
