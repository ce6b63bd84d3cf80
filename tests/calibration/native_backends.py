"""The compiled calibration kernels in tests: skipped with a reason where none can be built.

A machine without a C compiler still runs every test of the torch sweep; the tests of the
compiled kernels skip there, saying why. Where the environment demands the kernel
(``BAYESFL_REQUIRE_NATIVE=1``, which ``.ci/run`` sets), ``native_sweep.library`` raises instead
and those tests fail: CI cannot pass without checking the kernel.
"""

import pytest

from calibration import native_sweep


def require_kernel(kind: str):
    """The ``kind`` kernel ("native" or "portable"), or skip the calling test with the reason
    it is unavailable (under BAYESFL_REQUIRE_NATIVE=1, library() raises: the test fails)."""
    lib = native_sweep.library(kind)
    if lib is None:
        pytest.skip(f"no {kind} calibration kernel here ({native_sweep.unavailable_reason(kind)})"
                    f"; set {native_sweep.REQUIRE_VARIABLE}=1 to make this a failure")
    return lib


def forget_kernels(monkeypatch) -> None:
    """As in a new process: no kernel loaded or refused yet (restored after the test)."""
    monkeypatch.setattr(native_sweep, "_libraries", {})
    monkeypatch.setattr(native_sweep, "_problems", {})
