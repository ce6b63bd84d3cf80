"""The input boundary: fit_head and predict_proba take tensors, NumPy arrays and lists, and
refuse what is not real numbers with an InvalidInputError that says what to pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference.errors import InferenceError, InvalidInputError, UnknownOptionError
from inference.factory import fit_head
from inference.inputs import as_features, as_labels, as_network_inputs, as_tensor
from tests.inference.test_posterior import MAKERS, subnet_posterior

F64 = torch.float64


def blobs(n: int = 90, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0.0], [-2.0, 1.0], [0.0, -2.0]])
    return centres[labels] + 0.5 * torch.randn(n, 2, generator=gen), labels


# -- fit_head ---------------------------------------------------------------------------------


@pytest.mark.parametrize("label_dtype", [np.int64, np.int32, np.uint8, np.float64])
def test_fit_head_takes_numpy_arrays_and_fits_what_the_tensors_fit(label_dtype):
    x, y = blobs()
    want = fit_head("laplace", x, y, 3)
    got = fit_head("laplace", x.numpy(), y.numpy().astype(label_dtype), np.int64(3))
    torch.testing.assert_close(got.mean, want.mean, atol=0, rtol=0)  # the same numbers


def test_fit_head_takes_nested_lists():
    x, y = blobs()
    want = fit_head("conjugate", x, y, 3)
    got = fit_head("conjugate", x.tolist(), y.tolist(), 3)
    # lists become float64 (NumPy's default), the tensors were float32: the statistics are
    # summed in float64 either way and the float32 values are exact in float64
    torch.testing.assert_close(got.mean, want.mean, atol=0, rtol=0)


def test_float64_and_float32_features_fit_the_same_head():
    x, y = blobs()
    a = fit_head("laplace", x, y, 3)
    b = fit_head("laplace", x.double(), y, 3)
    torch.testing.assert_close(a.mean, b.mean, atol=0, rtol=0)  # float32 values exact in f64


@pytest.mark.parametrize(("features", "message"), [
    (np.array([["a", "b"]] * 90), "strings"),
    (np.empty((90, 2), dtype=object), "Python objects"),
    (np.ones((90, 2), dtype=complex), "complex"),
    (np.ones((90, 2), dtype=bool), "booleans"),
    (np.zeros((90, 2), dtype="datetime64[s]"), "datetimes"),
    (torch.ones(90, 2, dtype=torch.complex64), "complex64"),
    (torch.ones(90, 2).to_sparse(), "dense"),
    (torch.ones(90, 2, device="meta"), "meta"),
    ([[1.0, 2.0], [3.0]], "not an array of numbers"),
    ("features.npy", "got a str"),
    (None, "got a NoneType"),
    (np.ones(90), "one sample"),
    (np.ones((90, 2, 1)), r"2-D \(B, m\)"),
    (np.full((90, 2), np.nan), "180 of the 180 values in features are NaN"),
])
def test_features_that_are_not_real_numbers_are_refused(features, message):
    _, y = blobs()
    with pytest.raises(InvalidInputError, match=message):
        fit_head("laplace", features, y, 3)


@pytest.mark.parametrize(("labels", "message"), [
    (np.arange(90) % 3 + 1, r"\[0, 3\).*found 3"),
    (np.arange(90) % 3 - 1, "found -1"),
    (np.full(90, 0.5), r"labels\[0\] = 0.5"),
    (np.full(90, np.nan), "integer class indices"),
    (np.eye(3)[np.arange(90) % 3], "one-hot"),
    (np.arange(80) % 3, "90 rows of features but 80 labels"),
    (np.array(["a"] * 90), "strings"),
    (np.ones(90, dtype=bool), "booleans"),
])
def test_labels_that_are_not_class_indices_are_refused(labels, message):
    x, _ = blobs()
    with pytest.raises(InvalidInputError, match=message):
        fit_head("sgld", x.numpy(), labels, 3, num_samples=2, burn_in=1)


@pytest.mark.parametrize("num_classes", [0, 2.0, True, "3", None])
def test_num_classes_must_be_a_positive_integer(num_classes):
    x, y = blobs()
    with pytest.raises(InvalidInputError, match="num_classes must be an integer"):
        fit_head("conjugate", x, y, num_classes)


def test_dtype_policy_of_the_boundary():
    native = np.arange(6, dtype=np.float64).reshape(3, 2)
    big_endian = native.astype(">f8")
    assert torch.equal(as_features(big_endian), torch.from_numpy(native))
    assert as_features(native.astype(np.float16)).dtype == torch.float32
    assert as_features(native.astype(np.int16)).dtype == torch.float32
    assert as_features(native.astype(np.longdouble)).dtype == torch.float64
    assert as_features(native.astype(np.float32)).dtype == torch.float32
    assert as_features(torch.ones(3, 2, dtype=torch.bfloat16)).dtype == torch.float32
    wrapped = as_tensor(native, "x")
    assert wrapped.data_ptr() == native.__array_interface__["data"][0]  # no copy
    labels = as_labels(np.array([0, 2, 1], dtype=">i4"), 3, 3)
    assert labels.dtype == torch.int64 and labels.tolist() == [0, 2, 1]


# -- options ----------------------------------------------------------------------------------

BAD_VALUES = [float("inf"), float("nan"), -1.0, "a", True, [1.0]]


@pytest.mark.parametrize(("kind", "option"), [
    ("laplace", "prior_precision"), ("laplace", "noise_std"), ("laplace", "max_iter"),
    ("mfvi", "num_steps"), ("mfvi", "lr"), ("mfvi", "init_scale"), ("mfvi", "seed"),
    ("sgld", "num_samples"), ("sgld", "thinning"), ("sgld", "step_size"),
    ("sgld", "divergence_threshold"), ("conjugate", "nu"),
])
@pytest.mark.parametrize("value", BAD_VALUES)
def test_numeric_options_refuse_nan_inf_negative_and_wrong_types(kind, option, value):
    x, y = blobs()
    with pytest.raises(InvalidInputError, match=f"{option} must be .*; got "):
        fit_head(kind, x, y, 3, **{option: value})


def test_integer_options_refuse_floats_and_say_how_to_write_them():
    x, y = blobs()
    with pytest.raises(InvalidInputError, match="num_steps must be an integer >= 1; got 100.0 "
                                                r"\(a float\); write it without a decimal"):
        fit_head("mfvi", x, y, 3, num_steps=100.0)


def test_options_declared_as_none_or_strings_pass_and_numpy_numbers_work():
    x, y = blobs()
    post = fit_head("sgld", x, y, 3, num_samples=np.int64(3), burn_in=np.int32(2),
                    thinning=1, batch_size=None, step_size=None, prior_precision=np.float32(2))
    assert post.samples.shape[0] == 3
    assert fit_head("laplace", x, y, 3, structure="diag").structure.value == "diag"


def test_unknown_options_list_the_valid_ones():
    x, y = blobs()
    with pytest.raises(UnknownOptionError, match=r"no option 'num_stepz'.*prior_precision"):
        fit_head("laplace", x, y, 3, num_stepz=3)
    assert issubclass(UnknownOptionError, TypeError)  # what Python raises for a bad keyword
    with pytest.raises(UnknownOptionError, match=r"'temperature'.*prior, chi, nu, solver"):
        fit_head("conjugate", x, y, 3, temperature=2.0)


def test_every_option_error_is_an_inference_error_and_a_value_error():
    x, y = blobs()
    with pytest.raises(InferenceError) as caught:
        fit_head("laplace", x, y, 3, prior_precision=float("inf"))
    assert isinstance(caught.value, ValueError)


# -- predict_proba ----------------------------------------------------------------------------

FEATURE_POSTERIORS = ["gaussian_full", "gaussian_diag", "gaussian_lowrank", "ensemble",
                      "conjugate"]


@pytest.mark.parametrize("name", FEATURE_POSTERIORS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_predict_proba_takes_numpy_and_returns_the_features_dtype(name, dtype):
    post = MAKERS[name]()
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(dtype)
    got = post.predict_proba(x)
    want = post.predict_proba(torch.from_numpy(x))
    assert got.dtype == want.dtype == torch.from_numpy(x).dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("name", FEATURE_POSTERIORS)
def test_predict_proba_refuses_bad_features_clearly(name):
    post = MAKERS[name]()
    wrong_width = r"4 columns but the head (expects|was fitted on) 3"
    with pytest.raises(InvalidInputError, match=wrong_width):
        post.predict_proba(np.zeros((2, 4)))
    with pytest.raises(InvalidInputError, match="NaN"):
        post.predict_proba(np.full((2, 3), np.nan))
    with pytest.raises(InvalidInputError, match="strings"):
        post.predict_proba(np.array([["a"] * 3]))


def test_subnet_posterior_casts_floating_inputs_to_the_networks_dtype():
    post = subnet_posterior()  # a float64 network
    x32 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    want = post.predict_proba(x32.double())
    torch.testing.assert_close(post.predict_proba(x32), want, atol=0, rtol=0)
    torch.testing.assert_close(post.predict_proba(x32.numpy()), want, atol=0, rtol=0)
    with pytest.raises(InvalidInputError, match="non-empty batch"):
        post.predict_proba(np.zeros((0, 3)))
    with pytest.raises(InvalidInputError, match="NaN"):
        post.predict_proba(np.full((2, 3), np.nan))


def test_network_inputs_keep_integer_indices_for_embedding_networks():
    tokens = np.array([[1, 5, 2]], dtype=np.int64)
    assert as_network_inputs(tokens, torch.float32).dtype == torch.int64
    assert as_network_inputs(tokens.astype(np.float64), torch.float32).dtype == torch.float32


def test_strings_and_none_pass_where_the_signature_declares_them():
    from inference.factory import checked_options
    from inference.options import HeadKind

    def fit(features, labels, num_classes, *,
            prior_precision: float | PriorPrecisionMethod | None = None,  # noqa: F821
            num_steps: int = 10):
        """A fitting function whose prior precision may also be a method name (or chosen)."""

    checked = checked_options(HeadKind.LAPLACE, fit, {"prior_precision": "marglik"})
    assert checked == {"prior_precision": "marglik"}
    assert checked_options(HeadKind.LAPLACE, fit, {"prior_precision": None}) == {
        "prior_precision": None}
    assert checked_options(HeadKind.LAPLACE, fit, {"prior_precision": np.float32(2)}) == {
        "prior_precision": 2.0}
    with pytest.raises(InvalidInputError, match="num_steps must be an integer"):
        checked_options(HeadKind.LAPLACE, fit, {"num_steps": "many"})
    with pytest.raises(InvalidInputError, match="num_steps must be an integer"):
        checked_options(HeadKind.LAPLACE, fit, {"num_steps": None})
