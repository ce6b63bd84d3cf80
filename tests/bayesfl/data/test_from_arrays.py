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


# ---- your own test arrays ------------------------------------------------------------------
def two_sets(n_train=120, n_test=60, classes=4):
    rng = np.random.default_rng(1)
    return ((rng.standard_normal((n_train, 3)), np.arange(n_train) % classes),
            (rng.standard_normal((n_test, 3)), np.arange(n_test) % classes))


def test_test_arrays_are_a_pool_after_the_training_rows_and_part_of_the_identity():
    (x, y), (xt, yt) = two_sets()
    data = Dataset.from_arrays(x, y, test=(xt, yt))
    assert len(data) == 180 and data.num_test == 60
    np.testing.assert_array_equal(data.x[120:].numpy(), xt.astype(np.float32))
    assert dataset_identity(data)["num_test"] == 60
    assert "num_test" not in dataset_identity(Dataset.from_arrays(x, y))  # as before


def test_clients_train_on_training_rows_and_test_on_the_test_rows_of_their_classes():
    from bayesfl.data import make_clients

    (x, y), (xt, yt) = two_sets()
    data = Dataset.from_arrays(x, y, test=(xt, yt))
    clients = make_clients(data, 4, "shards:2", seed=0)
    train_rows = np.concatenate([c.train_indices for c in clients])
    test_rows = np.concatenate([c.test_indices for c in clients])
    assert (train_rows < 120).all() and len(set(train_rows)) == 120  # every training row, once
    assert (test_rows >= 120).all() and len(set(test_rows)) == len(test_rows)  # used once
    for c in clients:
        assert set(c.test_y.tolist()) <= set(c.train_y.tolist())  # its own classes only
    # a class's 15 test rows are shared by its holders: all of them are used
    assert len(test_rows) == 60


def test_test_arrays_are_checked_like_the_training_arrays():
    (x, y), (xt, yt) = two_sets()
    with pytest.raises(DataError, match=r"labels must lie in 0\.\.3"):
        Dataset.from_arrays(x, y, test=(xt, yt + 1))
    with pytest.raises(DataError, match=r"x_test has inputs of shape \(2,\)"):
        Dataset.from_arrays(x, y, test=(xt[:, :2], yt))
    with pytest.raises(DataError, match=r"pair \(x_test, y_test\)"):
        Dataset.from_arrays(x, y, test=xt)


def test_a_client_left_without_test_rows_or_a_scheme_fixing_the_split_is_refused():
    from bayesfl.data import make_clients

    (x, y), _ = two_sets()
    data = Dataset.from_arrays(x, y, test=(np.zeros((2, 3)), np.array([0, 0])))
    with pytest.raises(DataError, match="gets no test sample"):
        make_clients(data, 4, "shards:2", seed=0)
    with pytest.raises(ConfigError, match="fixes each client's test samples"):
        make_clients(data, 4, "labels:2:train=5", seed=0)


def test_simulate_runs_on_training_and_test_arrays(tmp_path):
    (x, y), (xt, yt) = two_sets()
    result = bayesfl.simulate("fedavg", data=Dataset.from_arrays(x, y, test=(xt, yt)),
                              clients=2, partition="iid", rounds=1, local_epochs=1,
                              feature_dim=4, body="mlp", progress=False)
    assert sum(c.data.num_test for c in result.clients) == 60
    assert result.summary["data"]["num_test"] == 60
