"""The FedSI family: linearised-Laplace posteriors over a client-chosen subnetwork of a shared
body, aggregated as Gaussians (FedSI and FedSI-Fac), in `bayesfl.strategies.fedsi.fedsi`."""
