"""A Flower app whose strategy is defined in the app itself (:mod:`.damped_fedavg`)."""
