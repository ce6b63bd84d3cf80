"""Dataset.from_arrays and simulate(data=(x, y)): your own arrays, checked and copied."""

import numpy as np
import pytest
import torch

import bayesfl
from bayesfl.data import Dataset, as_dataset
from bayesfl.data.datasets import MAX_ARRAY_ELEMENTS, dataset_identity
from bayesfl.errors import ConfigError, DataError


def arrays(n=40, dim=3, classes=4):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, dim)), np.arange(n) % classes


def test_numpy_arrays_become_a_float32_int64_dataset_of_their_shape():
    x, y = arrays()
    data = Dataset.from_arrays(x, y)
    assert data.x.dtype == torch.float32 and data.y.dtype == torch.int64
    assert data.input_shape == (3,) and data.num_classes == 4 and len(data) == 40
    assert data.name == "custom"
    np.testing.assert_array_equal(data.x.numpy(), x.astype(np.float32))


def test_the_arrays_are_copied_so_later_edits_do_not_change_the_data():
    x, y = arrays()
    x32 = x.astype(np.float32)
    data = Dataset.from_arrays(x32, y)
    digest = dataset_identity(data)["sha256"]
    x32[:] = 0
    y[:] = 0
    assert dataset_identity(data)["sha256"] == digest


def test_torch_tensors_and_images_are_accepted_and_num_classes_may_exceed_the_labels():
    x = torch.rand(10, 1, 8, 8, dtype=torch.float64)
    y = torch.tensor([0, 1] * 5)
    data = Dataset.from_arrays(x, y, num_classes=3, name="mine")
    assert data.input_shape == (1, 8, 8) and data.num_classes == 3 and data.name == "mine"


def test_as_dataset_takes_a_dataset_or_a_pair():
    x, y = arrays()
    data = Dataset.from_arrays(x, y)
    assert as_dataset(data) is data
    assert as_dataset((x, y)).num_classes == 4
    with pytest.raises(ConfigError, match=r"pair \(x, y\)"):
        as_dataset(x)


@pytest.mark.parametrize(("x", "y", "options", "message"), [
    (np.zeros((5, 2)), np.zeros(4, int), {}, "x holds 5 samples and y 4 labels"),
    (np.zeros(5), np.zeros(5, int), {}, r"x.reshape\(-1, 1\)"),
    (np.zeros((5, 2)), np.zeros((5, 2), int), {}, "one-hot"),
    (np.array([[0.0], [np.nan], [1.0]]), np.array([0, 1, 0]), {}, "1 NaN or infinite"),
    (np.array([[0.0], [1e39], [1.0]]), np.array([0, 1, 0]), {}, "overflow"),
    (np.zeros((3, 1)), np.array([0.0, 1.0, 0.0]), {}, r"y.astype\(int\)"),
    (np.zeros((3, 1)), np.array([0, -1, 1]), {}, r"found -1..1"),
    (np.zeros((3, 1)), np.array([0, 1, 2]), {"num_classes": 2}, r"labels must lie in 0..1"),
    (np.zeros((3, 1)), np.array([0, 0, 0]), {}, "between 2 and"),
    (np.zeros((1, 1)), np.array([0]), {"num_classes": 2}, "at least two"),
    (np.array([["a"], ["b"]]), np.array([0, 1]), {}, "real numbers"),
    (np.zeros((2, 1), dtype=complex), np.array([0, 1]), {}, "real numbers"),
    (torch.zeros(2, 1, dtype=torch.bool), np.array([0, 1]), {}, "real numbers"),
    (np.zeros((2, 1)), np.array([0, 1]), {"num_classes": 2.0}, "must be an integer"),
])
def test_arrays_that_are_not_a_labelled_batch_are_a_data_error_saying_why(x, y, options,
                                                                           message):
    with pytest.raises(DataError, match=message):
        Dataset.from_arrays(x, y, **options)


def test_more_input_values_than_the_limit_are_refused_before_any_copy():
    rows = MAX_ARRAY_ELEMENTS // 2**15 + 1
    x = np.broadcast_to(np.zeros(1, np.float32), (rows, 2**15))  # a view: nothing allocated
    with pytest.raises(DataError, match="more than the limit"):
        Dataset.from_arrays(x, np.zeros(rows, np.int64), num_classes=2)


def test_simulate_takes_arrays_and_refuses_bad_ones_before_writing_anything(tmp_path):
    x, y = arrays(n=60, dim=4, classes=3)
    result = bayesfl.simulate("fedavg", data=(x, y), clients=2, partition="iid", rounds=1,
                              local_epochs=1, feature_dim=4, body="mlp", progress=False)
    assert result.summary["data"]["name"] == "custom"
    assert result.summary["data"]["input_shape"] == [4]
    out = tmp_path / "run"
    with pytest.raises(DataError, match="labels must lie"):
        bayesfl.simulate(data=(x, y - 1), out=out, progress=False)
    with pytest.raises(ConfigError, match="Dataset or a pair"):
        bayesfl.simulate(data="digits", out=out, progress=False)
    assert not out.exists()
