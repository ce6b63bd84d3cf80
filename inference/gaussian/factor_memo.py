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
entry goes as soon as one of its tensors is freed: the memo never keeps a client's state alive.
Not thread-safe: a run predicts its clients one after another.
"""

from __future__ import annotations

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


def _key(tensors: Sequence[Tensor]) -> tuple[int, ...]:
    return tuple(id(t) for t in tensors)


def _versioned(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor has a version counter (inference-mode tensors have none: a change
    in place could not be seen, so they are never remembered)."""
    return not any(t.is_inference() for t in tensors)


def _forget(key: tuple[int, ...]) -> None:
    _ENTRIES.pop(key, None)


def remember(tensors: Sequence[Tensor], chol: Tensor, covariance: Tensor | None) -> None:
    """Keep ``chol`` (and ``covariance``, its inverse, or None) of the total precision the
    state ``tensors`` define, for `recall` on the same tensor objects."""
    nbytes = chol.nbytes + (0 if covariance is None else covariance.nbytes)
    if nbytes > BUDGET_BYTES or not _versioned(tensors):
        return
    key = _key(tensors)
    references = tuple(weakref.ref(t, lambda _, key=key: _forget(key)) for t in tensors)
    _ENTRIES.pop(key, None)
    _ENTRIES[key] = _Entry(references, tuple(t._version for t in tensors), chol, covariance,
                           nbytes)
    while sum(entry.nbytes for entry in _ENTRIES.values()) > BUDGET_BYTES:
        _ENTRIES.popitem(last=False)


def recall(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor | None] | None:
    """``(chol, covariance)`` remembered for exactly these tensor objects, unmodified since;
    else None."""
    key = _key(tensors)
    entry = _ENTRIES.get(key)
    if entry is None or not _versioned(tensors):
        return None
    same = all(reference() is t and t._version == version for reference, t, version
               in zip(entry.references, tensors, entry.versions, strict=True))
    if not same:
        _ENTRIES.pop(key)
        return None
    _ENTRIES.move_to_end(key)
    return entry.chol, entry.covariance


def held_bytes() -> int:
    """Bytes the memo holds now."""
    return sum(entry.nbytes for entry in _ENTRIES.values())


__all__ = ["BUDGET_BYTES", "held_bytes", "recall", "remember"]
