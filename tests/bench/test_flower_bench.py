"""bench/flower.py's per-message figures come from fresh interpreters: Flower's own
``flwr-clientapp`` command, then the ClientApp and what its handler imports (the helper the
handler itself calls, so the bench measures what a message pays)."""

import math

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
