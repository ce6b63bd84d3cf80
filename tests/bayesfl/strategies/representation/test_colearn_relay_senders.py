"""CoLearn's relay with several observation sets per client (``m_up > 1``): the ``M_down``
sets a round relays come from distinct senders while there are enough of them (never two
sets of one sender), and no client uses a row it sent itself."""

import pytest
import torch
from strategy_helpers import run_round, wire

from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.representation.colearn import KEPT, KEPT_AVAILABLE, received_sets

C, D, N = 4, 3, 5


def uploads_with_sets(strategy, m_up):
    """N uploads of ``m_up`` sets each, every class held; row ``[m, c]`` of client k's set m is
    ``10 (k + 1) + m``, so a relayed row says whose (and which) set it is."""
    ups = []
    for k in range(N):
        sets = torch.stack([torch.full((C, D), 10.0 * (k + 1) + m) for m in range(m_up)])
        ups.append(wire(strategy.up_message(1, k, {
            "prototypes": torch.full((C, D), 10.0 * (k + 1)), "observations": sets,
            "counts": torch.full((C,), 12, dtype=torch.int64)})))
    return ups


@pytest.mark.parametrize("m_up, m_down", [(2, 2), (3, 3), (4, 5), (3, 4)])
def test_relayed_sets_come_from_distinct_senders_whatever_m_up(m_up, m_down):
    # over 30 seeds: with m_up sets per sender and m_down <= N, a relay that drew sets without
    # regard to their sender would often send two of one client's (m_up = 2, m_down = 2: 1 in
    # 9 draws; the test would miss it with probability (8/9)^30 < 3% even there)
    context = StrategyContext(num_classes=C, feature_dim=D, input_shape=(6,), clients=N)
    strategy = make_strategy("colearn", context, m_up=m_up, m_down=m_down)
    ups = uploads_with_sets(strategy, m_up)
    for seed in range(30):
        state = strategy.aggregate(strategy.init(), ups, 1, torch.Generator().manual_seed(seed))
        down = strategy.configure(state, 2).broadcast.tensors
        sets, sources = down["observations"], down["observation_sources"]
        assert tuple(sets.shape) == (m_down, C, D)
        senders = sources[:, 0].tolist()
        assert len(set(senders)) == m_down, (seed, senders)  # never two sets of one sender
        for m, k in enumerate(senders):
            assert sources[m].tolist() == [k] * C  # every class held: the whole set is k's
            value = float(sets[m, 0, 0])  # one of k's own sets, whole
            assert 10 * (k + 1) <= value < 10 * (k + 1) + m_up
            assert torch.equal(sets[m], torch.full((C, D), value))
        for client in range(N):  # and nobody uses its own
            obs, ok = received_sets(sets, down["observations_present"], sources, client,
                                    torch.zeros(m_down, C, D), torch.zeros(m_down, C))
            used = obs[ok]
            own = (used >= 10 * (client + 1)) & (used < 10 * (client + 1) + m_up)
            assert not own.any(), (seed, client)


@pytest.mark.parametrize("m_up", [2, 3])
def test_over_rounds_the_relayed_sets_have_distinct_senders_and_nobody_uses_its_own(build,
                                                                                     m_up):
    # the real round trip with trained bodies: three clients, m_down = 3 sets a round
    strategy, clients, state = build("colearn", n_avg=1, m_up=m_up, m_down=3)
    for r in (0, 1, 2, 3):
        before = state
        state, _ = run_round(strategy, clients, state, r)
        if r == 0:
            continue
        rows, present = before["pool_sources"], before["pool_present"] > 0
        assert tuple(rows.shape) == (3, strategy.context.num_classes)
        # every client holds class 0 (client 2 lacks class 1, filled from a peer): a set's
        # class-0 row is its sender's own
        assert all(bool((c.data.train_y == 0).any()) for c in clients)
        set_senders = rows[:, 0].tolist()
        assert len(set(set_senders)) == 3, (r, rows)
        for c in clients:
            cid = c.config.client_id
            used, ok = c.state[KEPT], c.state[KEPT_AVAILABLE] > 0
            own = (rows == cid) & present
            clash = own & ok & (used == before["pool"].to(used.dtype)).all(-1)
            assert not clash.any(), (r, cid)
