"""Many clients' tensors as the rows of one tensor.

A batched fit trains K same-architecture clients as one stacked tensor per parameter
``(K, ...)`` and gives each client its row back as a view of that stack (no per-client copy:
64,000 clones, 0.3 s a round, at 16,000 ``mlp:100`` clients). The next stacking of those
clients (the evaluation's forward, the next fit, the checkpoint) then finds the rows already
lying stacked and uses that memory as it is (`stack_rows`) instead of copying 470 MB.

A row view keeps its whole stack alive: a client that is not sampled again holds the stack of
the round it last trained in. `held_bytes` measures what the rows hold against what they
are, so an owner of many clients' states can restack them when the stacks they keep alive
outgrow them (`bayesfl.engine.state.compact_client_states`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def stack_rows(rows: Sequence[Tensor], *, copy: bool = False) -> Tensor:
    """``torch.stack(rows)`` (shape ``(len(rows), *rows[0].shape)``), the same values either
    way; without the copy, as a view of their memory, when ``rows`` already are the
    consecutive rows of one tensor (`consecutive_rows`) and ``copy`` is False.

    ``copy=True``: always new memory (for a caller that writes the stack in place)."""
    if not rows:
        raise ValueError("stack_rows needs at least one row")
    stacked = consecutive_rows(rows)
    if stacked is None:
        return torch.stack(list(rows))
    return stacked.clone() if copy else stacked


def consecutive_rows(rows: Sequence[Tensor]) -> Tensor | None:
    """The tensor whose rows ``rows`` are, as a view of their memory, when every row is
    contiguous, of one shape, dtype and device, in one storage, and row ``i`` begins
    ``i * numel`` elements after row 0 (a stack's `unbind`, or rows of a
    checkpoint's stacked tensor); else None. Checks attributes only (no data is read)."""
    first = rows[0]
    size, offset = first.numel(), first.storage_offset()
    if not size or not first.is_contiguous():
        return None
    base = first.untyped_storage().data_ptr()
    shape, dtype, device = first.shape, first.dtype, first.device
    for i, t in enumerate(rows):
        if (t.storage_offset() != offset + i * size or t.shape != shape or t.dtype != dtype
                or t.device != device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base):
            return None
    return first.as_strided((len(rows), *shape), (size, *first.stride()), offset)


def held_bytes(tensors: Iterable[Tensor]) -> tuple[int, int]:
    """(the bytes of ``tensors`` themselves, the bytes of the distinct storages they keep
    alive): equal for tensors that each own their memory; a row view of a stack counts the
    whole stack once, however many of its rows are given."""
    own = 0
    storages: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        size = t.element_size()
        own += t.numel() * size
        # the storage's address from the tensor's own (no storage object per tensor: a
        # simulator holds 64,000 of them); the storage itself only for one not seen yet
        key = (t.device, t.data_ptr() - t.storage_offset() * size)
        if key not in storages:
            storages[key] = t.untyped_storage().nbytes()
    return own, sum(storages.values())


def row_views(stacked: Tensor) -> list[Tensor]:
    """The rows of ``stacked`` as views sharing its memory (detached): what a batched fit
    gives each client back."""
    return list(stacked.detach().unbind(0))


__all__ = ["consecutive_rows", "held_bytes", "row_views", "stack_rows"]
