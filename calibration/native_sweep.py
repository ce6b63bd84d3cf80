"""The native sweep: every per-row quantity of :mod:`calibration.row_scores` in one read.

The torch sweep needs about seven passes over an (N, K) probability matrix (a max, a min, a row
sum, a norm, a gather, ...), each a full read of memory. ``native_sweep.c`` fuses validation,
top-label confidence, argmax correctness, the label's probability, the sum of squares (for the
Brier score, in float64) and the confidence histogram into one pass that reads every row once.

It is compiled with the system C compiler on first use (about a second) and cached under
``$BAYESFL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/bayesfl`` or ``~/.cache/bayesfl``), keyed by
the source, the flags, the compiler and the CPU; then called through ctypes, which releases the
GIL, from ``torch.get_num_threads()`` threads that take blocks of rows in turn. Block partial sums
are combined in block order, so results do not depend on the number of threads.

The "native" build (``-march=native``) takes an AVX-512 float32 path where the CPU has it, and
otherwise the portable vector code (GCC/clang vector extensions: AVX2, SSE2 or NEON, whatever
the target offers); float64 always takes the portable code. Set ``BAYESFL_NATIVE=0`` to turn the
kernel off, or ``BAYESFL_NATIVE=portable`` for a build without ``-march=native``. Without a
compiler, :func:`sweep` returns None and callers use the torch sweep; the two agree
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
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["NativeSweep", "library", "sweep", "variant"]

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("native_sweep.c")
_BASE_FLAGS = ("-O3", "-std=c11", "-fopenmp-simd", "-fno-strict-aliasing", "-fPIC", "-shared")
_VARIANT_FLAGS = {"native": ("-march=native",), "portable": ("-DBFL_PORTABLE",)}
_BLOCK_ELEMENTS = 1 << 17  # rows per block: about 512 KiB of float32 (fixes the partial sums)
_CALL_ELEMENTS = 1 << 21  # elements per ctypes call (a few blocks; amortises the call cost)
_THREADED_ELEMENTS = 1 << 20  # below this, one call in the calling thread beats a hand-off
_MAX_BIN_ENTRIES = 1 << 20  # per-block histogram entries held at once (24 bytes each)
_DTYPES = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}
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
    """The variant :func:`sweep` uses: "native", "portable", or None (turned off)."""
    setting = os.environ.get("BAYESFL_NATIVE", "1").strip().lower()
    if setting in ("0", "off", "false", "no", "torch"):
        return None
    return "portable" if setting == "portable" else "native"


def library(kind: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel for ``kind`` ("native" or "portable"), building it if needed.

    Returns None (and logs one warning) when it cannot be built or loaded.
    """
    if kind not in _VARIANT_FLAGS:
        raise ValueError(f"kind must be 'native' or 'portable'; got {kind!r}")
    with _lock:
        if kind not in _libraries:
            _libraries[kind] = _load(kind)
        return _libraries[kind]


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
    dtype (see :func:`calibration.binning.edges_in_dtype`) to histogram the confidences, or None.
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


# -- building --------------------------------------------------------------------------------
def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _cache_dirs() -> list[Path]:
    """Where the library may live: the user's cache, then a per-user temporary directory."""
    configured = os.environ.get("BAYESFL_CACHE_DIR")
    if configured:
        return [Path(configured)]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [Path(base) / "bayesfl", Path(tempfile.gettempdir()) / f"bayesfl-{user}"]


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


def _load(kind: str) -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        _log.warning("no C compiler found (set CC): calibration uses the slower torch sweep")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    flags = _BASE_FLAGS + _VARIANT_FLAGS[kind]
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), compiler.encode(), *(v.encode() for v in
                    version), _cpu_identity().encode()])
    ).hexdigest()[:20]
    name = f"native_sweep-{kind}-{key}.so"
    problem = "no writable cache directory"
    for directory in _cache_dirs():
        target = directory / name
        try:
            if not target.exists():
                _compile(compiler, flags, target)
            lib = ctypes.CDLL(str(target))
        except _CompileError as error:
            problem = str(error)
            break  # the compiler refused: another directory will not help
        except (OSError, subprocess.SubprocessError) as error:
            problem = f"{target}: {error}"
            continue
        _declare(lib)
        return lib
    _log.warning("could not build the %s calibration sweep (%s)", kind, problem)
    return None


class _CompileError(OSError):
    """The compiler ran and failed."""


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile into a temporary file beside ``target`` and rename it (atomic for readers)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run([compiler, *flags, "-o", scratch, str(_SOURCE)],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise _CompileError(f"{Path(compiler).name} failed: {result.stderr.strip()[-400:]}")
        os.replace(scratch, target)
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
