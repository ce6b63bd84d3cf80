"""The simulator's client executor: runs the client halves of one round, alone or in groups.

This is the one place clients are grouped. With ``batched``, clients that share a body spec
(hence one network architecture) are handed to the strategy together
(:meth:`~bayesfl.strategies.base.Strategy.fit_group`, ``predict_group``), which may train and
predict them with one vmapped call; without it, every client runs on its own
(:meth:`~bayesfl.strategies.base.Strategy.fit`, ``evaluate``). Both give the same numbers up
to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from bayesfl.data.clients import ClientData
from bayesfl.messages import Message
from bayesfl.strategies.base import ClientConfig, ClientState, Evaluation, Strategy


@dataclass
class SimulatedClient:
    """One client as the simulator holds it: its own config, data and state."""

    config: ClientConfig
    data: ClientData
    state: ClientState

    @property
    def client_id(self) -> int:
        return self.config.client_id

    @property
    def body_spec(self) -> str:
        return self.config.body


class ClientExecutor:
    """Runs a strategy's client halves over simulated clients (module docstring)."""

    def __init__(self, strategy: Strategy, *, batched: bool) -> None:
        self.strategy = strategy
        self.batched = batched

    def groups(self, clients: Sequence[SimulatedClient]) -> list[list[SimulatedClient]]:
        """Clients grouped by body spec (first-seen order), or one group each."""
        if not self.batched:
            return [[c] for c in clients]
        groups: dict[str, list[SimulatedClient]] = {}
        for c in clients:
            groups.setdefault(c.body_spec, []).append(c)
        return list(groups.values())

    def fit(
        self,
        clients: Sequence[SimulatedClient],
        broadcast: Message,
        generators: Mapping[int, torch.Generator],
    ) -> list[Message]:
        """Every client's local round; updates ``client.state``; the uploads in order."""
        uploads: dict[int, Message] = {}
        for group in self.groups(clients):
            if self.batched:
                results = self.strategy.fit_group(
                    [c.config for c in group], [c.state for c in group],
                    [c.data for c in group], broadcast, [generators[c.client_id] for c in group])
            else:
                (c,) = group
                results = [self.strategy.fit(c.config, c.state, c.data, broadcast,
                                             generators[c.client_id])]
            for c, (state, upload) in zip(group, results, strict=True):
                c.state = state
                uploads[c.client_id] = upload
        return [uploads[c.client_id] for c in clients]

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
        out: dict[int, Evaluation] = {}

        def state_of(c: SimulatedClient) -> ClientState:
            return c.state if states is None else states[c.client_id]

        for group in self.groups(clients):
            evaluations = self.strategy.evaluate_group(
                [c.config for c in group], [state_of(c) for c in group],
                [c.data for c in group], broadcast, n_bins=n_bins, keep_probs=keep_probs)
            out.update({e.client_id: e for e in evaluations})
        return [out[c.client_id] for c in clients]

    def personalize(
        self,
        clients: Sequence[SimulatedClient],
        broadcast: Message,
        generators: Mapping[int, torch.Generator],
        on_client: Callable[[int], None] | None = None,
    ) -> dict[int, ClientState]:
        """Every client's personalized state (the clients' own states are left as they are);
        ``on_client(client_id)`` after each (progress)."""
        states = {}
        for c in clients:
            states[c.client_id] = self.strategy.personalize(c.config, c.state, c.data, broadcast,
                                                            generators[c.client_id])
            if on_client is not None:
                on_client(c.client_id)
        return states
