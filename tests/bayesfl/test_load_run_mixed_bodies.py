"""bayesfl.load_run with mixed bodies: the clients' states lie in several stacked layout
groups, their members interleaved (client k has body k mod 2), and every client gets back its
own row of its own group: its state and predictions equal the live result's, tensor for
tensor."""

import pytest
import torch

import bayesfl
from bayesfl.loaded_run import load_run
from bayesfl.run_directory import RESULT_NAME
from bayesfl.run_result import read_run_result

CLIENTS = 5
RUN = {"clients": CLIENTS, "partition": "iid", "rounds": 2, "local_epochs": 1,
       "feature_dim": 8, "body": "mlp:16,mlp:8", "progress": False, "threads": 1}


@pytest.fixture(scope="module", params=["fedlog", "fedproto"])
def mixed_run(request, tmp_path_factory):
    """A run of personal states (each client trains its own network: FedLog's posterior
    strategy, FedProto's prototypes) over two interleaved body specs, and its directory."""
    out = tmp_path_factory.mktemp("runs") / request.param
    return bayesfl.simulate(request.param, out=out, **RUN), out


def test_the_result_file_holds_two_interleaved_layout_groups(mixed_run):
    result, out = mixed_run
    tensors, meta = read_run_result(out / RESULT_NAME)
    groups = [tensors[f"clients/{g}/ids"].tolist() for g in range(len(meta["client_groups"]))]
    assert sorted(map(sorted, groups)) == [[0, 2, 4], [1, 3]]
    assert [c.config.body for c in result.clients] == ["mlp:16", "mlp:8"] * 2 + ["mlp:16"]


def test_every_client_loads_its_own_state_and_predicts_as_the_run_did(mixed_run):
    result, out = mixed_run
    run = load_run(out)
    x = torch.rand(7, 64, generator=torch.Generator().manual_seed(1))
    states = [result.client_state(k) for k in range(CLIENTS)]
    for k in range(CLIENTS):
        loaded = run.client_state(k)
        assert loaded.keys() == states[k].keys(), k
        for name, value in states[k].items():  # bit for bit: the file stores the tensors
            assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), \
                (k, name)
        assert torch.equal(run.predict_proba(k, x), result.predict_proba(k, x)), k
    # the check can tell clients apart: within a group no two clients' states are equal
    for a in range(CLIENTS):
        for b in range(a + 2, CLIENTS, 2):
            assert any(not torch.equal(states[a][n], states[b][n]) for n in states[a]), (a, b)
