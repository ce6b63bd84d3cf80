"""``feature_scale=1`` is the paper's model (FedLog's default before issue 40): no held-out
slice, every training row in the statistics, and the server's head the conjugate MAP of their
sum at s = 1.

These are properties of the run, not recorded digits, so they hold on any CPU's rounding (the
digests of a trained run differ between AVX2 and AVX-512 machines)."""

import torch
from strategy_helpers import SIZES, context, make_clients, run_round

from bayesfl.strategies import make_strategy
from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics


def three_rounds(**options):
    strategy = make_strategy("fedlog", context(sizes=SIZES), **options)
    clients = make_clients(strategy, SIZES)
    state = strategy.init()
    uploads = []
    for r in range(3):
        state, uploads = run_round(strategy, clients, state, r)
    return strategy, clients, state, uploads


def test_the_papers_scale_uploads_every_training_row_and_no_held_out_slice():
    _, clients, _, uploads = three_rounds(feature_scale=1)
    for client, upload in zip(clients, uploads, strict=True):
        assert "heldout_statistics" not in upload.tensors
        assert round(float(upload.tensors["num_samples"])) == len(client.data.train_y)
        counts = torch.bincount(client.data.train_y, minlength=3).to(torch.float64)
        # the bias column of the statistics is the class counts (float32 upload of integers)
        torch.testing.assert_close(upload.tensors["statistics"][:, 0].double(), counts,
                                   rtol=0, atol=0)


def test_the_papers_head_is_the_conjugate_map_of_the_summed_statistics_at_scale_1():
    _, _, state, uploads = three_rounds(feature_scale=1)
    table = sum(u.tensors["statistics"].double() for u in uploads)
    n = sum(round(float(u.tensors["num_samples"])) for u in uploads)
    stats = SufficientStatistics(table, n, privatized=True)
    expected = ConjugatePosterior(ConjugatePrior(nu=1.0), stats, feature_scale=1.0).map()
    # the server solves the same root in float64 and stores the head in float32: 1e-6
    torch.testing.assert_close(state["head"].double(), expected, rtol=1e-6,
                               atol=1e-6 * float(expected.abs().max()))


def test_the_default_differs_from_the_papers_scale():
    _, _, _, default_uploads = three_rounds()
    assert all("heldout_statistics" in u.tensors for u in default_uploads)
