"""The compiled kernel is loaded only from files nobody else can have written.

Loading a shared library runs its code. The specification checked here: the cache lives in a
per-user directory (never a shared one such as /tmp under a predictable name), created 0700; a
cache directory owned by someone else or writable by group/others is refused (the kernel is then
built in a fresh private directory, or, if even that fails the checks, the torch sweep is used
with a warning); a cached library that is writable by others, owned by someone else or a symlink
is never loaded but rebuilt over; a planted library's code never runs. And: without a compiler
the kernel tests skip with a reason, unless BAYESFL_REQUIRE_NATIVE=1 makes that a failure.

"Owned by someone else" is simulated by changing the uid the checks compare against (a test
cannot chown files without root); group/other write permission is set for real with chmod.
"""

import ctypes
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from calibration_reference import calibrated_labels, random_probs
from native_backends import forget_kernels, require_kernel

from calibration import native_sweep
from calibration.errors import CalibrationError, NativeKernelError
from calibration.metrics import evaluate

REPO = Path(__file__).resolve().parents[2]
PLANTED_SOURCE = r"""
#include <fcntl.h>
#include <unistd.h>
/* Runs when the library is loaded: the marker file proves the planted code ran. */
__attribute__((constructor)) static void planted(void) {
    int fd = open(MARKER, O_CREAT | O_WRONLY, 0600);
    if (fd >= 0) close(fd);
}
int bfl_sweep_variant(void) { return 77; }
"""


@pytest.fixture
def fresh(monkeypatch):
    """No library loaded yet in this process, nothing required, the compiled backend chosen."""
    forget_kernels(monkeypatch)
    monkeypatch.delenv(native_sweep.REQUIRE_VARIABLE, raising=False)
    monkeypatch.setenv("BAYESFL_NATIVE", "portable")


@pytest.fixture
def compiled(monkeypatch):
    """As ``fresh``, for tests that build: they skip without a C compiler (fail if required)."""
    require_kernel("portable")  # from the real cache, before the registry is emptied
    forget_kernels(monkeypatch)
    monkeypatch.delenv(native_sweep.REQUIRE_VARIABLE, raising=False)
    monkeypatch.setenv("BAYESFL_NATIVE", "portable")


@pytest.fixture
def loads(monkeypatch):
    """Every path handed to ctypes.CDLL in this test."""
    paths = []
    real = ctypes.CDLL

    def spy(name, *args, **kwargs):
        paths.append(Path(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", spy)
    return paths


def plant(tmp_path, target: Path) -> Path:
    """Compile a library at ``target`` whose loading creates a marker file; return the marker."""
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_SOURCE)
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([native_sweep._compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"',
                    "-o", str(target), str(source)], check=True, capture_output=True, timeout=120)
    return marker


def expected_name(kind="portable") -> str:
    return native_sweep._library_name(native_sweep._compiler(), kind)


def scores():
    rng = np.random.default_rng(9)
    probs = random_probs(rng, 500, 6, dtype=np.float32)
    return probs, calibrated_labels(rng, probs)


# -- where the cache is --------------------------------------------------------------------------
def test_the_cache_is_per_user_and_not_in_the_shared_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("BAYESFL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert native_sweep.cache_dir() == tmp_path / "home" / ".cache" / "bayesfl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_sweep.cache_dir() == tmp_path / "xdg" / "bayesfl"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG spec: ignore relative paths
    assert native_sweep.cache_dir() == tmp_path / "home" / ".cache" / "bayesfl"
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(tmp_path / "mine"))
    assert native_sweep.cache_dir() == tmp_path / "mine"


def test_a_new_cache_directory_and_library_are_private(compiled, monkeypatch, tmp_path):
    cache = tmp_path / "new" / "cache"
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    lib = native_sweep.library("portable")
    assert Path(lib._name) == cache / expected_name()
    for path in (cache, cache / expected_name()):
        info = os.stat(path)
        assert info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o700, oct(info.st_mode)
    assert sorted(p.name for p in cache.iterdir()) == [expected_name()]  # no scratch left


@pytest.mark.parametrize("umask", [0o002, 0o000], ids=oct)
def test_a_lax_umask_does_not_make_the_library_writable_by_others(compiled, monkeypatch, tmp_path,
                                                                  umask):
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(tmp_path / "cache"))
    previous = os.umask(umask)
    try:
        lib = native_sweep.library("portable")
    finally:
        os.umask(previous)
    assert lib is not None
    assert stat.S_IMODE(os.stat(lib._name).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) & 0o022 == 0


