"""Your own model and data: a torch body and (x, y) arrays, FedLog, then load_run."""
import sys

from sklearn.datasets import load_digits
from torch import nn

import bayesfl

x, y = load_digits(return_X_y=True)  # your arrays: x (N, 64) floats, y (N,) labels 0..9


def make_body() -> nn.Module:  # a fresh network per client: inputs -> (B, 32) features >= 0
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())


out = sys.argv[1] if len(sys.argv) > 1 else "runs/own_model_and_data"
result = bayesfl.simulate("fedlog", data=(x / 16, y), body=make_body, feature_dim=32,
                          clients=5, rounds=3, out=out, force=True, progress=False)
run = bayesfl.load_run(out)  # the finished run, read back from its directory
assert run.summary == result.summary
draws = run.posterior(0).sample(4)  # head parameters drawn from client 0's posterior
print(f"accuracy {run.summary['accuracy']:.3f}, posterior draws {tuple(draws.shape)}")
