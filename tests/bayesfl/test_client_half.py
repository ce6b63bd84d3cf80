"""The client half runs apart from any server object: a separate process, fed only its config,
its data and the broadcast bytes, produces the same uploads as the simulator."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bayesfl.messages import decode
from bayesfl.simulate import simulate

SMALL = dict(
    dataset="gaussian_mixture", clients=4, partition="shards:2", rounds=2, seed=5,
    body="mlp:16", feature_dim=8, local_epochs=1, batch_size=16, lr=1e-2, progress=False,
    batched=False,  # the plain per-client path is the one a lone client runs
    dataset_options={"num_classes": 4, "dim": 10, "n": 320, "separation": 4.0},
)
SCRIPT = Path(__file__).with_name("client_half_process.py")


@pytest.mark.parametrize("strategy", ["fedlog", "fedavg"])
def test_a_client_half_in_another_process_sends_the_simulators_uploads(strategy, tmp_path):
    broadcasts: dict[int, bytes] = {}
    uploads: dict[tuple[int, int], bytes] = {}

    def keep_upload(round_, client_id, data):
        uploads[(round_, client_id)] = data
        return data

    result = simulate(strategy, upload_hook=keep_upload,
                      broadcast_hook=lambda r, data: broadcasts.__setitem__(r, data), **SMALL)
    assert len(broadcasts) == (3 if strategy == "fedlog" else 2)
    for client in result.clients:
        folder = tmp_path / f"client{client.client_id}"
        folder.mkdir()
        run = {**{k: SMALL[k] for k in ("clients", "rounds", "seed", "feature_dim",
                                        "local_epochs", "lr", "batch_size")},
               "strategy": strategy, "strategy_options": {}, "client_id": client.client_id,
               "num_classes": 4, "input_shape": [10], "bodies": [SMALL["body"]]}
        (folder / "config.json").write_text(json.dumps(run))
        d = client.data
        save_file({"train_x": d.train_x, "train_y": d.train_y, "test_x": d.test_x,
                   "test_y": d.test_y}, folder / "data.safetensors")
        for r, data in broadcasts.items():
            (folder / f"broadcast_{r}.bin").write_bytes(data)
    # one process for every client (an interpreter that imports torch costs seconds)
    folders = [str(tmp_path / f"client{c.client_id}") for c in result.clients]
    subprocess.run([sys.executable, str(SCRIPT), *folders], check=True, timeout=300)
    for client in result.clients:
        folder = tmp_path / f"client{client.client_id}"
        for r in broadcasts:
            # the same upload, bit for bit (the encoded bytes may differ only in the order of
            # safetensors' metadata keys, which its writer does not fix)
            mine = decode((folder / f"upload_{r}.bin").read_bytes())
            sent = decode(uploads[(r, client.client_id)])
            assert mine.header == sent.header and mine.tensors.keys() == sent.tensors.keys()
            for name, tensor in sent.tensors.items():
                assert torch.equal(mine.tensors[name], tensor), (r, name)
