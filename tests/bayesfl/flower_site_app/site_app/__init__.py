"""A Flower app for the per-site data loader's tests: bayesfl's apps and a loader."""
