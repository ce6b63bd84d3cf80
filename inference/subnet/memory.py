"""Memory preflight: estimate the bytes of a Jacobian or Hessian before allocating it.

laplace-torch users ask for exactly this (Laplace#81, #281, #232): an error that says "this
needs X, you have Y, change Z" instead of an out-of-memory crash deep inside ``jacrev``.

Available memory is read from ``torch.cuda.mem_get_info`` on a CUDA device, otherwise from
``psutil`` when installed, otherwise from ``MemAvailable`` in ``/proc/meminfo``. Every public
function here takes ``max_memory_bytes`` to override the probe (tests, or a user who wants to
keep headroom for something else).
"""

from __future__ import annotations

import os

import torch

from inference.errors import MemoryBudgetError

__all__ = [
    "available_memory_bytes",
    "check_memory",
    "format_bytes",
    "tensor_bytes",
]

# Fraction of the available memory a single allocation plan may use: the rest is headroom for
# the model's activations, the allocator's fragmentation and other processes.
USABLE_FRACTION = 0.8


def format_bytes(n_bytes: float) -> str:
    """Human-readable size, e.g. ``'1.50 GiB'``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024.0
    return f"{value:.2f} TiB"  # pragma: no cover - loop always returns


def tensor_bytes(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _host_available_bytes() -> int:
    try:
        import psutil  # optional dependency

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Last resort (non-Linux without psutil): physical pages, an over-estimate of what is free.
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def available_memory_bytes(device: torch.device | str | None = None) -> int:
    """Memory currently available on ``device`` (host RAM for CPU), in bytes."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _host_available_bytes()


def check_memory(
    plan: dict[str, int],
    *,
    device: torch.device | str | None,
    advice: str,
    max_memory_bytes: int | None = None,
) -> int:
    """Raise `MemoryBudgetError` when the allocations in ``plan`` would not fit.

    Args:
        plan: name of each allocation -> its size in bytes (they are assumed alive together).
        device: where they will be allocated.
        advice: what the user can change, appended to the message.
        max_memory_bytes: the budget; ``None`` probes the device and keeps
            ``USABLE_FRACTION`` of what is available.

    Returns:
        The total bytes of the plan.
    """
    total = sum(int(v) for v in plan.values())
    if max_memory_bytes is None:
        budget = int(USABLE_FRACTION * available_memory_bytes(device))
        source = f"{USABLE_FRACTION:.0%} of the memory available on {torch.device(device or 'cpu')}"
    else:
        budget = int(max_memory_bytes)
        source = "max_memory_bytes"
    if total > budget:
        items = ", ".join(f"{name} {format_bytes(b)}" for name, b in plan.items())
        raise MemoryBudgetError(
            f"needs {format_bytes(total)} ({items}) but the budget is {format_bytes(budget)} "
            f"({source}). {advice}"
        )
    return total
