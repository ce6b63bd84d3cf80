"""The final phases (calibrate, conformal, shift), written once over a channel.

After the rounds a run may ask its clients for more: a temperature, conformal thresholds, the
shift evaluation. Each phase is one server-side function (send the request, collect the
replies, validate each, merge, build the result: `bayesfl.calibrate.calibrate_phase`,
`bayesfl.conformal.conformal_phase`, `bayesfl.shift_protocol.shift_phase`) and, per
kind of request, one client-side function (`Phase.answer`) that computes a client's
mergeable answer from what it holds (its `Site`). A transport only carries the bytes:
its channel's ``ask(phase, step, down, client_ids)`` hands every client the encoded request
``down`` and returns, per client, its encoded answer or why none came (`PhaseChannel`).

* In process (the simulator, `bayesfl.calibrate.calibrate_run`,
  `bayesfl.conformal.conformal_run`): `InProcessPhases` calls the answer on each
  client's site in this process; a client keeps what it computed for the phase in
  `Site.memo` between the phase's requests.
* Flower (`bayesfl.flower.channel.FlowerChannel.ask_phase`): the request travels in a
  ``query.*`` message laid out as the phase says (`Phase.query`, `Phase.request`,
  `Phase.reply`), with the final evaluation broadcast; the ClientApp's handler builds the
  node's site and calls the same answer (a fresh process per message: an empty memo).

The server never sees more than the answers, and validates every one: a bad or missing answer
is logged with its reason and the result is built from the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from bayesfl.errors import BayesFLError
from bayesfl.messages import KeyRing, Message
from calibration.errors import CalibrationError


@dataclass(eq=False)
class Site:
    """One client as the final phases see it: what its answers are computed from.

    Attributes:
        client_id: the client.
        strategy: the strategy's client half.
        client: its [`ClientConfig`][bayesfl.strategies.base.ClientConfig].
        state: its final state (the personalised one where the strategy personalises).
        broadcast: the final evaluation broadcast, decoded.
        data: its [`ClientData`][bayesfl.data.clients.ClientData] (test rows ``test_x`` (n, ...),
            ``test_y`` (n,)).
        held_out: its held-out rows (`bayesfl.holdout.HeldOut`), or None.
        seed: the run's seed (seeds a randomised conformal score's draws).
        n_bins: the run's calibration bins.
        device: the run's device.
        conformal: the conformal step's spec (`bayesfl.conformal_spec.ConformalSpec`),
            or None.
        clients: every client's data of the run's data set (the out-of-distribution rows of
            the shift phase), or None where the site loads its own data.
        novel: the run's novel clients.
        server_key, client_key: the HMAC keys of the run's messages (None: digests only).
        memo: what the client keeps between one phase's requests (its held-out scores).
    """

    client_id: int
    strategy: Any
    client: Any
    state: Any
    broadcast: Message
    data: Any
    held_out: Any = None
    seed: int = 0
    n_bins: int = 15
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    conformal: Any = None
    clients: Sequence[Any] | None = None
    novel: tuple[int, ...] = ()
    server_key: bytes | None = None
    client_key: bytes | None = None
    memo: dict[str, Any] = field(default_factory=dict)

    def predict(self, x: Tensor) -> dict[str, Tensor]:
        """Its predictives of inputs ``x`` (n, ...): key -> (n, C) float64."""
        with torch.no_grad():
            out = self.strategy.predict(self.client, self.state, self.broadcast, x)
        return {k: v.to(torch.float64) for k, v in out.items()}


Answer = Callable[[Site, bytes], "bytes | tuple[bytes, list[str]]"]
"""``answer(site, request) -> encoded reply`` (the shift phase: ``(reply, notes)``)."""


@dataclass(frozen=True)
class Phase:
    """One kind of request of a final phase.

    Attributes:
        step: the phase's name in events and rejections (``calibrate``, ``conformal``,
            ``shift``).
        answer: the client's side (`Answer`).
        query: the Flower message type that carries it (``query.calibrate``,
            ``query.shift``).
        request, reply: the keys of the request's and of the reply's bytes in a Flower record.
        numbered: the record carries the request's ``step`` number (the one shift request
            carries none).
        text: the request travels as text (the shift request's JSON).
        notes: the reply carries the client's notes (JSON list) beside its bytes.
        max_bytes: the largest reply accepted.
    """

    step: str
    answer: Answer
    query: str
    request: str
    reply: str = "reply"
    numbered: bool = True
    text: bool = False
    notes: bool = False
    max_bytes: int = 4 * 2**20


class PhaseChannel(Protocol):
    """What a final phase needs of a transport (module docstring)."""

    keys: KeyRing | None
    """The run's HMAC keys (None: the messages carry digests only)."""

    def ask(self, phase: Phase, step: int, down: bytes, client_ids: Sequence[int]
            ) -> Mapping[int, Any]:
        """Every client's answer to ``down``: its encoded reply (shift: ``(reply, notes)``),
        or why none came (a string)."""


def asker(channel: PhaseChannel, phase: Phase
          ) -> Callable[[int, bytes, Sequence[int]], Mapping[int, Any]]:
    """``ask(step, down, client_ids)`` of one phase over ``channel`` (the ``Ask`` of
    `bayesfl.calibrate` and `bayesfl.conformal`)."""
    def ask(step: int, down: bytes, client_ids: Sequence[int]) -> Mapping[int, Any]:
        return channel.ask(phase, step, down, list(client_ids))
    return ask


class InProcessPhases:
    """The final phases' channel in this process: each client answers from its `Site`.

    Args:
        sites: client id -> its site.
        keys: the run's HMAC keys, or None.
    """

    def __init__(self, sites: Mapping[int, Site], keys: KeyRing | None = None) -> None:
        self.sites, self.keys = sites, keys

    def ask(self, phase: Phase, step: int, down: bytes, client_ids: Sequence[int]
            ) -> dict[int, Any]:
        from inference.errors import InferenceError

        answers: dict[int, Any] = {}
        for cid in client_ids:
            try:  # the client's side, from the bytes it received
                answers[cid] = phase.answer(self.sites[cid], down)
            except (BayesFLError, CalibrationError, InferenceError, ValueError) as err:
                answers[cid] = f"client failed to answer: {err}"
        return answers


# ---- the server's side, shared by the phases ---------------------------------------------------
UploadHook = Callable[[int, int, bytes], bytes]
"""``hook(step, client_id, encoded_reply) -> bytes delivered`` (tests, attacks)."""


class Restart(Exception):  # noqa: N818 - control flow: some participant was dropped
    """A search step rejected a participant: the search starts again over the others."""


def read_answers(answers: Mapping[int, Any], client_ids: Sequence[int], step: int,
                 read: Callable[[int, Any], Any], *, upload_hook: UploadHook | None = None,
                 arrived: Callable[[int, Any], None] | None = None
                 ) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """Every client's answer read and validated, in client order.

    ``read(client_id, data)`` returns what the answer holds or raises MessageRejected with the
    reason; ``arrived(client_id, data)`` sees each answer that came as bytes (after
    ``upload_hook``), before it is read (the byte counts). A missing answer, a failure (a
    string: why none came) and a rejected one each become a rejection
    ``{"step", "client_id", "reason"}``.

    Returns:
        (client id -> what its answer holds, the rejections).
    """
    from bayesfl.errors import MessageRejected

    replies: dict[int, Any] = {}
    rejections: list[dict[str, Any]] = []
    for cid in client_ids:
        up = answers.get(cid, "no reply")
        if isinstance(up, str):
            rejections.append({"step": step, "client_id": cid, "reason": up})
            continue
        if upload_hook is not None:
            up = upload_hook(step, cid, up)
        if arrived is not None:
            arrived(cid, up)
        try:
            replies[cid] = read(cid, up)
        except MessageRejected as err:
            rejections.append({"step": step, "client_id": cid, "reason": err.reason})
    return replies, rejections


def search_step(ask: Callable[[int, bytes, Sequence[int]], Mapping[int, Any]], down: bytes,
                active: Sequence[int], outcome: Any, read: Callable[[int, Any], Any], *,
                floats_up: int, upload_hook: UploadHook | None = None) -> dict[int, Any]:
    """One request of a search to every ``active`` client and their validated replies
    (`read_answers`), counted on ``outcome`` (``steps``, ``bytes_down``, ``bytes_up``,
    ``floats_up``; a rejection goes to ``outcome.rejections``).

    Raises:
        Restart: some client was rejected (the search starts again without it).
    """
    step = outcome.steps
    outcome.steps += 1
    outcome.bytes_down += len(down) * len(active)

    def arrived(_: int, up: Any) -> None:
        outcome.bytes_up += len(up) if isinstance(up, bytes | bytearray) else 0
        outcome.floats_up += floats_up

    replies, rejections = read_answers(ask(step, down, list(active)), active, step, read,
                                       upload_hook=upload_hook, arrived=arrived)
    outcome.rejections += rejections
    if rejections:
        raise Restart
    return replies


def with_restarts(client_ids: Sequence[int], outcome: Any,
                  search: Callable[[list[int]], Any]) -> Any:
    """``search(active)`` over the clients, again without every client it rejected
    (`Restart`) until one completes; its result, or None with ``outcome.error`` set (a
    search that cannot run: CalibrationError, or no client left). Sets
    ``outcome.participants`` (the clients the result used) and counts ``outcome.restarts``."""
    active = list(client_ids)
    while active:
        try:
            result = search(active)
            outcome.participants = list(active)
            return result
        except Restart:
            dropped = {r["client_id"] for r in outcome.rejections}
            active = [c for c in active if c not in dropped]
            outcome.restarts += 1
        except CalibrationError as err:
            outcome.error = str(err)
            return None
    outcome.participants = []
    outcome.error = "no client with held-out data took part (or every reply was rejected)"
    return None


__all__ = ["Answer", "InProcessPhases", "Phase", "PhaseChannel", "Restart", "Site", "UploadHook",
           "asker", "read_answers", "search_step", "with_restarts"]
