"""The hold-out split of the final steps (``calibrate``, ``conformal``): every client sets aside
a stratified share of its *training* data before training starts, and trains on the rest.

Fitting a temperature or a conformal threshold on rows the model was trained on would reward
overconfidence; fitting it on the test rows would leave no honest test figure. The split is
made once, by `bayesfl.engine.setup.run_setup`, the same on the server and on every node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from bayesfl.data.clients import ClientData, stratified_split


@dataclass(eq=False)
class HeldOut:
    """A client's held-out share of its training data: x (n, ...), y (n,), pooled indices."""

    x: Tensor
    y: Tensor
    indices: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.y.shape[0])


def hold_out(
    clients: Sequence[ClientData], fraction: float, seed: int
) -> tuple[list[ClientData], dict[int, HeldOut]]:
    """Split every client's training data into what it trains on and what it holds out.

    Stratified by label with `bayesfl.data.clients.stratified_split` (the rule of the
    train/test split: ``clip(round(n * fraction), 1, n - 1)`` samples); a client with fewer
    than 2 training samples keeps them all. Seeded by ``seed`` on a stream of its own.

    Returns:
        (the clients with the reduced training data, client id -> its held-out data).
    """
    rng = np.random.default_rng([seed, 12])  # independent of the partition and test split
    kept: list[ClientData] = []
    held: dict[int, HeldOut] = {}
    for data in clients:
        if data.num_train < 2:
            kept.append(data)
            continue
        train, out = stratified_split(data.train_y.cpu().numpy(), fraction, rng)
        train, out = np.sort(train), np.sort(out)
        indices = data.train_indices
        kept.append(ClientData(
            client_id=data.client_id,
            train_x=data.train_x[train], train_y=data.train_y[train],
            test_x=data.test_x, test_y=data.test_y,
            train_indices=None if indices is None else indices[train],
            test_indices=data.test_indices))
        held[data.client_id] = HeldOut(data.train_x[out], data.train_y[out],
                                       None if indices is None else indices[out])
    return kept, held


__all__ = ["HeldOut", "hold_out"]
