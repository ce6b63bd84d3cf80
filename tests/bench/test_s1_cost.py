"""The S1 cost bench's repeated runs: the methods taken in turn, each method's seconds kept in
run order (the median is what the table reads)."""

from __future__ import annotations

from bench.s1_cost import interleaved


def test_repeats_take_the_methods_in_turn_and_keep_each_ones_seconds_in_order():
    calls = []
    clock = iter(range(1, 100))

    def run(method):
        calls.append(method)
        tick = next(clock)
        return float(tick), 10.0 * tick, f"{method}-{tick}"

    out = dict(interleaved(["fedper", "fedper-laplace"], 3, run))
    assert calls == ["fedper", "fedper-laplace"] * 3  # A, B, A, B, A, B: drift on both sides
    assert out["fedper"] == ([1.0, 3.0, 5.0], [10.0, 30.0, 50.0], "fedper-5")
    assert out["fedper-laplace"] == ([2.0, 4.0, 6.0], [20.0, 40.0, 60.0], "fedper-laplace-6")


def test_no_methods_left_to_run_runs_nothing():
    assert dict(interleaved([], 3, lambda method: (_ for _ in ()).throw(AssertionError))) == {}
