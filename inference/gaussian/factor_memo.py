"""Factorisations of dense total precisions, remembered for the state tensors they belong to.

Why (issue 41). A strategy keeps a client's head posterior as the tensors of its
``state_dict()`` and rebuilds it with ``from_state_dict`` for every prediction. Rebuilt, the
posterior factorised its total precision again and inverted it for the logit covariances: on
S1's 1,010-parameter heads a Cholesky factorisation and an inverse, ~30 of the ~45 ms a client's
prediction of its 250 test rows took. The posterior the fit returned has both at hand
(`FullPrecision.adopt_factor`).

How. `remember` keeps that factor and inverse beside weak references to the state tensors of
the posterior's two terms and their version counters; `recall` gives them back only for those
very tensor objects, none modified in place since (the same ``_version``). A posterior rebuilt
from them forms its total precision as the same sum of the same numbers, so the factor is its
own bit for bit: its predictions are the ones it would compute, without the factorisation.
Tensors read back from a file or a message are new objects and are never matched; nothing is
trusted that was not computed in this process.

Bounds. At most `BUDGET_BYTES` are held (the least recently used entries go first), and an
entry goes once one of its tensors is freed: the memo never keeps a client's state alive. A
lock guards the entries; a freed tensor's weak-reference callback, which may run in any thread
(a checkpoint writer's) or inside a garbage collection that interrupts the memo's own code,
only notes the entry, and the next call removes it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

#: The memo's size at most, bytes (factor and inverse: 16 MB for a 1,010-parameter head, so
#: 16 such heads; a 5,130-parameter head's 421 MB is not kept).
BUDGET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Entry:
    references: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    chol: Tensor
    covariance: Tensor | None
    nbytes: int


_ENTRIES: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
_LOCK = threading.Lock()
#: Keys of entries one of whose tensors was freed (appended by the callbacks; `_purge` removes
#: those entries under the lock).
_FREED: list[tuple[int, ...]] = []


def _key(tensors: Sequence[Tensor]) -> tuple[int, ...]:
    return tuple(id(t) for t in tensors)


def _versioned(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor has a version counter (inference-mode tensors have none: a change
    in place could not be seen, so they are never remembered)."""
    return not any(t.is_inference() for t in tensors)


def _forget(key: tuple[int, ...]) -> None:
    _FREED.append(key)  # atomic; no lock taken in a callback


def _purge() -> None:
    """Remove the entries a freed tensor left (the caller holds the lock). A key is checked
    before its entry goes: an id may be a new tensor's by now, with an entry of its own."""
    while _FREED:
        key = _FREED.pop()
        entry = _ENTRIES.get(key)
        if entry is not None and any(reference() is None for reference in entry.references):
            del _ENTRIES[key]


def remember(tensors: Sequence[Tensor], chol: Tensor, covariance: Tensor | None) -> None:
    """Keep ``chol`` (and ``covariance``, its inverse, or None) of the total precision the
    state ``tensors`` define, for `recall` on the same tensor objects."""
    nbytes = chol.nbytes + (0 if covariance is None else covariance.nbytes)
    if nbytes > BUDGET_BYTES or not _versioned(tensors):
        return
    key = _key(tensors)
    references = tuple(weakref.ref(t, lambda _, key=key: _forget(key)) for t in tensors)
    entry = _Entry(references, tuple(t._version for t in tensors), chol, covariance, nbytes)
    with _LOCK:
        _purge()
        _ENTRIES.pop(key, None)
        _ENTRIES[key] = entry
        while sum(e.nbytes for e in _ENTRIES.values()) > BUDGET_BYTES:
            _ENTRIES.popitem(last=False)


def recall(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor | None] | None:
    """``(chol, covariance)`` remembered for exactly these tensor objects, unmodified since;
    else None."""
    key = _key(tensors)
    with _LOCK:
        _purge()
        entry = _ENTRIES.get(key)
        if entry is None:
            return None
        # (an inference-mode tensor is never remembered, so it fails the identity test before
        # its missing version counter is read)
        same = all(reference() is t and t._version == version for reference, t, version
                   in zip(entry.references, tensors, entry.versions, strict=True))
        if not same:  # modified in place, or an id reused: stale
            del _ENTRIES[key]
            return None
        _ENTRIES.move_to_end(key)
        return entry.chol, entry.covariance


def held_bytes() -> int:
    """Bytes the memo holds now."""
    with _LOCK:
        _purge()
        return sum(entry.nbytes for entry in _ENTRIES.values())


__all__ = ["BUDGET_BYTES", "held_bytes", "recall", "remember"]
