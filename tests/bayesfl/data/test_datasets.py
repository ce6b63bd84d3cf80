"""Data sets load offline, are deterministic by seed, and fail clearly when files are absent."""

import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bayesfl.data.datasets import DATASETS, Dataset, load_dataset
from bayesfl.errors import ConfigError, DataError


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test loudly."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access is disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def test_digits_load_without_network_as_flat_unit_scaled_inputs(no_network):
    data = load_dataset("digits")
    assert (data.name, data.num_classes, data.input_shape) == ("digits", 10, (64,))
    assert data.x.shape == (1797, 64) and data.x.dtype == torch.float32
    assert data.y.dtype == torch.int64 and set(data.y.tolist()) == set(range(10))
    assert float(data.x.min()) == 0.0 and float(data.x.max()) == 1.0
    assert no_network == []


def test_digits_match_scikit_learn_divided_by_16():
    from sklearn.datasets import load_digits

    reference = load_digits()
    data = load_dataset("digits")
    np.testing.assert_array_equal(data.x.numpy(), (reference.data / 16.0).astype(np.float32))
    np.testing.assert_array_equal(data.y.numpy(), reference.target)


def test_gaussian_mixture_is_deterministic_by_seed():
    a = load_dataset("gaussian_mixture", seed=3, n=300, dim=4, num_classes=3)
    b = load_dataset("gaussian_mixture", seed=3, n=300, dim=4, num_classes=3)
    c = load_dataset("gaussian_mixture", seed=4, n=300, dim=4, num_classes=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert a.x.shape == (300, 4) and a.input_shape == (4,) and a.num_classes == 3
    assert torch.bincount(a.y).tolist() == [100, 100, 100]


def test_gaussian_mixture_has_unit_noise_and_means_about_separation_apart():
    # reference: the generative definition; within-class covariance is I (tolerance 0.05 with
    # 20k samples), and the mean pairwise distance of 40 class means is `separation` (10%)
    data = load_dataset("gaussian_mixture", seed=0, n=20_000, dim=8, num_classes=40,
                        separation=5.0)
    x, y = data.x.double(), data.y
    means = torch.stack([x[y == c].mean(0) for c in range(40)])
    residual = x - means[y]
    np.testing.assert_allclose(torch.cov(residual.T).numpy(), np.eye(8), atol=0.05)
    distances = torch.pdist(means)
    assert abs(float(distances.mean()) - 5.0) < 0.5


def test_mnist1d_is_generated_locally_without_network(no_network):
    data = load_dataset("mnist1d", seed=0, num_samples=200)
    assert data.x.shape == (200, 40) and data.input_shape == (40,)
    assert data.x.dtype == torch.float32 and torch.isfinite(data.x).all()
    assert torch.bincount(data.y).tolist() == [20] * 10
    assert no_network == []


def test_mnist1d_equals_the_package_generator_with_the_same_arguments():
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = 100, 42
    reference = make_dataset(args)
    data = load_dataset("mnist1d", seed=42, num_samples=100)
    np.testing.assert_array_equal(
        data.x.numpy(), np.concatenate([reference["x"], reference["x_test"]]).astype(np.float32))
    np.testing.assert_array_equal(data.y.numpy(), np.concatenate([reference["y"],
                                                                  reference["y_test"]]))


def test_mnist1d_is_deterministic_by_seed_and_leaves_global_rngs_untouched():
    np.random.seed(123)
    random.seed(123)
    numpy_before, python_before = np.random.get_state()[1].copy(), random.getstate()
    a = load_dataset("mnist1d", seed=1, num_samples=50)
    b = load_dataset("mnist1d", seed=1, num_samples=50)
    c = load_dataset("mnist1d", seed=2, num_samples=50)
    assert torch.equal(a.x, b.x) and not torch.equal(a.x, c.x)
    np.testing.assert_array_equal(np.random.get_state()[1], numpy_before)
    assert random.getstate() == python_before


# ---- MNIST-1D sets kept under the data root ---------------------------------------------
@pytest.fixture
def small_sets_kept(monkeypatch):
    """Sets of 100 samples or more are kept (the real bound, 1,000, takes a second to make)."""
    import bayesfl.data.datasets as datasets

    monkeypatch.setattr(datasets, "MNIST1D_CACHE_MIN_SAMPLES", 100)


@pytest.fixture
def generations(monkeypatch):
    """The number of times the package's generator has run since the fixture was set up."""
    import mnist1d.data

    calls = []
    make_dataset = mnist1d.data.make_dataset

    def counted(*args, **kwargs):
        calls.append(1)
        return make_dataset(*args, **kwargs)

    monkeypatch.setattr(mnist1d.data, "make_dataset", counted)
    return calls


def kept_files(root):
    return sorted((Path(root) / "mnist1d").glob("*.npz"))


def test_a_large_mnist1d_set_is_kept_and_read_back_equal_without_generating(
        tmp_path, small_sets_kept, generations, no_network):
    made = load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    assert len(generations) == 1 and len(kept_files(tmp_path)) == 1
    again = load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    assert len(generations) == 1  # read, not generated
    assert torch.equal(again.x, made.x) and torch.equal(again.y, made.y)
    assert again.x.dtype == torch.float32 and again.y.dtype == torch.int64
    assert (again.name, again.num_classes, again.input_shape) == ("mnist1d", 10, (40,))
    # another seed or size is another set: generated and kept beside it
    other = load_dataset("mnist1d", seed=5, root=str(tmp_path), num_samples=120)
    assert len(generations) == 2 and len(kept_files(tmp_path)) == 2
    assert not torch.equal(other.x, made.x)
    assert no_network == []


def test_a_small_mnist1d_set_is_not_kept(tmp_path, generations):
    load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)  # below 1,000
    load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    assert len(generations) == 2 and not (tmp_path / "mnist1d").exists()


