"""CoLearn's downlink as the paper sends it (issue 29): each client receives the global
prototypes and M_down observation sets of its peers, ``(M_down + 1) C d'`` floats, never a set
of its own; the whole-pool relay stays an option; the class counts can stay on the client."""

import pytest
import torch
from strategy_helpers import FEATURE_DIM, NUM_CLASSES, run_round, wire

from bayesfl.messages import encode
from bayesfl.simulate import simulate
from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.representation.colearn import (
    KEPT,
    KEPT_AVAILABLE,
    downlink_floats,
    received_sets,
    select_relay,
)

# the paper's setting of the acceptance check: mnist-5k, N = 5, LeNet-5 bodies (d' = 84)
C, D, N = 10, 84, 5


def hand_uploads(strategy, n, d=D, counts=None):
    """``n`` honest uploads; client k's prototype and observation rows are all ``k + 1``, so
    every relayed row says whose it is."""
    ups = []
    for k in range(n):
        c = torch.full((C,), 24, dtype=torch.int64) if counts is None else counts[k]
        rows = (c > 0).float()[:, None].expand(len(c), d) * (k + 1.0)
        ups.append(wire(strategy.up_message(1, k, {"prototypes": rows.clone(),
                                                   "observations": rows[None].clone(),
                                                   "counts": c})))
    return ups


def downlink_bytes(relay: str, m_down: int = 1) -> int:
    """Encoded bytes of the broadcast every client receives after a round of N uploads."""
    context = StrategyContext(num_classes=C, feature_dim=D, input_shape=(1, 28, 28), clients=N)
    strategy = make_strategy("colearn", context, relay=relay, m_down=m_down)
    state = strategy.aggregate(strategy.init(), hand_uploads(strategy, N), 1,
                               torch.Generator().manual_seed(0))
    return len(encode(strategy.configure(state, 2).broadcast))


@pytest.mark.parametrize("m_down", [1, 2])
def test_the_downlink_is_within_1_5x_of_the_papers_m_down_plus_1_sets(m_down):
    # the paper: (M_down + 1) C d' float32 per client and round; the masks, the row senders
    # and the safetensors header are the rest, a few hundred bytes
    paper = 4 * downlink_floats(C, D, m_down)
    assert downlink_bytes("sets", m_down) <= 1.5 * paper


def test_the_whole_pool_relay_sends_every_peers_set_and_breaks_the_bound():
    # the option kept for comparison: N sets of N clients, (N + 1) C d' floats; this is what
    # the bound above catches if the paper's relay is ignored
    paper = 4 * downlink_floats(C, D, 1)
    pool = downlink_bytes("pool")
    assert pool > 1.5 * paper and pool >= 4 * (N + 1) * C * D


@pytest.mark.slow
def test_mnist_5k_at_n_5_downloads_at_most_1_5x_the_papers_floats_per_client_and_round():
    # end to end: what the simulator counts on the wire, LeNet-5 bodies, d' = 84
    result = simulate("colearn", "mnist-5k", clients=N, partition="labels:10:train=24:test=5",
                      rounds=2, seed=0, body="lenet5", feature_dim=D, local_epochs=1,
                      batch_size=16, progress=False, threads=1)
    per_round = [m["bytes_down_per_client"] for m in result.metrics if m["round"] >= 1]
    assert per_round and max(per_round) <= 1.5 * 4 * downlink_floats(C, D, 1)


def test_the_relay_sends_m_down_sets_of_distinct_senders():
    context = StrategyContext(num_classes=C, feature_dim=D, input_shape=(1, 28, 28), clients=N)
    strategy = make_strategy("colearn", context, m_down=3)
    state = strategy.aggregate(strategy.init(), hand_uploads(strategy, N), 1,
                               torch.Generator().manual_seed(0))
    down = strategy.configure(state, 2).broadcast.tensors
    assert tuple(down["observations"].shape) == (3, C, D)
    assert tuple(down["observation_sources"].shape) == (3, C)
    senders = down["observation_sources"][:, 0].tolist()
    assert len(set(senders)) == 3  # one sender per set, all different
    for m, k in enumerate(senders):  # each row is its sender's: value k + 1
        assert torch.equal(down["observations"][m], torch.full((C, D), k + 1.0))
        assert down["observation_sources"][m].tolist() == [k] * C


