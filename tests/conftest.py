"""Shared test configuration: headless plotting (no display on CI machines); under
pytest-xdist (``make test`` runs one worker per core) each worker's torch gets its share of the
cores, so that the workers' thread pools do not oversubscribe them; torch's global random
stream seeded for each test from its own name."""

import os
import zlib

import matplotlib
import pytest

matplotlib.use("Agg")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _torch_seeded_by_test_name(request):
    """Seed torch's global random stream for each test from the test's id (CRC-32 of it).

    pytest-randomly reseeds ``random`` and numpy before each test but not torch, whose stream a
    worker otherwise carries from test to test: what a test drew from it then depended on
    which tests ran before it in the same xdist worker, that is on the run's shuffled order,
    and ``make test SEED=...`` did not repeat it (a conjugate-probit test passed or failed with
    the order, issue 41's session 9). Seeded by name, every test draws the same numbers in any
    order, on any worker, in every run."""
    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the ``slow`` tests first, then the rest, each group in
    pytest-randomly's order (a stable sort on top of its shuffle, so a seed still repeats an
    order). ``make test`` hands the tests out one at a time in this order (``--dist load
    --maxschedchunk 1``), so the workers start the long ones first and end together on short
    ones, instead of one worker starting a minutes-long test near the end while the other runs
    out of work. (The Flower deployments are not put first together: two at once on a busy
    2-core machine only crowd each other's processes against their round timeouts.)"""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