def damage_by_rewriting(path):
    np.savez(path, x=np.zeros((120, 40), dtype=np.float64), y=np.zeros(120, dtype=np.int64))


def damage_with_another_shape(path):
    np.savez(path, x=np.zeros((119, 40), dtype=np.float32), y=np.zeros(119, dtype=np.int64))


def damage_with_labels_out_of_range(path):
    with np.load(path) as kept:
        x = kept["x"]
    np.savez(path, x=x, y=np.full(120, 10, dtype=np.int64))


def damage_with_a_non_finite_input(path):
    with np.load(path) as kept:
        x, y = kept["x"].copy(), kept["y"]
    x[3, 7] = np.nan
    np.savez(path, x=x, y=y)


def damage_with_pickled_objects(path):
    np.savez(path, x=np.array([{"a": 1}] * 120, dtype=object), y=np.zeros(120, dtype=np.int64))


def damage_with_an_extra_member(path):
    with np.load(path) as kept:
        x, y = kept["x"], kept["y"]
    np.savez(path, x=x, y=y, z=np.zeros(1))


def damage_by_truncating(path):
    path.write_bytes(path.read_bytes()[:300])


def damage_with_a_huge_member(path):
    # a member far larger than the set: refused by its size before any array is allocated
    np.savez(path, x=np.zeros((120, 4000), dtype=np.float32), y=np.zeros(120, dtype=np.int64))


def damage_with_a_header_claiming_a_huge_array(path):
    # 10^12 x 40 floats declared, 16 bytes present: the header is refused, nothing allocated
    import io
    import zipfile

    with np.load(path) as kept:
        y = kept["y"]
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 40)})
    labels = io.BytesIO()
    np.lib.format.write_array(labels, y)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(16))
        archive.writestr("y.npy", labels.getvalue())


@pytest.mark.parametrize("damage", [
    damage_with_a_header_claiming_a_huge_array, damage_by_rewriting, damage_with_another_shape,
    damage_with_labels_out_of_range, damage_with_a_non_finite_input, damage_with_pickled_objects,
    damage_with_an_extra_member, damage_by_truncating, damage_with_a_huge_member])
def test_a_damaged_kept_mnist1d_set_is_generated_again_and_rewritten(
        tmp_path, small_sets_kept, generations, damage):
    made = load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    [path] = kept_files(tmp_path)
    damage(path)
    again = load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    assert len(generations) == 2  # generated again, not read
    assert torch.equal(again.x, made.x) and torch.equal(again.y, made.y)
    third = load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    assert len(generations) == 2 and torch.equal(third.x, made.x)  # the rewritten file


def test_an_unwritable_data_root_costs_only_the_next_generation(tmp_path, small_sets_kept,
                                                                generations):
    root = tmp_path / "root"
    root.write_text("a file where the folder would go")  # mkdir fails: not a directory
    data = load_dataset("mnist1d", seed=4, root=str(root), num_samples=120)
    assert data.x.shape == (120, 40)
    load_dataset("mnist1d", seed=4, root=str(root), num_samples=120)
    assert len(generations) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no temporary left


def test_a_kept_set_is_named_by_its_seed_size_and_the_generating_code_versions(monkeypatch):
    import importlib.metadata

    from bayesfl.data.datasets import _mnist1d_cache_path

    path = _mnist1d_cache_path(Path("/root"), 0, 10_000)
    assert path.parent == Path("/root/mnist1d") and path.suffix == ".npz"
    assert _mnist1d_cache_path(Path("/root"), 1, 10_000) != path
    assert _mnist1d_cache_path(Path("/root"), 0, 10_010) != path
    version = importlib.metadata.version
    for package in ("mnist1d", "numpy", "scipy"):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name, p=package: "0.0.0" if name == p else version(name))
        assert _mnist1d_cache_path(Path("/root"), 0, 10_000) != path, package
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert _mnist1d_cache_path(Path("/root"), 0, 10_000) == path