def test_the_relay_is_deterministic_under_the_seed_and_varies_with_it():
    context = StrategyContext(num_classes=C, feature_dim=D, input_shape=(1, 28, 28), clients=N)
    strategy = make_strategy("colearn", context)
    ups = hand_uploads(strategy, N)

    def senders(seed):
        state = strategy.aggregate(strategy.init(), ups, 1, torch.Generator().manual_seed(seed))
        return int(state["pool_sources"][0, 0])

    assert senders(3) == senders(3)
    assert len({senders(s) for s in range(20)}) > 1  # not always the same client


def test_a_class_the_sender_lacks_is_filled_from_another_holder():
    # client 0 lacks class 0: its relayed set takes class 0 from a peer that holds it
    pool = torch.tensor([[[0.0], [1.0]], [[2.0], [2.0]], [[3.0], [3.0]]])
    present = torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    sources = torch.tensor([0, 1, 2])
    for seed in range(20):
        sets, ok, rows = select_relay(pool, present, sources, 1,
                                      torch.Generator().manual_seed(seed))
        assert ok.all()
        if int(rows[0, 1]) == 0:  # client 0's set was drawn
            assert int(rows[0, 0]) in (1, 2) and float(sets[0, 0, 0]) == rows[0, 0] + 1


def test_a_client_never_uses_a_row_of_its_own():
    # the relayed set: class 0 from client 2, class 1 from client 1. Client 1 replaces its own
    # row with the row it used last round (from a peer), or skips it if it has none
    sets = torch.tensor([[[5.0], [6.0]]])
    present = torch.ones(1, 2)
    sources = torch.tensor([[2, 1]])
    kept = torch.tensor([[[7.0], [8.0]]])
    obs, ok = received_sets(sets, present, sources, 1, kept, torch.ones(1, 2))
    assert obs.flatten().tolist() == [5.0, 8.0] and ok.all()
    obs, ok = received_sets(sets, present, sources, 1, kept, torch.zeros(1, 2))
    assert ok.tolist() == [[True, False]] and obs.flatten().tolist() == [5.0, 0.0]
    obs, ok = received_sets(sets, present, sources, 0, kept, torch.zeros(1, 2))
    assert ok.all() and obs.flatten().tolist() == [5.0, 6.0]  # client 0: both are peers'


def test_over_rounds_every_client_trains_on_peers_rows_only(build):
    # three rounds of the real round trip: whatever client sent the relayed set, no client's
    # used observations (kept in its state) ever hold a row of its own upload of that round
    strategy, clients, state = build("colearn", n_avg=1)
    for r in (0, 1, 2, 3):
        before = state
        state, _ = run_round(strategy, clients, state, r)
        if r == 0:
            continue
        rows = before["pool_sources"]  # the relay the round's clients trained on
        for c in clients:
            cid = c.config.client_id
            used, ok = c.state[KEPT], c.state[KEPT_AVAILABLE] > 0
            own = (rows == cid) & (before["pool_present"] > 0)
            relayed = before["pool"].to(used.dtype)
            # a row of the client's own is never the relayed one it was sent
            clash = own & ok & (used == relayed).all(-1)
            assert not clash.any(), (r, cid)
            assert used.shape == (1, NUM_CLASSES, FEATURE_DIM)


def test_share_counts_off_uploads_presence_only_and_the_server_enforces_it(build):
    strategy, clients, state = build("colearn", share_counts=False)
    state, ups = run_round(strategy, clients, state, 0)
    for u, c in zip(ups, clients, strict=True):
        held = torch.bincount(c.data.train_y, minlength=NUM_CLASSES) > 0
        assert u.tensors["counts"].tolist() == held.long().tolist()
    # the global prototype is then the plain mean over the holders
    ups = hand_uploads(strategy, 2, d=FEATURE_DIM,
                       counts=[torch.tensor([1, 1, 0]), torch.tensor([1, 0, 1])])
    new = strategy.aggregate(strategy.init(), ups, 1, torch.Generator())
    assert new["prototypes"][:, 0].tolist() == [1.5, 1.0, 2.0]
    # a client sending its histogram anyway is rejected, with what to do
    plan = strategy.configure(state, 1)
    leaky = hand_uploads(strategy, 1, d=FEATURE_DIM, counts=[torch.tensor([3, 1, 0])])
    (verdict,) = strategy.validate_uploads(plan, leaky, [0])
    assert verdict is not None and "share_counts" in verdict
