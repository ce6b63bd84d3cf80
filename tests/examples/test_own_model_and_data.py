"""examples/own_model_and_data.py, the acceptance script of issue 26, runs as written: its own
nn.Module body and (x, y) arrays through FedLog, then load_run gives back the same summary and
a posterior to sample, in the script and in this (another) process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bayesfl

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "own_model_and_data.py"


@pytest.mark.slow
def test_the_script_runs_fedlog_on_its_own_body_and_data_and_loads_the_run(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert len(SCRIPT.read_text().splitlines()) <= 25  # a short script, docstring included
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("accuracy ") and line.endswith("posterior draws (4, 10, 33)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedlog" and summary["data"]["name"] == "custom"
    assert summary["accuracy"] > 0.5  # digits, 5 clients of 2 classes: far above chance (0.1)
    # here the script's make_body is not defined: the run says how to register it
    with pytest.raises(bayesfl.ConfigError, match="register_body"):
        bayesfl.load_run(out)
    namespace: dict = {}
    source = SCRIPT.read_text()
    exec(compile(source[:source.index("out = ")], str(SCRIPT), "exec"), namespace)
    bayesfl.register_body("__main__:make_body", namespace["make_body"])
    try:
        run = bayesfl.load_run(out)
    finally:
        from bayesfl.bodies import unregister_body

        unregister_body("__main__:make_body")
    assert run.summary == summary
    draws = run.posterior(3).sample(2, generator=torch.Generator().manual_seed(0))
    assert draws.shape == (2, 10, 33) and torch.isfinite(draws).all()
