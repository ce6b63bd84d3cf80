"""How many torch intra-op threads bayesfl's work uses, and a block that sets them.

The models here are small (heads of a few thousand parameters, bodies of a few hundred
thousand), so one operation is too short to share among many threads: on a busy 2-core
machine torch's own default (every core) made a 5-round federated run 2.5x and an MFVI head
fit 8x slower than one thread. `default_threads` is what `inference.fit_head` and
`bayesfl.simulate` use unless told otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

MAX_THREADS = 1024
"""Most torch intra-op threads a fit or run may ask for."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """Half the available cores, at least 1 and at most 4 (module docstring)."""
    return min(4, max(1, available_cores() // 2))


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads, then restore the caller's."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
