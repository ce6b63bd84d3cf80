"""A Flower app running bayesfl (the ServerApp and ClientApp come from bayesfl.flower)."""
