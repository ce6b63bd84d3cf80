"""The checkpoint's client states: stacked per layout group, given back exactly.

``save_round`` writes the clients' states as one tensor per layout group and state name
(``clients/<g>/state/<name>``, row ``i`` being client ``clients/<g>/ids[i]``'s);
``client_states`` gives every client its state back bit for bit, whatever mix of layouts the
clients have, and refuses a group that does not hold exactly this run's clients once each or
whose tensors have not one row per id.
"""

import pytest
import torch

from bayesfl.checkpoint import load_checkpoint, save_checkpoint
from bayesfl.engine.state import (
    CHECKPOINT_FORMAT,
    client_states,
    restore_round,
    save_round,
    stack_client_states,
)
from bayesfl.errors import CheckpointError
from bayesfl.simulate import CHECKPOINT_NAME, simulate

FINGERPRINT = "f" * 64


def _odd_values(shape, dtype, seed):
    """Values whose bits a conversion or a reduction would change: NaNs, infinities,
    signed zeros and subnormals among random ones (floats), extremes (integers)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0,
                                torch.finfo(dtype).tiny / 2], dtype=dtype)
        flat = t.view(-1)
        flat[:min(flat.numel(), 5)] = special[:min(flat.numel(), 5)]
        return t
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    t = torch.randint(-100, 100, shape, generator=g).to(dtype)
    if t.numel():
        t.view(-1)[0] = info.max
        t.view(-1)[-1] = info.min
    return t


def _heterogeneous_clients():
    """Clients whose states differ in names, shapes, dtypes, or are empty, interleaved
    (a group's clients are not consecutive ids), with non-consecutive ids."""
    layouts = [
        {"w": ((3, 2), torch.float32), "b": ((3,), torch.float32)},
        {"w": ((3, 2), torch.float64), "b": ((3,), torch.float32)},   # a dtype differs
        {"w": ((4, 2), torch.float32), "b": ((3,), torch.float32)},   # a shape differs
        {"w": ((3, 2), torch.float32)},                               # a name fewer
        {},                                                           # no state
        {"step": ((), torch.int64), "mask": ((5,), torch.bool),
         "half": ((2, 0), torch.float16), "bf": ((2,), torch.bfloat16)},
    ]
    clients = {}
    for cid in range(30):
        layout = layouts[(cid * 7) % len(layouts)]
        clients[3 * cid + 1] = {k: _odd_values(shape, dtype, seed=cid * 10 + j)
                                for j, (k, (shape, dtype)) in enumerate(layout.items())}
    return clients


def _assert_same_states(got, expected):
    assert sorted(got) == sorted(expected)
    for cid, state in expected.items():
        assert sorted(got[cid]) == sorted(state), cid
        for k, t in state.items():
            assert got[cid][k].dtype == t.dtype and got[cid][k].shape == t.shape
            # exactly the saved bits: NaN payloads and signed zeros included
            assert torch.equal(_bits(got[cid][k]), _bits(t)), (cid, k)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def _save_and_load(tmp_path, clients):
    path = tmp_path / "ck.safetensors"
    save_round(path, round=1, first_round=1, seconds=0.5, identity={"x": 1},
               fingerprint=FINGERPRINT, state={"w": torch.zeros(2)}, clients=clients,
               metrics_text=b"{}\n", transport="test")
    return load_checkpoint(path, fingerprint=FINGERPRINT)


def test_states_of_every_layout_round_trip_exactly(tmp_path):
    clients = _heterogeneous_clients()
    tensors, meta = _save_and_load(tmp_path, clients)
    assert meta["format"] == CHECKPOINT_FORMAT
    # one group per layout, not one tensor per client
    assert len(meta["client_groups"]) == 6
    assert not any(k.startswith("client/") for k in tensors)
    assert sum(k.endswith("/ids") for k in tensors) == 6
    _assert_same_states(client_states(tensors, meta, list(clients)), clients)


def test_clients_of_one_layout_are_one_stacked_tensor_per_name():
    clients = {c: {"w": torch.full((2, 3), float(c)), "b": torch.arange(3) + c}
               for c in (5, 2, 9)}
    [(ids, stacked)] = stack_client_states(clients)
    assert ids == [5, 2, 9]  # the clients' order
    assert torch.equal(stacked["w"], torch.stack([clients[c]["w"] for c in ids]))
    assert torch.equal(stacked["b"], torch.stack([clients[c]["b"] for c in ids]))


def test_states_that_are_consecutive_rows_of_one_tensor_are_saved_without_a_copy():
    # a batched fit's client states are views of its stacked parameters
    w, b = torch.randn(5, 2, 3), torch.randn(5, 3)
    clients = {c: {"w": w[c], "b": b[c]} for c in range(5)}
    [(_, stacked)] = stack_client_states(clients)
    assert stacked["w"].data_ptr() == w.data_ptr() and torch.equal(stacked["w"], w)
    assert stacked["b"].data_ptr() == b.data_ptr() and torch.equal(stacked["b"], b)
    # rows of a slice, 0-dim rows: still the tensor itself
    step = torch.arange(7)
    [(_, stacked)] = stack_client_states({c: {"s": step[c + 2]} for c in range(4)})
    assert stacked["s"].data_ptr() == step[2:].data_ptr() and torch.equal(stacked["s"], step[2:6])


@pytest.mark.parametrize("rows", [
    lambda t: [t[1], t[0], t[2]],          # out of order
    lambda t: [t[0], t[2], t[4]],          # not consecutive
    lambda t: [t[0], t[1].clone(), t[2]],  # one row elsewhere
    lambda t: [r.t() for r in t[:3]],      # not contiguous
])
def test_rows_that_do_not_lie_stacked_are_copied(rows):
    t = torch.randn(5, 2, 3)
    chosen = rows(t)
    [(_, stacked)] = stack_client_states({c: {"w": r} for c, r in enumerate(chosen)})
    assert torch.equal(stacked["w"], torch.stack(chosen))
    assert stacked["w"].data_ptr() != t.data_ptr()


def test_no_clients_no_groups(tmp_path):
    tensors, meta = _save_and_load(tmp_path, {})
    assert meta["client_groups"] == []
    assert client_states(tensors, meta, []) == {}


def _uniform(tmp_path, n=4):
    clients = {c: {"w": torch.randn(2, 3), "b": torch.randn(3)} for c in range(n)}
    return clients, *_save_and_load(tmp_path, clients)


@pytest.mark.parametrize(("forge", "expected"), [
    (lambda t, m: t.__setitem__("clients/0/state/w", t["clients/0/state/w"][:3]),
     "clients/0/state/w has 3 rows for the group's 4 client ids"),
    (lambda t, m: t.__setitem__("clients/0/state/b", torch.zeros(5, 3)),
     "clients/0/state/b has 5 rows for the group's 4 client ids"),
    (lambda t, m: t.__setitem__("clients/0/state/b", torch.tensor(1.0)),
     "clients/0/state/b has no rows for the group's 4 client ids"),
    (lambda t, m: t.__setitem__("clients/0/ids", torch.tensor([0, 1, 2, 7])),
     "its client ids do not match this run's clients (missing [3]; unknown [7])"),
    (lambda t, m: t.__setitem__("clients/0/ids", torch.tensor([0, 1, 2, 2])),
     "its client ids do not match this run's clients (missing [3]; repeated [2])"),
    (lambda t, m: t.__setitem__("clients/0/ids", torch.tensor([0.0, 1.0, 2.0, 3.0])),
     "clients/0/ids is torch.float32 of shape (4,), not an int64 vector"),
    (lambda t, m: t.__setitem__("clients/0/ids", torch.tensor([[0, 1, 2, 3]])),
     "clients/0/ids is torch.int64 of shape (1, 4), not an int64 vector"),
    (lambda t, m: t.pop("clients/0/state/w"), "tensor 'clients/0/state/w' is missing"),
    (lambda t, m: t.pop("clients/0/ids"), "tensor 'clients/0/ids' is missing"),
    (lambda t, m: t.__setitem__("clients/1/ids", torch.tensor([3])),
     "tensor 'clients/1/ids' belongs to no client group"),
    (lambda t, m: m.__setitem__("client_groups", [["b", "c", "w"]]),
     "tensor 'clients/0/state/c' is missing"),
    (lambda t, m: m.__setitem__("client_groups", [["w"]]),
     "tensor 'clients/0/state/b' belongs to no client group"),
    (lambda t, m: m.__setitem__("client_groups", [["b", "w"], ["b", "w"]]),
     "tensor 'clients/1/ids' is missing"),
    (lambda t, m: m.pop("client_groups"), "client_groups None is not a list of lists"),
    (lambda t, m: m.__setitem__("client_groups", [[1]]), "client_groups [[1]] is not a list"),
])
def test_a_malformed_group_is_refused_saying_what_is_wrong(tmp_path, forge, expected):
    clients, tensors, meta = _uniform(tmp_path)
    forge(tensors, meta)
    with pytest.raises(ValueError) as info:
        client_states(tensors, meta, list(clients))
    assert expected in str(info.value)


def test_a_group_of_another_runs_clients_is_refused(tmp_path):
    _, tensors, meta = _uniform(tmp_path, n=4)
    with pytest.raises(ValueError, match=r"missing \[4\]"):
        client_states(tensors, meta, [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"unknown \[3\]"):
        client_states(tensors, meta, [0, 1, 2])


def test_a_format_2_checkpoint_is_refused_by_its_version(tmp_path):
    # format 2 wrote one tensor per client and name: its files name the version, not a
    # missing tensor
    path = tmp_path / "old.safetensors"
    save_checkpoint(path, {"server/w": torch.zeros(2), "client/0/w": torch.zeros(2)},
                    {"format": 2, "round": 1, "seconds": 0.0, "server_keys": ["w"]},
                    fingerprint=FINGERPRINT)
    tensors, meta = load_checkpoint(path, fingerprint=FINGERPRINT)
    with pytest.raises(CheckpointError, match="format 2, this version writes 3"):
        restore_round(path, tensors, meta, first_round=1, rounds=3, server=None,
                      fresh={"w": torch.zeros(2)}, num_clients=1,
                      device=torch.device("cpu"))


SMALL = dict(
    dataset="gaussian_mixture", clients=4, partition="shards:2", rounds=2, seed=3,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    dataset_options={"num_classes": 4, "dim": 10, "n": 320, "separation": 4.0},
)


def test_a_resumed_run_refuses_a_malformed_group_as_a_foreign_checkpoint(tmp_path):
    def stop(r, record):
        if r == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate("fedavg", out=tmp_path, round_callback=stop, **SMALL)
    path = tmp_path / CHECKPOINT_NAME
    from bayesfl.messages import read_safetensors_metadata

    fingerprint = read_safetensors_metadata(path.read_bytes())["bayesfl.fingerprint"]
    tensors, meta = load_checkpoint(path, fingerprint=fingerprint)
    name = next(k for k in tensors if k.startswith("clients/0/state/"))
    tensors[name] = tensors[name][1:]
    save_checkpoint(path, tensors, meta, fingerprint=fingerprint)
    with pytest.raises(CheckpointError, match="not written by this run") as info:
        simulate("fedavg", out=tmp_path, resume=True, **SMALL)
    assert f"{name} has 3 rows for the group's 4 client ids" in str(info.value)
    assert "--force" in str(info.value)
