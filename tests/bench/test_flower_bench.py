"""bench/flower.py's per-message figures come from fresh interpreters: Flower's own
``flwr-clientapp`` command, then the ClientApp and what its handler imports (the helper the
handler itself calls, so the bench measures what a message pays)."""

import math

import pytest

from bench import flower as bench_flower


def test_the_per_message_figures_run_fresh_interpreters_and_return_seconds():
    for figure in (bench_flower.flower_process_seconds(repeats=1),
                   bench_flower.clientapp_import_seconds(repeats=1)):
        assert isinstance(figure, float) and math.isfinite(figure) and figure > 0


def test_flowers_floor_constant_is_the_supernodes_pull_sleep_in_the_installed_flower():
    # the floor the bench reports rests on Flower's hard-coded sleep after an empty pull: if a
    # Flower release changes it, the bench's floor must change with it
    import inspect

    from flwr.supernode import start_client_internal

    source = inspect.getsource(start_client_internal)
    assert f"time.sleep({bench_flower.PULL_SLEEP:g})" in source


def _record(wall: float) -> dict:
    """A round record as the ServerApp writes it, its timeline built by the ServerApp's own
    function from one message's stamps (the node's delivered stamp missing, as in Flower 1.41)."""
    from bayesfl.flower.protocol import round_timeline

    t0 = 1_800_000_000.0
    stamps = {"at.pushed": t0 + 0.01, "at.process": t0 + 2.5, "at.loaded": t0 + 4.0,
              "at.start": t0 + 4.01, "at.end": t0 + 7.0, "at.received": t0 + 7.6,
              "import": 2.0, "setup": 0.125, "evaluate": 0.25, "fit": 0.5, "save": 0.0625,
              "encode": 0.001, "cpu": 4.5}
    timeline = round_timeline(t0, t0 + 7.625, {1: stamps})
    return {"round": 1, "seconds": wall, "flower": {"timeline": timeline}}


def test_a_rounds_split_follows_its_timeline_and_adds_up_to_its_wall_time():
    row = bench_flower.round_split(_record(wall=7.75))
    expected = {"before_push": 0.01, "pull_and_spawn": 2.49, "flower_start": 1.51,
                "import": 2.0, "setup": 0.125, "evaluate_and_fit": 0.75,
                "save_and_encode": 0.0635, "reply": 0.6, "after_last_reply": 0.025}
    for key, value in expected.items():
        # the stamps are ~1.8e9 s: differences of them carry ~1e-7 s of float64 rounding
        assert row[key] == pytest.approx(value, abs=1e-6), key
    # the handler's own bookkeeping (2.99 s handler - 2.9385 s of parts) and the 0.125 s the
    # server spent after the timeline's end are what is left
    assert row["rest"] == pytest.approx(2.99 - 2.9385 + 0.125, abs=1e-6)
    assert sum(row[k] for k in bench_flower.SPLIT) == pytest.approx(7.75, abs=1e-9)
    assert (row["client"], row["cpu"], row["wall"]) == (1, 4.5, 7.75)


def test_a_round_without_a_timeline_is_refused():
    with pytest.raises(ValueError, match=r"no flower\.timeline"):
        bench_flower.round_split({"round": 1, "seconds": 3.0, "flower": {}})
