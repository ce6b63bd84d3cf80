"""Client halves on their own, as a separate process runs them:
``python client_half_process.py DIR [DIR ...]``.

``DIR`` holds what a real client would have and nothing else: ``config.json`` (the run
configuration and the client's id), ``data.safetensors`` (its train/test tensors) and
``broadcast_<round>.bin`` (the encoded broadcasts it received). The process builds the strategy
from the run configuration, initialises its own state (``init_client``), runs ``fit`` on each
broadcast in turn and writes each encoded upload to ``upload_<round>.bin``. No server object,
no simulator: only these bytes. Several directories are run one after the other, each from the
global RNG state the process started with (as if each had a process of its own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from bayesfl.data.clients import ClientData
from bayesfl.messages import decode, encode
from bayesfl.strategies import StrategyContext, make_strategy
from bayesfl.strategies.base import derived_seed
from bayesfl.training import LocalTraining


def main(folder: Path) -> None:
    run = json.loads((folder / "config.json").read_text())
    context = StrategyContext(
        num_classes=run["num_classes"], feature_dim=run["feature_dim"],
        training=LocalTraining(epochs=run["local_epochs"], lr=run["lr"],
                               batch_size=run["batch_size"]),
        rounds=run["rounds"], seed=run["seed"], input_shape=tuple(run["input_shape"]),
        bodies=tuple(run["bodies"]), clients=run["clients"])
    strategy = make_strategy(run["strategy"], context, **run["strategy_options"])
    tensors = load_file(folder / "data.safetensors")
    config = context.client_config(run["client_id"])
    data = ClientData(config.client_id, tensors["train_x"], tensors["train_y"],
                      tensors["test_x"], tensors["test_y"])
    state = strategy.init_client(config)
    for path in sorted(folder.glob("broadcast_*.bin"), key=lambda p: int(p.stem.split("_")[1])):
        broadcast = decode(path.read_bytes())
        r = broadcast.header.round
        generator = torch.Generator().manual_seed(derived_seed(run["seed"], r, config.client_id))
        state, upload = strategy.fit(config, state, data, broadcast, generator)
        (folder / f"upload_{r}.bin").write_bytes(encode(upload))


if __name__ == "__main__":
    for name in sys.argv[1:]:
        with torch.random.fork_rng():
            main(Path(name))
