"""The table that publishes ``bench/head_prior_sweep.py``: what a cheaper choice of the Laplace
head's prior precision than its refitted evidence would cost."""

from __future__ import annotations

from bench.published_tables import head_prior_table


def _point(lam: float, nll: float) -> dict:
    return {"prior_precision": lam, "nll": nll, "ece": 0.02, "accuracy": 0.9}


def test_the_table_compares_the_evidences_choice_with_the_grids_best_and_its_far_end():
    grid = [_point(1.0, 0.50), _point(10.0, 0.398), _point(90.0, 0.48)]
    record = {"grid": [1.0, 10.0, 90.0], "seeds": [0], "commit": "abc1234",
              "date": "2026-11-29", "machine": "CPU test",
              "sizes": [{"rows": 250, "evidence": _point(6.0, 0.400), "grid": grid,
                         "laplace_torch_lambda": _point(4.5, 0.402)}]}
    table = head_prior_table([record])
    assert "| 250 | 6 | 0.4000 | 0.0200 | 0.5000 | 0.3980 | 0.4800 | 4.5 | 0.4020 |" in table
    # 0.400 against the grid's best 0.398: +0.5%
    assert "best held-out NLL (λ = 10, chosen on the test rows): **holds** (+0.5%)" in table
    assert "fixed MAP) within 1% of the evidence's NLL: **holds** (+0.5%)" in table
    assert "the grid's far end, λ = 90: +20.0%." in table
    record["sizes"][0]["evidence"] = _point(6.0, 0.410)  # 3% above the grid's best
    assert "**does not hold** (+3.0%)" in head_prior_table([record])
    record["sizes"][0]["laplace_torch_lambda"] = _point(1.0, 0.451)  # 10% above the evidence's
    assert "evidence's NLL: **does not hold** (+10.0%)" in head_prior_table([record])
