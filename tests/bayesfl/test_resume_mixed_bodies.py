"""Resuming a run whose clients have mixed bodies: the checkpoint stacks the clients' states per
layout group (two groups here, their members interleaved), and a run stopped after round 1 and
resumed equals the uninterrupted one — its metrics, summary and every client's final state."""

import json

import pytest
import torch

from bayesfl.loaded_run import load_run
from bayesfl.simulate import simulate

CLIENTS = 5
# FedLog's clients train their own bodies; with fraction 0.6 some clients sit rounds out, so
# the checkpoint holds states of different rounds in each group
RUN = dict(dataset="gaussian_mixture", clients=CLIENTS, partition="iid", rounds=3, seed=3,
           body="mlp:16,mlp:8", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2,
           fraction=0.6, progress=False, threads=1,
           dataset_options={"num_classes": 4, "dim": 10, "n": 300, "separation": 4.0})


def numbers(records):
    """Records without wall-clock times."""
    if isinstance(records, dict):
        return {k: numbers(v) for k, v in records.items() if not k.startswith("seconds")}
    if isinstance(records, list):
        return [numbers(r) for r in records]
    return records


def stop_after(round_):
    def callback(r, record):
        if r == round_:
            raise KeyboardInterrupt(f"stopped after round {round_}")
    return callback


def test_a_mixed_body_run_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    simulate("fedlog", out=full, **RUN)
    with pytest.raises(KeyboardInterrupt):
        simulate("fedlog", out=cut, round_callback=stop_after(1), **RUN)
    simulate("fedlog", out=cut, resume=True, **RUN)

    def read(run_dir, name):
        text = (run_dir / name).read_text()
        return numbers([json.loads(line) for line in text.splitlines()] if name.endswith(
            "jsonl") else json.loads(text))

    # the same machine and seed: a resumed run reproduces the numbers exactly (the project's
    # resume contract), so equality, not a tolerance
    assert read(cut, "metrics.jsonl") == read(full, "metrics.jsonl")
    assert read(cut, "summary.json") == read(full, "summary.json")
    a, b = load_run(full), load_run(cut)
    assert [c.config.body for c in a.clients] == ["mlp:16", "mlp:8"] * 2 + ["mlp:16"]
    for k in range(CLIENTS):
        sa, sb = a.client_state(k), b.client_state(k)
        assert sa.keys() == sb.keys(), k
        for name in sa:
            assert torch.equal(sa[name], sb[name]), (k, name)
