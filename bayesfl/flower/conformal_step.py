"""The conformal step (:mod:`bayesfl.conformal`) on Flower: the same protocol, validation and
byte counts as in the simulator, carried by the calibrate step's ``query.calibrate`` messages.

A request's record holds ``step``, the final evaluation ``broadcast`` and either ``conformal``
(a threshold proposal or the one-shot request) or ``conformal_result`` (the thresholds); the
node answers with ``reply``. The ServerApp's engine run calls :func:`server_conformal_step`
after the calibrate step; the ClientApp's ``calibrate`` handler calls :func:`client_conformal_reply`
first and returns its reply when the request is the conformal step's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from bayesfl.errors import MessageRejected

REQUEST, RESULT = "conformal", "conformal_result"


def server_conformal_step(server: Any, eval_bytes: bytes) -> Any:
    """The step over ``server``'s nodes (a :class:`bayesfl.flower.server_app.FlowerServer`;
    the run asks for it): the threshold search on the held-out rows, then every connected
    node's coverage. Returns the :class:`bayesfl.conformal.ConformalOutcome` (the engine
    writes ``summary["conformal"]`` and the files)."""
    from bayesfl.conformal import ConformalOutcome, conformal_search_over, evaluation_over
    from bayesfl.flower.protocol import CALIBRATE, pack

    spec, channel = server.setup.conformal, server.channel
    t0 = time.perf_counter()
    held = server.setup.held_out
    connected = [c for c in server.training if c in channel.nodes]
    participants = [c for c in connected if c in held and held[c].size > 0]

    def asker(name: str):
        def ask(step: int, down: bytes, client_ids: Sequence[int]) -> dict[int, bytes | str]:
            return channel.ask(CALIBRATE, {c: pack(step=step, broadcast=eval_bytes,
                                                   **{name: down}) for c in client_ids},
                               step="conformal", round=step)
        return ask

    search = conformal_search_over(asker(REQUEST), participants, spec, server.num_classes)
    coverage, rejections = {}, []
    if search.error is None:
        coverage, rejections = evaluation_over(asker(RESULT), connected, search,
                                               server.num_classes)
    return ConformalOutcome(spec, search, coverage, rejections, server.setup.held_out_fraction,
                            sum(held[c].size for c in participants), server.num_classes,
                            time.perf_counter() - t0)


def client_conformal_reply(values: dict[str, Any], node: Any, state: Any,
                           broadcast: Any, step: int) -> bytes | None:
    """The node's encoded reply when ``values`` is a conformal request, else None.

    Raises:
        DataError: a proposal reached a node without held-out rows.
        MessageRejected: a request that fails its schema.
    """
    from bayesfl.conformal import ConformalClient, parse_conformal
    from bayesfl.errors import DataError
    from bayesfl.flower.protocol import part
    from bayesfl.messages import DEFAULT_MAX_BYTES, decode, encode
    from bayesfl.strategies.base import derived_seed

    request = part(values, REQUEST, max_bytes=DEFAULT_MAX_BYTES)
    result = part(values, RESULT, max_bytes=DEFAULT_MAX_BYTES)
    if request is None and result is None:
        return None
    spec = parse_conformal(node.config.conformal)
    if spec is None:
        raise MessageRejected("this run has no conformal step")

    def predictives(x: torch.Tensor) -> dict[str, torch.Tensor]:
        from bayesfl.conformal import PREDICTIVES

        with torch.no_grad():
            out = node.strategy.predict(node.client, state, broadcast, x)
        return {k: v.to(torch.float64).cpu() for k, v in out.items() if k in PREDICTIVES}

    seed = node.config.seed
    if request is not None:
        held = node.held_out
        if held is None or held.size == 0:
            raise DataError(f"client {node.client_id} holds no conformal calibration rows")
        client = ConformalClient.from_probabilities(node.client_id, predictives(held.x),
                                                    held.y, spec, seed)
        return encode(client.reply(decode(request)))
    held = node.held_out
    if held is not None and held.size > 0:
        client = ConformalClient.from_probabilities(node.client_id, predictives(held.x),
                                                    held.y, spec, seed)
    else:
        from bayesfl.conformal import P

        client = ConformalClient(node.client_id, [None] * P, spec,
                                 derived_seed(seed, 45, node.client_id))
    return encode(client.evaluate(decode(result), predictives(node.data.test_x),
                                  node.data.test_y, node.strategy.num_classes))


__all__ = ["client_conformal_reply", "server_conformal_step"]
