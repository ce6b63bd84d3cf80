"""The native sweep: every per-row quantity of `calibration.row_scores` in one read.

The torch sweep needs about seven passes over an (N, K) probability matrix (a max, a min, a row
sum, a norm, a gather, ...), each a full read of memory. ``native_sweep.c`` fuses validation,
top-label confidence, argmax correctness, the label's probability, the sum of squares (for the
Brier score, in float64) and the confidence histogram into one pass that reads every row once.

It is compiled with the system C compiler on first use (about a second) and cached under
``$BAYESFL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/bayesfl`` or ``~/.cache/bayesfl``), keyed by
the source, the flags, the compiler and the CPU; then called through ctypes, which releases the
GIL, from ``torch.get_num_threads()`` threads that take blocks of rows in turn. Block partial sums
are combined in block order, so results do not depend on the number of threads.

Loading a shared library runs its code, so only files nobody else can have written are loaded:

* the cache directory is created with mode 0700 and used only if it is a directory owned by
  this user that neither its group nor others can write to (otherwise another user could put a
  library there, or swap one in); nothing is ever loaded from a shared location such as
  ``/tmp/bayesfl-<uid>`` under a predictable name;
* a cached library is loaded only if it is a regular file (not a symlink) owned by this user
  and not writable by group or others; one that fails is rebuilt over (atomically);
* a build goes to a temporary file in the same directory, is made 0700 and renamed over the
  target, so no reader ever sees a partial library;
* when the cache directory is unusable or refused (with a logged warning saying why), the
  kernel is built in a fresh private directory (``mkdtemp``: 0700, random name), loaded and the
  directory removed: nothing pre-existing is trusted.

When no kernel can be had (no compiler, a failed build, a refused file), `library` logs a
warning and returns None and the torch sweep is used; with ``BAYESFL_REQUIRE_NATIVE=1`` (set by
``.ci/run``) it raises `calibration.errors.NativeKernelError` instead, so CI cannot pass
without checking the kernel while a machine without ``cc`` still runs everything.

The "native" build (``-march=native``) takes an AVX-512 float32 path where the CPU has it, and
otherwise the portable vector code (GCC/clang vector extensions: AVX2, SSE2 or NEON, whatever
the target offers); float64 always takes the portable code. Set ``BAYESFL_NATIVE=0`` to turn the
kernel off, or ``BAYESFL_NATIVE=portable`` for a build without ``-march=native``. Without a
kernel, `sweep` returns None and callers use the torch sweep; the two agree
(``tests/calibration/test_calibration_native_sweep.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from calibration.errors import NativeKernelError

__all__ = ["REQUIRE_VARIABLE", "NativeSweep", "cache_dir", "library", "required", "sweep",
           "unavailable_reason", "variant"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("native_sweep.c")
_BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp-simd", "-fno-strict-aliasing", "-fPIC", "-shared")
_VARIANT_FLAGS = {"native": ("-march=native",), "portable": ("-DBFL_PORTABLE",)}
_BLOCK_ELEMENTS = 1 << 17  # rows per block: about 512 KiB of float32 (fixes the partial sums)
_CALL_ELEMENTS = 1 << 21  # elements per ctypes call (a few blocks; amortises the call cost)
_THREADED_ELEMENTS = 1 << 20  # below this, one call in the calling thread beats a hand-off
_MAX_BIN_ENTRIES = 1 << 20  # per-block histogram entries held at once (24 bytes each)
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}

REQUIRE_VARIABLE = "BAYESFL_REQUIRE_NATIVE"

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}
_problems: dict[str, str] = {}
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool_after_fork() -> None:
    """A forked child inherits the pool object but not its threads: start afresh there."""
    global _lock, _pool, _pool_size
    _lock, _pool, _pool_size = threading.Lock(), None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


@dataclass(frozen=True, eq=False)
class NativeSweep:
    """What one native sweep over N rows found.

    ``valid``: every row passed validation (if False nothing else is meaningful: re-examine);
    ``top`` / ``label_prob``: (N,) input dtype, or None; ``correct``: (N,) bool, or None;
    ``squares``: sum over all entries of p^2 (float64 sum), or None;
    ``bin_sums``: per-bin (count int64, sum of confidence float64, number correct int64), each
    (n_bins,), or None.
    """

    valid: bool
    top: Tensor | None
    label_prob: Tensor | None
    correct: Tensor | None
    squares: float | None
    bin_sums: tuple[Tensor, Tensor, Tensor] | None


def variant() -> str | None:
    """The variant `sweep` uses: "native", "portable", or None (turned off)."""
    setting = os.environ.get("BAYESFL_NATIVE", "1").strip().lower()
    if setting in ("0", "off", "false", "no", "torch"):
        return None
    return "portable" if setting == "portable" else "native"


def required() -> bool:
    """Whether ``BAYESFL_REQUIRE_NATIVE`` demands the compiled kernel (CI sets it to 1)."""
    return os.environ.get(REQUIRE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def library(kind: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel for ``kind`` ("native" or "portable"), building it if needed.

    Returns None (and logs one warning; `unavailable_reason` says why) when it cannot be
    built or loaded safely, and the callers use the torch sweep; with ``BAYESFL_REQUIRE_NATIVE=1``
    raises [`calibration.errors.NativeKernelError`][calibration.errors.NativeKernelError] instead.
    """
    if kind not in _VARIANT_FLAGS:
        raise ValueError(f"kind must be 'native' or 'portable'; got {kind!r}")
    with _lock:
        if kind not in _libraries:
            try:
                _libraries[kind] = _load(kind)
            except (_UnavailableError, OSError) as reason:  # OSError: e.g. no kernel source
                _libraries[kind], _problems[kind] = None, str(reason)
                _log.warning("the %s calibration kernel is unavailable (%s): calibration uses "
                             "the slower torch sweep", kind, reason)
        lib = _libraries[kind]
    if lib is None and required():
        raise NativeKernelError(
            f"the {kind} calibration kernel is required ({REQUIRE_VARIABLE}=1) but unavailable: "
            f"{_problems.get(kind)}"
        )
    return lib