# -- the checks themselves ------------------------------------------------------------------------
def test_the_checks_name_owner_and_write_permission(monkeypatch, tmp_path):
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    library = directory / "lib.so"
    library.write_bytes(b"\x7fELF")
    library.chmod(0o700)
    assert native_sweep._directory_problem(directory) is None
    assert native_sweep._file_problem(library) is None

    library.chmod(0o720)
    assert "writable by its group or by others (mode 720)" in native_sweep._file_problem(library)
    library.chmod(0o702)
    assert "writable by its group or by others" in native_sweep._file_problem(library)
    directory.chmod(0o770)
    assert "writable by its group" in native_sweep._directory_problem(directory)
    directory.chmod(0o700)
    library.chmod(0o700)

    monkeypatch.setattr(native_sweep, "_uid", lambda: os.geteuid() + 4242)  # someone else
    assert f"owned by uid {os.geteuid()}, not by this user" in (
        native_sweep._directory_problem(directory))
    assert "not by this user" in native_sweep._file_problem(library)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_symlinked_library_and_a_non_directory_are_refused(tmp_path):
    real = tmp_path / "real.so"
    real.write_bytes(b"\x7fELF")
    real.chmod(0o700)
    (tmp_path / "link.so").symlink_to(real)
    assert "cannot open" in native_sweep._file_problem(tmp_path / "link.so")  # O_NOFOLLOW
    assert "not a directory" in native_sweep._directory_problem(real)
    os.mkfifo(tmp_path / "fifo.so")
    assert "not a regular file" in native_sweep._file_problem(tmp_path / "fifo.so")


# -- planted libraries are never loaded ----------------------------------------------------------
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=oct)
def test_a_library_planted_in_a_shared_cache_directory_is_never_loaded(
        compiled, monkeypatch, tmp_path, loads, caplog, mode):
    cache = tmp_path / "shared-cache"
    planted = cache / expected_name()
    marker = plant(tmp_path, planted)
    cache.chmod(mode)
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    loads.clear()

    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        lib = native_sweep.library("portable")
    assert not marker.exists(), "the planted library's code ran"
    assert planted not in loads
    assert lib is not None and lib.bfl_sweep_variant() == 0  # the real kernel, built privately
    assert Path(lib._name).parent.parent == tmp_path / "tmp"
    assert any("writable by its group or by others" in r.message for r in caplog.records)
    probs, labels = scores()
    assert evaluate(probs, labels)["accuracy"] == np.mean(probs.argmax(1) == labels)


def test_a_cache_directory_owned_by_someone_else_is_refused(compiled, monkeypatch, tmp_path,
                                                            loads, caplog):
    """As if another user owned the directory: nothing in it is loaded. Every directory the
    process creates then looks foreign too, so no kernel passes: the torch sweep is used."""
    cache = tmp_path / "their-cache"
    planted = cache / expected_name()
    marker = plant(tmp_path, planted)
    cache.chmod(0o700)
    probs, labels = scores()
    monkeypatch.setenv("BAYESFL_NATIVE", "0")
    expected = evaluate(probs, labels)
    monkeypatch.setenv("BAYESFL_NATIVE", "portable")
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    monkeypatch.setattr(native_sweep, "_uid", lambda: os.geteuid() + 4242)
    loads.clear()

    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        assert native_sweep.library("portable") is None
        assert evaluate(probs, labels) == expected  # the torch sweep, same numbers
    assert not marker.exists() and planted not in loads and loads == []
    messages = " ".join(r.message for r in caplog.records)
    assert "not using the kernel cache" in messages and "not by this user" in messages
    assert "torch sweep" in messages
    assert "not by this user" in native_sweep.unavailable_reason("portable")

    forget_kernels(monkeypatch)
    monkeypatch.setenv(native_sweep.REQUIRE_VARIABLE, "1")
    with pytest.raises(NativeKernelError, match="not by this user"):
        native_sweep.library("portable")


@pytest.mark.parametrize("mode", [0o722, 0o766], ids=oct)
def test_a_cached_library_writable_by_others_is_rebuilt_not_loaded(compiled, monkeypatch,
                                                                   tmp_path, loads, caplog, mode):
    cache = tmp_path / "cache"
    planted = cache / expected_name()
    marker = plant(tmp_path, planted)
    cache.chmod(0o700)
    planted.chmod(mode)
    planted_bytes = planted.read_bytes()
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    loads.clear()

    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        lib = native_sweep.library("portable")
    assert not marker.exists(), "the planted library's code ran"
    assert lib.bfl_sweep_variant() == 0
    assert loads == [planted]  # loaded once: after the rebuild
    assert planted.read_bytes() != planted_bytes
    assert stat.S_IMODE(planted.stat().st_mode) == 0o700
    assert any("writable by its group or by others" in r.message and "rebuilding" in r.message
               for r in caplog.records)


