"""Clients' tensors as rows of one tensor (bayesfl.stacked_rows) and the simulator's bound on the
memory such rows keep alive (bayesfl.engine.state.compact_client_states).

Every check is exact: stacking moves bits (a view or ``torch.stack``'s copy), so the values
must be equal to the last bit, and memory is compared by storage address and byte count.
"""

from __future__ import annotations

import pytest
import torch

from bayesfl.engine.state import compact_client_states, stack_client_states
from bayesfl.stacked_rows import consecutive_rows, held_bytes, row_views, stack_rows
from bayesfl.training import LocalTraining, train_stacked


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_the_rows_of_a_stack_are_stacked_again_without_a_copy():
    stack = torch.randn(5, 3, 2)
    rows = row_views(stack)
    assert all(shares_memory(r, stack) for r in rows)
    again = stack_rows(rows)
    assert shares_memory(again, stack) and again.data_ptr() == stack.data_ptr()
    torch.testing.assert_close(again, torch.stack(rows), rtol=0, atol=0)
    # a run of consecutive rows in the middle is a view too (a forward's chunk of clients)
    middle = stack_rows(rows[1:4])
    assert middle.data_ptr() == stack[1].data_ptr()
    torch.testing.assert_close(middle, stack[1:4], rtol=0, atol=0)


def test_copy_gives_new_memory_with_the_same_values():
    stack = torch.randn(4, 6)
    kept = stack.clone()
    copied = stack_rows(row_views(stack), copy=True)
    assert not shares_memory(copied, stack)
    torch.testing.assert_close(copied, stack, rtol=0, atol=0)
    copied.zero_()  # a caller may write it in place: the rows' own memory is untouched
    torch.testing.assert_close(stack, kept, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [
    pytest.param(lambda s: row_views(s)[::-1], id="reversed"),
    pytest.param(lambda s: [s[0], s[2], s[3]], id="a gap"),
    pytest.param(lambda s: [s[0], s[1].clone(), s[2]], id="one row elsewhere"),
    pytest.param(lambda s: [s[0, :, :2], s[1, :, :2]], id="not contiguous"),
    pytest.param(lambda s: [r.clone() for r in s], id="each its own"),
])
def test_rows_that_do_not_lie_stacked_are_copied(rows):
    stack = torch.randn(4, 3, 3)
    given = rows(stack)
    assert consecutive_rows(given) is None
    out = stack_rows(given)
    assert not shares_memory(out, stack)
    torch.testing.assert_close(out, torch.stack(given), rtol=0, atol=0)


def test_held_bytes_counts_a_stack_once_for_all_its_rows():
    stack = torch.zeros(8, 10)  # 320 bytes
    assert held_bytes(row_views(stack)[:2]) == (80, 320)
    assert held_bytes(row_views(stack)) == (320, 320)
    owned = [torch.zeros(10) for _ in range(3)]
    assert held_bytes(owned) == (120, 120)


def test_a_batched_fit_gives_each_client_a_row_of_one_new_stack():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    before = [{n: p.detach().clone() for n, p in model.named_parameters()} for _ in range(4)]
    params = [dict(p) for p in before]
    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    ys = [torch.randint(0, 2, (5,), generator=torch.Generator().manual_seed(k))
          for k in range(4)]
    train_stacked(model, params, [{} for _ in range(4)], xs, ys,
                  lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"),
                  LocalTraining(epochs=1, batch_size=5, lr=0.1),
                  generators=[torch.Generator().manual_seed(k) for k in range(4)])
    for name in before[0]:
        rows = [p[name] for p in params]
        stack = consecutive_rows(rows)
        assert stack is not None and not stack.requires_grad  # one stack, detached
        assert all(not torch.equal(r, b[name]) for r, b in zip(rows, before, strict=True))
    # the tensors the clients held before are never written (a state's own may be passed)
    assert all(torch.equal(b["0.weight"], model[0].weight.detach()) for b in before)


def states_of(stacks, rows_of):
    """Client ``k``'s state: row ``rows_of[k]`` of ``stacks[k]`` for each name."""
    return {k: {"w": row_views(stacks[k]["w"])[rows_of[k]],
                "b": row_views(stacks[k]["b"])[rows_of[k]]} for k in range(len(rows_of))}


def test_states_holding_little_more_than_themselves_are_left_as_they_are():
    stack = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    clients = states_of([stack] * 4, [0, 1, 2, 3])
    out = compact_client_states(clients)
    assert all(out[k] is clients[k] for k in clients)


def test_states_that_keep_large_stacks_alive_are_restacked_into_their_own_bytes():
    # 4 clients, each the last trained in a round of 4: each holds one row of its own stack,
    # so the states keep 4x their bytes alive (partial participation over 4 rounds)
    stacks = [{"w": torch.randn(4, 3), "b": torch.randn(4)} for _ in range(4)]
    clients = states_of(stacks, [0, 1, 2, 3])
    own, held = held_bytes(t for s in clients.values() for t in s.values())
    assert held == 4 * own
    out = compact_client_states(clients)
    assert list(out) == list(clients)
    for k in clients:  # the same bits, now rows of one stack per name
        for name in ("w", "b"):
            torch.testing.assert_close(out[k][name], clients[k][name], rtol=0, atol=0)
    assert held_bytes(t for s in out.values() for t in s.values()) == (own, own)
    # a checkpoint then writes those stacks as they are (no copy)
    (ids, stacked), = stack_client_states(out)
    assert ids == [0, 1, 2, 3] and shares_memory(stacked["w"], out[0]["w"])


def test_a_state_with_its_own_layout_is_restacked_in_its_own_group():
    stacks = [{"w": torch.randn(4, 3), "b": torch.randn(4)} for _ in range(3)]
    clients = states_of(stacks, [0, 1, 2])
    clients[3] = {"w": torch.randn(5)}  # another layout (an own-bodied client)
    out = compact_client_states(clients)
    torch.testing.assert_close(out[3]["w"], clients[3]["w"], rtol=0, atol=0)
    assert [ids for ids, _ in stack_client_states(out)] == [[0, 1, 2], [3]]
