"""The simulator's client executor: runs the client step (`bayesfl.client.step`) over the
clients of one process, alone or in groups.

This is the one place clients are grouped. With ``batched``, clients that share a body spec
(hence one network architecture) are handed to the strategy together
(`fit_group`, ``predict_group``), which may train and
predict them with one vmapped call; without it, every client runs on its own
(`fit`, ``evaluate``). Both give the same numbers up
to float rounding. The client step itself (the divergence guard, the seeds) is the one the
Flower ClientApp runs; here the states live in memory (`MemoryStore`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bayesfl.client.step import (
    TRAINED,
    Fitted,
    LocalClient,
    body_groups,
    evaluate_clients,
    fit_clients,
    personalize_clients,
)
from bayesfl.messages import Message
from bayesfl.strategies.base import ClientState, ClientStrategy, Evaluation
from bayesfl.strategies.halves import client_half


@dataclass
class SimulatedClient(LocalClient):
    """One client as the simulator holds it: its own config, data and (trained) state."""

    state: ClientState


class MemoryStore:
    """The simulator's `ClientStore`: a client's trained state is
    its `SimulatedClient`'s ``state`` (what checkpoints, resumes and the result read);
    other slots (the personalised states) are kept in a dict."""

    def __init__(self, clients: Sequence[SimulatedClient]) -> None:
        self.clients = {c.client_id: c for c in clients}
        self.slots: dict[str, dict[int, ClientState]] = {}

    def load(self, client_id: int, slot: str = TRAINED) -> ClientState:
        if slot == TRAINED:
            return self.clients[client_id].state
        return self.slots[slot][client_id]

    def save(self, client_id: int, state: ClientState, round: int,
             slot: str = TRAINED) -> None:
        if slot == TRAINED:
            self.clients[client_id].state = state
        else:
            self.slots.setdefault(slot, {})[client_id] = state


class ClientExecutor:
    """Runs a strategy's client step over simulated clients (module docstring)."""

    def __init__(self, strategy: ClientStrategy, *, batched: bool) -> None:
        self.strategy = client_half(strategy)  # the client half only (strategies.halves)
        self.batched = batched

    def groups(self, clients: Sequence[SimulatedClient]) -> list[list[SimulatedClient]]:
        """Clients grouped by body spec (first-seen order), or one group each."""
        return body_groups(clients, batched=self.batched)  # type: ignore[return-value]

    def fit(self, clients: Sequence[SimulatedClient], broadcast: Message, *, seed: int,
            round: int) -> Fitted:
        """Every client's local round (`bayesfl.client.step.fit_clients`): updates
        ``client.state`` of the clients whose round went through; their uploads, and why the
        others sent nothing."""
        return fit_clients(self.strategy, clients, MemoryStore(clients), broadcast, seed=seed,
                           round=round, batched=self.batched)

    def evaluate(
        self,
        clients: Sequence[SimulatedClient],
        broadcast: Message,
        *,
        n_bins: int,
        keep_probs: bool,
        states: Mapping[int, ClientState] | None = None,
    ) -> list[Evaluation]:
        """Every client's evaluation (in order), with ``states`` instead of the clients' own
        where given (personalized states)."""
        own = {c.client_id: c.state for c in clients} if states is None else states
        return evaluate_clients(self.strategy, clients, own, broadcast, n_bins=n_bins,
                                keep_probs=keep_probs, batched=self.batched)

    def personalize(
        self,
        clients: Sequence[SimulatedClient],
        broadcast: Message,
        *,
        seed: int,
        round: int,
        on_client: Callable[[int], None] | None = None,
    ) -> dict[int, ClientState]:
        """Every client's personalized state (the clients' own states are left as they are);
        ``on_client(client_id)`` after each (progress)."""
        return personalize_clients(self.strategy, clients, MemoryStore(clients), broadcast,
                                   seed=seed, round=round, on_client=on_client)
