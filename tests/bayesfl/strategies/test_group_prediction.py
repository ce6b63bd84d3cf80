"""A group's prediction, kept concatenated (``Strategy.predict_rows``) or split per client
(``predict_group``): the same numbers to the last bit, and what ``evaluate_group`` scores.

FedLog and parameter averaging compute a group's rows as one tensor and return it as is from
``predict_rows``; every other strategy gets the default, the concatenation of its
``predict_group``. Evaluation reads the rows, so a strategy's metrics do not depend on which
of the two it implements.
"""

import pytest
import torch
from strategy_helpers import evaluation_broadcast, run_round

from bayesfl.strategies import MAP_PLUGIN, PREDICTIVE
from calibration.accumulator import Accumulator

# FedPer's conjugate head on these tiny separable clients warns that its scale is unbounded:
# true, and beside the point here
pytestmark = pytest.mark.filterwarnings("ignore:the training labels' likelihood:UserWarning")

# one strategy of each implementation: FedLog's stacked posterior predictive, parameter
# averaging's stacked softmax (with and without a probabilistic head), and the default
STRATEGIES = [("fedlog", {}), ("fedavg", {}), ("fedper", {"head": "conjugate"}),
              ("fedproto", {})]


@pytest.fixture(params=STRATEGIES, ids=[name for name, _ in STRATEGIES])
def trained(request, build):
    name, options = request.param
    strategy, clients, state = build(name, **options)
    for r in range(2):
        state, _ = run_round(strategy, clients, state, r, batched=True)
    if name == "fedper":  # the head is fit in personalisation
        broadcast = evaluation_broadcast(strategy, state, 1)
        for c in clients:
            c.state = strategy.personalize(c.config, c.state, c.data, broadcast,
                                           torch.Generator().manual_seed(c.config.client_id))
    return strategy, clients, evaluation_broadcast(strategy, state, 1)


def test_the_rows_are_the_clients_predictions_concatenated_bit_for_bit(trained):
    strategy, clients, broadcast = trained
    configs, states = [c.config for c in clients], [c.state for c in clients]
    xs = [c.data.test_x for c in clients]
    rows = strategy.predict_rows(configs, states, broadcast, xs)
    group = strategy.predict_group(configs, states, broadcast, xs)
    assert set(rows) == set(group[0])
    for key, value in rows.items():
        assert value.dtype == torch.float64 and value.device.type == "cpu"
        assert torch.equal(value, torch.cat([p[key] for p in group])), key
    if strategy.is_posterior:
        assert set(rows) == {PREDICTIVE, MAP_PLUGIN}


def test_a_groups_evaluation_scores_its_rows_client_by_client(trained):
    # the kept probabilities are the group prediction's rows (bit for bit); each accumulator
    # is the client's own update of them: counts exact, float64 sums up to summation order
    # (per_group's ~1e-15, its docstring; 1e-12 is far below any metric's last digit shown)
    strategy, clients, broadcast = trained
    configs, states = [c.config for c in clients], [c.state for c in clients]
    group = strategy.predict_group(configs, states, broadcast, [c.data.test_x for c in clients])
    together = strategy.evaluate_group(configs, states, [c.data for c in clients], broadcast,
                                       keep_probs=True)
    for c, predicted, evaluation in zip(clients, group, together, strict=True):
        assert evaluation.client_id == c.config.client_id
        assert torch.equal(evaluation.labels, c.data.test_y)
        assert set(evaluation.probs) == set(predicted) == set(evaluation.accumulators)
        for key, acc in evaluation.accumulators.items():
            assert torch.equal(evaluation.probs[key], predicted[key]), key
            own = Accumulator(n_bins=15)
            own.update(predicted[key], c.data.test_y)
            mine, own = acc.state_dict(), own.state_dict()
            assert torch.equal(mine["bin_counts"], own["bin_counts"])
            assert torch.equal(mine["bin_correct_counts"], own["bin_correct_counts"])
            for name in ("bin_confidence_sums", "brier_sum", "nll_sum"):
                torch.testing.assert_close(mine[name], own[name], rtol=1e-12, atol=0)


def test_without_kept_probabilities_the_evaluations_hold_none(trained):
    strategy, clients, broadcast = trained
    evaluations = strategy.evaluate_group([c.config for c in clients],
                                          [c.state for c in clients],
                                          [c.data for c in clients], broadcast)
    assert all(e.probs == {} and e.labels is None for e in evaluations)