def test_a_cached_library_that_is_a_symlink_is_rebuilt_not_followed(compiled, monkeypatch,
                                                                    tmp_path, loads):
    elsewhere = tmp_path / "world-writable"
    elsewhere.mkdir()
    marker = plant(tmp_path, elsewhere / "evil.so")
    elsewhere.chmod(0o777)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / expected_name()).symlink_to(elsewhere / "evil.so")
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    loads.clear()

    lib = native_sweep.library("portable")
    assert not marker.exists()
    assert lib.bfl_sweep_variant() == 0
    assert not (cache / expected_name()).is_symlink()
    assert elsewhere / "evil.so" not in loads


def test_a_cached_file_that_does_not_load_as_the_kernel_is_rebuilt(compiled, monkeypatch,
                                                                   tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / expected_name()).write_bytes(b"not a shared library")
    (cache / expected_name()).chmod(0o700)
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(cache))
    with caplog.at_level("WARNING", logger=native_sweep.__name__):
        lib = native_sweep.library("portable")
    assert lib.bfl_sweep_variant() == 0
    assert any("does not load" in r.message for r in caplog.records)


# -- without a compiler: skipped, unless required -------------------------------------------------
def test_without_a_compiler_the_kernel_is_unavailable_or_required(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(native_sweep, "_compiler", lambda: None)
    monkeypatch.setenv("BAYESFL_CACHE_DIR", str(tmp_path))
    assert native_sweep.library("portable") is None
    assert "no C compiler" in native_sweep.unavailable_reason("portable")
    with pytest.raises(pytest.skip.Exception, match=r"no C compiler.*BAYESFL_REQUIRE_NATIVE=1"):
        require_kernel("portable")
    probs, labels = scores()
    assert evaluate(probs, labels)["count"] == 500  # the torch sweep

    monkeypatch.setenv(native_sweep.REQUIRE_VARIABLE, "1")
    assert native_sweep.required()
    with pytest.raises(NativeKernelError, match=r"required \(BAYESFL_REQUIRE_NATIVE=1\) but "
                                                r"unavailable: no C compiler"):
        require_kernel("portable")
    with pytest.raises(CalibrationError, match="no C compiler"):
        evaluate(probs, labels)  # no silent fallback where the kernel is demanded


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_only_a_true_value_requires_the_kernel(monkeypatch, value):
    monkeypatch.setenv(native_sweep.REQUIRE_VARIABLE, value)
    assert not native_sweep.required()


def test_ci_requires_the_kernel():
    ci = (REPO / ".ci" / "run").read_text()
    assert f"export {native_sweep.REQUIRE_VARIABLE}=1" in ci


KERNEL_TESTS = ["tests/calibration/test_calibration_native_sweep.py", "-k",
                "test_kernel_rows_are_exact and float32"]


def run_without_compiler(tmp_path, require: bool) -> subprocess.CompletedProcess:
    """pytest on real kernel tests in a process that finds no C compiler."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if key not in (native_sweep.REQUIRE_VARIABLE, "CC", "PATH")}
    env.update(PATH=str(empty), CC=str(tmp_path / "no-such-cc"),
               BAYESFL_CACHE_DIR=str(tmp_path / "cache"))
    if require:
        env[native_sweep.REQUIRE_VARIABLE] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *KERNEL_TESTS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # a pytest process of its own: ~10-20 s on a busy machine
def test_kernel_tests_skip_with_the_reason_without_a_compiler(tmp_path):
    done = run_without_compiler(tmp_path, require=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" not in done.stdout.splitlines()[-1]
    assert "skipped" in done.stdout.splitlines()[-1]
    assert "no portable calibration kernel here (no C compiler found" in done.stdout
    assert "set BAYESFL_REQUIRE_NATIVE=1 to make this a failure" in done.stdout


@pytest.mark.slow  # a pytest process of its own: ~10-20 s on a busy machine
def test_kernel_tests_fail_without_a_compiler_where_it_is_required(tmp_path):
    done = run_without_compiler(tmp_path, require=True)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "failed" in done.stdout.splitlines()[-1]
    assert "NativeKernelError" in done.stdout and "no C compiler found" in done.stdout
