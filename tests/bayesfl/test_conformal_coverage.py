"""End to end, the conformal step's sets cover at the promised rate: over independent runs
(each its own hold-out split, training and calibration), the mean pooled coverage of the exact
federated threshold is >= 1 - alpha up to Monte-Carlo error. A leak of the held-out rows into
training, fine-tuning or a head fit makes their scores optimistic and the threshold too small;
the test shows it would see one: the same models calibrated on their training rows (a leak at
its worst) fall far below the target (issue 45)."""

from __future__ import annotations

import math
import statistics

import torch

from bayesfl import simulate
from calibration.conformal import conformal_threshold, conformity_scores

ALPHA = 0.2
SEEDS = range(6)


def _run(seed: int) -> tuple[float, float]:
    """(the run's pooled coverage, the coverage of a threshold fitted on the training rows)."""
    result = simulate("fedavg-ft", dataset="digits", clients=3, partition="iid", rounds=1,
                      local_epochs=10, seed=seed, progress=False, conformal=f"lac:{ALPHA}")
    figures = result.summary["conformal"]["predictives"]["predictive"]
    held_rows = figures["held_out_rows"]
    train_scores, test_scores = [], []
    for c in result.clients:
        assert c.data.train_indices is not None
        with torch.no_grad():
            for x, y, out in ((c.data.train_x, c.data.train_y, train_scores),
                              (c.data.test_x, c.data.test_y, test_scores)):
                probs = result.strategy.predict(c.config, result.client_state(c.client_id),
                                                result.evaluation_broadcast, x)["predictive"]
                out.append(conformity_scores(probs.double(), y, "lac"))
    train, test = torch.cat(train_scores), torch.cat(test_scores)
    # a leak at its worst: as many training rows as the run held out, as calibration rows
    picked = train[torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(seed))
                   [:held_rows]]
    leaky = float((test <= conformal_threshold(picked, ALPHA)).double().mean())
    return figures["coverage"], leaky


def test_mean_coverage_over_runs_reaches_the_target_and_a_leak_would_show() -> None:
    runs = [_run(seed) for seed in SEEDS]
    honest = [r[0] for r in runs]
    leaky = [r[1] for r in runs]
    # Monte-Carlo error of one run's coverage: the calibration draw (Beta, variance
    # alpha (1 - alpha) / (N + 2), N = 270 held-out rows) plus the 450 test rows' binomial
    # variance; six runs: SE = 0.0125. Three of them either side.
    se = math.sqrt(ALPHA * (1 - ALPHA) * (1 / 272 + 1 / 450) / len(SEEDS))
    assert statistics.fmean(honest) >= 1 - ALPHA - 3 * se
    assert statistics.fmean(honest) <= 1 - ALPHA + 1 / 271 + 3 * se  # no needless slack
    assert statistics.fmean(leaky) < 1 - ALPHA - 3 * se  # the test has the power to see a leak
