"""The conformal step on Flower (in-process ServerApp and ClientApps, the handlers Flower
runs): the same thresholds, coverage and bytes as the simulator."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from test_flower import SMALL, serve, simulate_small, task_identity  # noqa: F401


@pytest.mark.parametrize("conformal", ["aps:0.2", "lac:0.2:one-shot", "raps:0.2:sketch"])
def test_conformal_on_flower_equals_the_simulator(task_identity, tmp_path, conformal):  # noqa: F811
    out = tmp_path / "run"
    summary = serve({**SMALL, "strategy": "fedlog", "threads": 1, "conformal": conformal,
                     "out": str(out)}).run()
    sim = simulate_small("fedlog", conformal=conformal)
    flower, simulated = summary["conformal"], sim.summary["conformal"]
    assert flower["error"] is None and flower["rejections"] == []
    for key in ("participants", "steps", "held_out_samples", "bytes_up", "bytes_down",
                "floats_up", "floats_down", "evaluation_bytes_up", "evaluation_bytes_down"):
        assert flower[key] == simulated[key], key
    assert flower["predictives"].keys() == simulated["predictives"].keys() != set()
    for key, f in simulated["predictives"].items():
        # the same float32 predictions on both transports (one row at a time: batched=False),
        # so the same scores and the same threshold, bit for bit
        assert flower["predictives"][key] == f, key
    if conformal.endswith(("one-shot", "sketch")):
        assert flower["bytes_up_per_client"] <= 1024  # the threshold's calibration
    assert (out / "conformal.png").exists() and (out / "conformal.md").exists()
