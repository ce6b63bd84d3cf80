"""Conjugate-head tests run single-threaded: on a loaded 2-core machine torch's spinning
intra-op threads make the float64 reference solves an order of magnitude slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