def unavailable_reason(kind: str = "native") -> str | None:
    """Why `library` returned None for ``kind`` in this process (None if it did not)."""
    return _problems.get(kind) if _libraries.get(kind, False) is None else None


def sweep(
    probs: Tensor,
    labels: Tensor,
    *,
    tolerance: float,
    top: bool,
    label_prob: bool,
    squares: bool,
    edges: Tensor | None = None,
) -> NativeSweep | None:
    """One native pass over ``probs`` (N, K), or None where the native kernel does not apply.

    ``probs``: contiguous float32/float64 CPU tensor; ``labels``: (N,) int64 CPU tensor already
    checked to lie in [0, K); ``edges``: (n_bins + 1,) nondecreasing bin edges in ``probs``'s
    dtype (see `calibration.binning.edges_in_dtype`) to histogram the confidences, or None.
    None is returned for other devices and dtypes, when turned off, or without a compiler.
    """
    kind = variant()
    if kind is None or probs.device.type != "cpu" or probs.dtype not in _DTYPES:
        return None
    lib = library(kind) or (library("portable") if kind == "native" else None)
    if lib is None:
        return None
    probs = probs.contiguous()
    labels = labels.to(torch.int64).contiguous()
    n_rows, n_classes = probs.shape
    n_bins = 0 if edges is None else edges.numel() - 1
    block_rows, n_blocks = _blocks(n_rows, n_classes, n_bins)

    out_top = torch.empty(n_rows, dtype=probs.dtype) if top else None
    out_label = torch.empty(n_rows, dtype=probs.dtype) if label_prob else None
    out_correct = torch.empty(n_rows, dtype=torch.uint8) if top else None
    out_squares = torch.zeros(n_blocks, dtype=torch.float64) if squares else None
    bins = None
    if edges is not None:
        edges = edges.to(device="cpu", dtype=probs.dtype).contiguous()
        bins = (torch.zeros(n_blocks, n_bins, dtype=torch.int64),
                torch.zeros(n_blocks, n_bins, dtype=torch.float64),
                torch.zeros(n_blocks, n_bins, dtype=torch.int64))

    function = getattr(lib, f"bfl_sweep_{_DTYPES[probs.dtype]}")
    fixed = (_pointer(probs), _pointer(labels), n_rows, n_classes, block_rows)
    outputs = (
        float(tolerance), _pointer(out_top), _pointer(out_label), _pointer(out_correct),
        _pointer(out_squares), _pointer(edges), n_bins,
        *(_pointer(b) for b in (bins or (None, None, None))),
    )

    def run(first_block: int, end_block: int) -> int:
        return function(*fixed, first_block, end_block, *outputs)

    blocks_per_call = max(1, _CALL_ELEMENTS // (block_rows * n_classes))
    threads = torch.get_num_threads()
    if threads <= 1 or n_rows * n_classes < _THREADED_ELEMENTS:
        flagged = run(0, n_blocks)
    else:
        flagged = _run_threaded(run, n_blocks, blocks_per_call, threads)

    if flagged:
        return NativeSweep(False, None, None, None, None, None)
    return NativeSweep(
        valid=True,
        top=out_top,
        label_prob=out_label,
        correct=out_correct.view(torch.bool) if top else None,
        squares=float(np.sum(out_squares.numpy())) if squares else None,
        bin_sums=None if bins is None else tuple(b.sum(0) for b in bins),
    )


def _blocks(n_rows: int, n_classes: int, n_bins: int) -> tuple[int, int]:
    """Rows per block (about ``_BLOCK_ELEMENTS`` entries) and the number of blocks.

    Depends on the input only, never on the thread count, so that the partial sums are too.
    Per-block histograms take ``n_blocks * n_bins`` entries: blocks grow to cap them (only
    very many bins on large inputs need it).
    """
    block_rows = max(1, _BLOCK_ELEMENTS // n_classes, -(-n_rows * n_bins // _MAX_BIN_ENTRIES))
    return block_rows, -(-n_rows // block_rows)


def _run_threaded(run, n_blocks: int, blocks_per_call: int, threads: int) -> int:
    """Hand out block ranges to ``threads`` workers in turn; the count of flagged ranges."""
    ranges = itertools.count(0, blocks_per_call)  # next() is atomic under the GIL

    def worker() -> int:
        flagged = 0
        while (start := next(ranges)) < n_blocks:
            flagged += run(start, min(start + blocks_per_call, n_blocks))
        return flagged

    pool = _executor(threads)
    futures = [pool.submit(worker) for _ in range(threads - 1)]
    flagged = worker()  # the calling thread works too
    return flagged + sum(future.result() for future in futures)


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=max(1, threads - 1),
                                       thread_name_prefix="calibration-sweep")
            _pool_size = threads
        return _pool


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# -- building and loading, safely ---------------------------------------------------------------
class _UnavailableError(Exception):
    """Why a kernel cannot be used (a missing compiler, a failed build, an unsafe file)."""


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _uid() -> int | None:
    """The user whose files may be loaded (None where the OS has no uids)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def cache_dir() -> Path | None:
    """Where compiled kernels are cached: ``$BAYESFL_CACHE_DIR``, else ``$XDG_CACHE_HOME/bayesfl``
    (an absolute ``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/bayesfl``;
    None without a home directory."""
    configured = os.environ.get("BAYESFL_CACHE_DIR")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "bayesfl"
    try:
        return Path.home() / ".cache" / "bayesfl"
    except (RuntimeError, KeyError):  # no HOME and no password entry
        return None


def _directory_problem(directory: Path) -> str | None:
    """Create ``directory`` (mode 0700) if absent; None when it is safe to load from, else why
    not: it must be a directory owned by this user that no group or other user can write to
    (then nobody else can put or swap a file in it)."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # checked below, whatever it is
    except OSError as err:
        return f"cannot create {directory} ({err.strerror or err})"
    try:
        info = os.stat(directory)  # follows a symlink: what is checked is what is used
    except OSError as err:
        return f"cannot read {directory} ({err.strerror or err})"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    return _ownership_problem(directory, info, "directory")


def _file_problem(path: Path) -> str | None:
    """None when ``path`` is a regular file (not a symlink) owned by this user and writable by
    nobody else, else why it must not be loaded."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        return f"cannot open {path} ({err.strerror or err})"
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    return _ownership_problem(path, info, "file")


def _ownership_problem(path: Path, info: os.stat_result, what: str) -> str | None:
    uid = _uid()
    if uid is not None and info.st_uid != uid:
        return f"the {what} {path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"the {what} {path} is writable by its group or by others "
                f"(mode {stat.S_IMODE(info.st_mode):o}); make it 0700 (chmod go-w)")
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the architecture and (on Linux) the CPU's flags."""
    identity = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features", "model name")):
                    identity += line
    except OSError:
        identity += platform.processor()
    return identity


def _library_name(compiler: str, kind: str) -> str:
    """``native_sweep-<kind>-<key>.so``, keyed by the source, flags, compiler and CPU."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    flags = _BASE_FLAGS + _VARIANT_FLAGS[kind]
    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(flags).encode(), compiler.encode(),
                    *(v.encode() for v in version), _cpu_identity().encode()])
    ).hexdigest()[:20]
    return f"native_sweep-{kind}-{key}.so"


def _load(kind: str) -> ctypes.CDLL:
    """The kernel for ``kind`` from the private cache, built there if needed; or, when the cache
    directory is unusable or unsafe, built in a fresh private temporary directory. Raises
    _UnavailableError (never loads a file that failed the checks)."""
    compiler = _compiler()
    if compiler is None:
        raise _UnavailableError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    flags = _BASE_FLAGS + _VARIANT_FLAGS[kind]
    name = _library_name(compiler, kind)
    directory = cache_dir()
    refusal = "no home directory" if directory is None else _directory_problem(directory)
    if refusal is None:
        return _cached_or_built(compiler, flags, directory / name)
    _log.warning("not using the kernel cache (%s): building the %s calibration kernel in a "
                 "private temporary directory instead", refusal, kind)
    return _built_privately(compiler, flags, name)


def _cached_or_built(compiler: str, flags: tuple[str, ...], target: Path) -> ctypes.CDLL:
    """Load ``target`` if it passes the checks; otherwise (re)build it in place, atomically."""
    if os.path.lexists(target):
        problem = _file_problem(target)
        if problem is None:
            try:
                return _open(target)
            except OSError as error:  # e.g. a truncated file: rebuild it
                problem = f"{target} does not load ({error})"
        _log.warning("not loading the cached calibration kernel: %s; rebuilding it", problem)
    _compile(compiler, flags, target)
    return _verified_open(target)


def _built_privately(compiler: str, flags: tuple[str, ...], name: str) -> ctypes.CDLL:
    """Build and load in a new directory only this process knows (mkdtemp: mode 0700, a
    random name, created exclusively), then remove it; the loaded library stays mapped."""
    try:
        directory = Path(tempfile.mkdtemp(prefix="bayesfl-native-"))
    except OSError as error:
        raise _UnavailableError(f"cannot create a private temporary directory ({error})") from None
    try:
        problem = _directory_problem(directory)
        if problem is not None:
            raise _UnavailableError(problem)
        _compile(compiler, flags, directory / name)
        return _verified_open(directory / name)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _verified_open(path: Path) -> ctypes.CDLL:
    problem = _file_problem(path)
    if problem is not None:
        raise _UnavailableError(f"the freshly built kernel fails the checks: {problem}")
    try:
        return _open(path)
    except OSError as error:
        raise _UnavailableError(f"{path} does not load ({error})") from None


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
    except AttributeError as error:  # not our kernel (e.g. a stale or foreign build)
        raise OSError(f"a function is missing: {error}") from None
    return lib


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile into a temporary file beside ``target``, make it 0700 and rename it over
    ``target`` (atomic: a reader sees the old file or the new, never a partial one)."""
    try:
        handle, scratch = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    except OSError as error:
        raise _UnavailableError(f"cannot write in {target.parent} ({error})") from None
    os.close(handle)
    try:
        try:
            result = subprocess.run([compiler, *flags, "-o", scratch, str(_SOURCE)],
                                    capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            raise _UnavailableError(f"{Path(compiler).name} could not run ({error})") from None
        if result.returncode != 0:
            raise _UnavailableError(f"{Path(compiler).name} failed: {result.stderr.strip()[-400:]}")
        os.chmod(scratch, 0o700)  # the linker may have recreated it under a lax umask
        os.replace(scratch, target)
    except OSError as error:
        raise _UnavailableError(f"cannot install the kernel in {target.parent} ({error})") from None
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _declare(lib: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("bfl_sweep_f32", "bfl_sweep_f64"):
        function = getattr(lib, name)
        function.restype = ctypes.c_int
        function.argtypes = [
            pointer, pointer, size, size, size, size, size, ctypes.c_double,
            pointer, pointer, pointer, pointer, pointer, size, pointer, pointer, pointer,
        ]
    lib.bfl_sweep_variant.restype = ctypes.c_int
    lib.bfl_sweep_variant.argtypes = []
