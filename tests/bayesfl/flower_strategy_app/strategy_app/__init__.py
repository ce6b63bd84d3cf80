"""A Flower app whose strategy is defined in the app itself (`.damped_fedavg`)."""