def test_a_kept_set_is_read_without_importing_mnist1d(tmp_path, small_sets_kept):
    # reading a kept set back spares the package's import (1.2 s: SciPy, matplotlib)
    load_dataset("mnist1d", seed=4, root=str(tmp_path), num_samples=120)
    code = (f"import sys; from bayesfl.data.datasets import load_dataset; "
            f"import bayesfl.data.datasets as d; d.MNIST1D_CACHE_MIN_SAMPLES = 100; "
            f"data = load_dataset('mnist1d', seed=4, root={str(tmp_path)!r}, num_samples=120); "
            f"print(data.x.shape[0], 'mnist1d' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.split() == ["120", "False"]


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10", "cifar100"])
def test_torchvision_sets_without_files_give_a_data_error_saying_where_to_put_them(
        tmp_path, no_network, name):
    with pytest.raises(DataError) as info:
        load_dataset(name, root=str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "download=True" in message
    assert no_network == []


def test_a_failed_download_is_a_data_error(tmp_path, no_network):
    with pytest.raises(DataError, match="download"):
        load_dataset("mnist", root=str(tmp_path), download=True)


def _write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array in the big-endian IDX format of the MNIST files."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_loads_from_local_files_pooling_train_then_test(tmp_path, no_network):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 256, size=(6, 28, 28))
    test_images = rng.integers(0, 256, size=(4, 28, 28))
    _write_idx(raw / "train-images-idx3-ubyte", train_images)
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(6) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", test_images)
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(4) + 5)
    data = load_dataset("mnist", root=str(tmp_path))
    assert data.x.shape == (10, 1, 28, 28) and data.input_shape == (1, 28, 28)
    expected = np.concatenate([train_images, test_images])[:, None] / 255.0
    np.testing.assert_allclose(data.x.numpy(), expected, rtol=1e-6)
    assert data.y.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8]
    test_only = load_dataset("mnist", root=str(tmp_path), split="test", max_samples=3)
    assert test_only.y.tolist() == [5, 6, 7]


def test_unknown_dataset_is_a_config_error_listing_the_valid_names():
    with pytest.raises(ConfigError) as info:
        load_dataset("imagenet")
    for name in DATASETS:
        assert name in str(info.value)


def test_unknown_option_is_a_config_error_listing_the_valid_options():
    with pytest.raises(ConfigError, match="num_classes, dim, n, separation"):
        load_dataset("gaussian_mixture", classes=3)
    with pytest.raises(ConfigError, match="none"):
        load_dataset("digits", download=True)


def test_an_option_of_the_wrong_type_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"option n must be an integer, got 'many' \(a string"):
        load_dataset("gaussian_mixture", n="many")
    with pytest.raises(ConfigError, match="option download must be true or false"):
        load_dataset("mnist", download="yes")
    with pytest.raises(ConfigError, match="option max_samples must be >= 1"):
        load_dataset("mnist", max_samples=0)


def test_dataset_rejects_inconsistent_arrays():
    with pytest.raises(DataError, match="float32"):
        Dataset("bad", torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.int64),
                2, (2,))
    with pytest.raises(DataError, match="shape"):
        Dataset("bad", torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64), 2, (2,))
    with pytest.raises(DataError, match="labels"):
        Dataset("bad", torch.zeros(3, 2), torch.tensor([0, 1, 2]), 2, (2,))


def test_mnist_5k_loads_offline_as_500_real_digits_per_class_normalised(no_network):
    data = load_dataset("mnist-5k")
    assert (data.name, data.num_classes, data.input_shape) == ("mnist_5k", 10, (1, 28, 28))
    assert data.x.shape == (5000, 1, 28, 28) and data.x.dtype == torch.float32
    assert torch.bincount(data.y).tolist() == [500] * 10
    # MNIST's background is 0 -> (0 - 0.1307) / 0.3081 and its ink 255 -> (1 - 0.1307) / 0.3081
    assert float(data.x.min()) == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    assert float(data.x.max()) == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-6)
    # these 5,000 digits have MNIST's statistics: mean ~0, std ~1 after normalising
    assert abs(float(data.x.mean())) < 0.05 and abs(float(data.x.std()) - 1) < 0.05
    assert no_network == []


def test_mnist_5k_with_the_fedsi_small_regime_gives_250_training_images_per_client():
    from bayesfl.data.clients import make_clients

    clients = make_clients(load_dataset("mnist_5k"), 10, "labels:5:train=50", seed=0)
    for u, c in enumerate(clients):
        assert c.num_train == 250 and c.num_test == 250
        assert torch.bincount(c.train_y, minlength=10)[[(u + j) % 10 for j in range(5)]] \
            .tolist() == [50] * 5
        assert set(c.test_y.tolist()) == {(u + j) % 10 for j in range(5)}
        assert not set(c.train_indices) & set(c.test_indices)
