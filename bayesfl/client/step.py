"""The client step, written once: what a client does with a round's message, on every transport.

The simulator's executor (`bayesfl.executor.ClientExecutor`, many clients in one process,
grouped by body when batched) and the Flower ClientApp (`bayesfl.flower.client_app`, one
client per SuperNode, a fresh process per message) both call these functions; they differ only
in where a client's state lives (`ClientStore`: in memory in the simulator,
``Context.state`` on Flower) and how the replies travel.

* `fit_clients`: each client's local round with its generator of the round
  (`fit_generators`) under the divergence guard
  (`bayesfl.training.watch_divergence`): a client whose local computation went non-finite
  keeps its state from before the round and sends nothing (`Fitted.diverged` says why);
  the others' states are saved and their uploads returned.
* `personalize_clients`: each client's personalised state, drawn with its personalisation
  generator (`personalize_generator`), saved under `PERSONALIZED`.
* `evaluate_clients`: each client's calibration accumulators on its test set.

Each function holds the strategy through its client half only
(`bayesfl.strategies.halves.client_half`): a server-half method is not there to call.

The seeds (`bayesfl.client.seeds`): client ``c``'s generator of round ``r`` is seeded with
``derived_seed(seed, r, c)`` and its personalisation generator with
``derived_seed(seed, PERSONALIZE_SEED_KEY, c)``, so a client draws the same numbers wherever it
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bayesfl.client.seeds import fit_generators, personalize_generator
from bayesfl.data.clients import ClientData
from bayesfl.messages import Message
from bayesfl.strategies.base import ClientConfig, ClientState, ClientStrategy, Evaluation
from bayesfl.strategies.halves import client_half
from bayesfl.training import watch_divergence

TRAINED = "trained"
"""Slot of a client's trained state (after its last fit)."""
PERSONALIZED = "personalized"
"""Slot of a client's personalised state (after the run's personalisation)."""


class ClientStore(Protocol):
    """Where clients' states live between messages: the one thing a transport provides to the
    client step. The simulator keeps them in memory (`bayesfl.executor.MemoryStore`);
    Flower in the node's ``Context.state`` (``bayesfl.flower.client_app.ContextStore``)."""

    def load(self, client_id: int, slot: str = TRAINED) -> ClientState:
        """Client ``client_id``'s state in ``slot`` (its initial state when it has none)."""
        ...

    def save(self, client_id: int, state: ClientState, round: int,
             slot: str = TRAINED) -> None:
        """Keep ``state`` as client ``client_id``'s state in ``slot``, as of round ``round``."""
        ...


@dataclass
class LocalClient:
    """One client as a client step sees it: its config and its own data."""

    config: ClientConfig
    data: ClientData

    @property
    def client_id(self) -> int:
        return self.config.client_id

    @property
    def body_spec(self) -> str:
        return self.config.body


@dataclass
class Fitted:
    """What `fit_clients` did.

    Attributes:
        uploads: client id -> its upload, for the clients whose round went through (in the
            order the clients were given).
        diverged: client id -> why its local computation stopped (a non-finite loss): it sends
            nothing and keeps its state from before the round.
    """

    uploads: dict[int, Message] = field(default_factory=dict)
    diverged: dict[int, str] = field(default_factory=dict)


def body_groups(clients: Sequence[LocalClient], *, batched: bool) -> list[list[LocalClient]]:
    """Clients grouped by body spec (first-seen order) when ``batched``, else one group each:
    a group shares one network architecture, so a strategy may train or predict it at once."""
    if not batched:
        return [[c] for c in clients]
    groups: dict[str, list[LocalClient]] = {}
    for c in clients:
        groups.setdefault(c.body_spec, []).append(c)
    return list(groups.values())


def fit_clients(strategy: ClientStrategy, clients: Sequence[LocalClient], store: ClientStore,
                broadcast: Message, *, seed: int, round: int, batched: bool = False) -> Fitted:
    """Every client's local round on ``broadcast`` (module docstring).

    Each client fits from its `TRAINED` state in ``store`` with its generator of the
    round; with ``batched``, clients of one body spec go to
    `fit_group` together, else each to
    `fit` (the same numbers up to float rounding).
    Within the divergence guard: a client whose training stopped on a non-finite value is in
    `Fitted.diverged` with the reason, its new state is not saved and it uploads
    nothing; every other client's state is saved for round ``round`` and its upload returned.
    """
    strategy = client_half(strategy)  # the client step sees the client half only
    generators = fit_generators(seed, round, [c.client_id for c in clients])
    results: dict[int, tuple[ClientState, Message]] = {}
    with watch_divergence() as stopped:
        for group in body_groups(clients, batched=batched):
            states = [store.load(c.client_id) for c in group]
            if batched:
                out = strategy.fit_group([c.config for c in group], states,
                                         [c.data for c in group], broadcast,
                                         [generators[c.client_id] for c in group])
            else:
                (c,), (state,) = group, states
                out = [strategy.fit(c.config, state, c.data, broadcast,
                                    generators[c.client_id])]
            results.update({c.client_id: r for c, r in zip(group, out, strict=True)})
    fitted = Fitted()
    for c in clients:
        reason = stopped.get(id(generators[c.client_id]))
        if reason is not None:  # a client that knows its training failed sends nothing
            fitted.diverged[c.client_id] = reason
            continue
        state, upload = results[c.client_id]
        store.save(c.client_id, state, round)
        fitted.uploads[c.client_id] = upload
    return fitted


def personalize_clients(strategy: ClientStrategy, clients: Sequence[LocalClient],
                        store: ClientStore, broadcast: Message, *, seed: int, round: int,
                        on_client: Callable[[int], None] | None = None
                        ) -> dict[int, ClientState]:
    """Every client's personalised state from its `TRAINED` one (left as it is), saved
    under `PERSONALIZED` for round ``round`` and returned; ``broadcast`` is the final
    evaluation broadcast; ``on_client(client_id)`` after each (progress)."""
    strategy = client_half(strategy)  # the client step sees the client half only
    states = {}
    for c in clients:
        state = strategy.personalize(c.config, store.load(c.client_id), c.data, broadcast,
                                     personalize_generator(seed, c.client_id))
        store.save(c.client_id, state, round, PERSONALIZED)
        states[c.client_id] = state
        if on_client is not None:
            on_client(c.client_id)
    return states


def evaluate_clients(strategy: ClientStrategy, clients: Sequence[LocalClient],
                     states: Mapping[int, ClientState], broadcast: Message, *, n_bins: int,
                     keep_probs: bool = False, batched: bool = False) -> list[Evaluation]:
    """Every client's evaluation (in the order given) of its state in ``states`` on its test
    set, predictions batched over clients of one body spec when ``batched``
    (`evaluate_group`)."""
    strategy = client_half(strategy)  # the client step sees the client half only
    out: dict[int, Evaluation] = {}
    for group in body_groups(clients, batched=batched):
        evaluations = strategy.evaluate_group(
            [c.config for c in group], [states[c.client_id] for c in group],
            [c.data for c in group], broadcast, n_bins=n_bins, keep_probs=keep_probs)
        out.update({e.client_id: e for e in evaluations})
    return [out[c.client_id] for c in clients]


__all__ = ["PERSONALIZED", "TRAINED", "ClientStore", "Fitted", "LocalClient", "body_groups",
           "evaluate_clients", "fit_clients", "fit_generators", "personalize_clients",
           "personalize_generator"]  # the seeds' two functions too: one import for a transport
