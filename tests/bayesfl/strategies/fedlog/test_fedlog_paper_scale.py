"""``feature_scale=1`` (the paper's model, FedLog's default before issue 40) reproduces the
former default bit for bit: every broadcast and upload byte, the final server state and every
client's predictives of a three-round run equal those recorded at commit 163b78e (before the
default became the held-out scale), for the MC (default) and probit predictives.

The digests were recorded on this repository's CPU machine; another CPU's float rounding
(``ATEN_CPU_CAPABILITY``) changes the trained bodies and so the digests. Regenerate with
:func:`run_digest` at that commit (``git worktree add``) should the reference machine change.
"""

import hashlib

import pytest
from strategy_helpers import SIZES, context, evaluation_broadcast, make_clients, run_round, wire

from bayesfl.messages import encode
from bayesfl.strategies import make_strategy

RECORDED = {
    "mc": "b7baa4ffd4ad3389f0344e5b13c2dcff46fe046a413a4811ca9b7ff2de94b517",
    "probit": "c5b5b0fe87bdccaefd1526e84904b04bb223fd2c02c1be52e44158afbd6020ae",
}


def run_digest(**options) -> str:
    """SHA-256 of a three-round FedLog run of the strategy-test clients: each round's encoded
    broadcast and uploads, the final server state (sorted by name), the evaluation broadcast
    and every client's predictives of its test rows."""
    strategy = make_strategy("fedlog", context(sizes=SIZES), **options)
    clients = make_clients(strategy, SIZES)
    state = strategy.init()
    h = hashlib.sha256()
    for r in range(3):
        h.update(encode(wire(strategy.configure(state, r).broadcast)))
        state, ups = run_round(strategy, clients, state, r)
        for u in ups:
            h.update(encode(u))
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().numpy().tobytes())
    broadcast = evaluation_broadcast(strategy, state, 2)
    h.update(encode(broadcast))
    for c in clients:
        out = strategy.predict(c.config, c.state, broadcast, c.data.test_x)
        for name in sorted(out):
            h.update(out[name].contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("predictive", ["mc", "probit"])
def test_feature_scale_1_is_the_former_default_bit_for_bit(predictive):
    options = {"feature_scale": 1} | ({} if predictive == "mc" else {"predictive": predictive})
    assert run_digest(**options) == RECORDED[predictive]
