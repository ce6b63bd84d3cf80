"""The whole-network Bayesian baselines: FedPA (posterior averaging), FedPop (a population
body with personal Bayesian heads) and pFedBayes (personal and global Gaussian networks)."""
