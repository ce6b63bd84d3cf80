"""Shared test configuration: headless plotting (no display on CI machines); under
pytest-xdist (``make test`` runs one worker per core) each worker's torch gets its share of the
cores, so that the workers' thread pools do not oversubscribe them."""

import os

import matplotlib

matplotlib.use("Agg")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
