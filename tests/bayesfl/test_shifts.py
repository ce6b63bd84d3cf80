"""Input shifts (bayesfl.shifts) against independent references, and the shift report of a
small real run (bayesfl.evaluate_shift): the OOD rows, and pooled = the concatenated rows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import bayesfl
import calibration
from bayesfl.errors import ConfigError, DataError
from bayesfl.shift_evaluation import (
    evaluate_shift,
    selective_rows,
    selective_state,
    unseen_label_rows,
)
from bayesfl.shifts import (
    Shift,
    apply_shift,
    as_shifts,
    gaussian_noise,
    image_shape_of,
    parse_shift,
    reduce_contrast,
    rotate,
)
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE


# ---- transforms ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 5, 5), (2, 7, 7)])
@pytest.mark.parametrize("k", [-2, -1, 1, 2, 3, 4])
def test_rotation_by_multiples_of_90_degrees_is_rot90_exactly(shape, k):
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(k + 7))
    assert torch.equal(rotate(x, 90 * k, shape), torch.rot90(x, k, dims=(-2, -1)))


def test_rotation_of_flat_rows_rotates_their_image():
    x = torch.rand(3, 64, generator=torch.Generator().manual_seed(0))
    out = rotate(x, 90, (1, 8, 8))
    assert out.shape == (3, 64)
    assert torch.equal(out, torch.rot90(x.view(3, 1, 8, 8), 1, dims=(-2, -1)).reshape(3, 64))


def test_positive_degrees_turn_the_image_counter_clockwise_as_displayed():
    # a pixel in the top-right corner (row 0, last column) ends in the top-left corner
    x = torch.zeros(1, 1, 5, 5)
    x[0, 0, 0, 4] = 1.0
    out = rotate(x, 90, (1, 5, 5))
    assert out[0, 0, 0, 0] == 1.0 and out.sum() == 1.0
    # 180 degrees on a non-square image: both flips, exactly
    y = torch.rand(2, 1, 4, 6)
    assert torch.equal(rotate(y, 180, (1, 4, 6)), y.flip(-1).flip(-2))


def _bilinear_rotation(image: np.ndarray, degrees: float, fill: float) -> np.ndarray:
    """Reference: output pixel (i, j) takes the input at the point the rotation brings there,
    ``(x, y) = R(-degrees) (j - cx, i - cy)`` in display coordinates (y down), bilinear,
    ``fill`` outside the image."""
    h, w = image.shape
    a = math.radians(degrees)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    out = np.empty_like(image, dtype=np.float64)

    def pixel(r: int, c: int) -> float:
        return image[r, c] - fill if 0 <= r < h and 0 <= c < w else 0.0

    for i in range(h):
        for j in range(w):
            xo, yo = j - cx, i - cy
            x = math.cos(a) * xo - math.sin(a) * yo + cx
            y = math.sin(a) * xo + math.cos(a) * yo + cy
            r0, c0 = math.floor(y), math.floor(x)
            fy, fx = y - r0, x - c0
            out[i, j] = fill + ((1 - fy) * (1 - fx) * pixel(r0, c0)
                                + (1 - fy) * fx * pixel(r0, c0 + 1)
                                + fy * (1 - fx) * pixel(r0 + 1, c0)
                                + fy * fx * pixel(r0 + 1, c0 + 1))
    return out


@pytest.mark.parametrize(("degrees", "size"), [(30.0, (9, 9)), (-45.0, (8, 8)), (15.0, (6, 10))])
def test_rotation_is_bilinear_about_the_centre_with_the_fill_outside(degrees, size):
    image = torch.rand(1, 1, *size, generator=torch.Generator().manual_seed(2))
    out = rotate(image, degrees, (1, *size), fill=-0.25)[0, 0].numpy()
    reference = _bilinear_rotation(image[0, 0].double().numpy(), degrees, -0.25)
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-6)
    constant = rotate(torch.full((1, 1, 9, 9), 0.7), 45, (1, 9, 9), fill=-0.25)
    assert constant[0, 0, 0, 0] == pytest.approx(-0.25)  # a corner rotated out of view
    assert constant[0, 0, 4, 4] == pytest.approx(0.7)    # the centre stays


def test_severity_zero_is_the_identity_for_every_shift():
    x = torch.rand(5, 64)
    for kind in ("rotate", "noise", "contrast"):
        out = apply_shift(kind, 0.0, x, image_shape=(1, 8, 8), data_range=(0.0, 1.0),
                          generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, x) and out is not x


def test_noise_has_the_stated_statistics_is_clipped_and_deterministic():
    x = torch.full((200, 500), 0.5)
    gen = torch.Generator().manual_seed(3)
    out = gaussian_noise(x, 0.1, (0.0, 1.0), generator=gen)
    delta = (out - x).double()
    assert abs(float(delta.mean())) < 2e-3 and float(delta.std()) == pytest.approx(0.1, rel=0.01)
    # sigma is in units of the data's range: range [0, 4] scales the noise by 4
    wide = gaussian_noise(torch.full((200, 500), 2.0), 0.1, (0.0, 4.0),
                          generator=torch.Generator().manual_seed(3))
    assert float((wide - 2.0).double().std()) == pytest.approx(0.4, rel=0.01)
    # clipped to the range; the same generator seed gives the same draws
    big = gaussian_noise(x, 5.0, (0.0, 1.0), generator=torch.Generator().manual_seed(3))
    assert float(big.min()) == 0.0 and float(big.max()) == 1.0
    again = gaussian_noise(x, 0.1, (0.0, 1.0), generator=torch.Generator().manual_seed(3))
    assert torch.equal(out, again)
    # the formula, with given draws
    eps = torch.randn(4, 6, dtype=torch.float64)
    y = torch.rand(4, 6)
    expected = (y.double() + 0.3 * 2.0 * eps).clamp(-1.0, 1.0).float()
    assert torch.equal(gaussian_noise(y, 0.3, (-1.0, 1.0), eps=eps), expected)


def test_contrast_follows_its_formula_per_image():
    x = torch.rand(6, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    for s in (0.25, 0.5, 1.0):
        out = reduce_contrast(x, s, (0.0, 1.0), (1, 4, 4)).numpy()
        arr = x.numpy().astype(np.float64)
        m = arr.reshape(6, -1).mean(axis=1).reshape(6, 1, 1, 1)
        reference = np.clip(m + (1 - s) * (arr - m), 0.0, 1.0).astype(np.float32)
        np.testing.assert_allclose(out, reference, rtol=0, atol=1e-7)
    flat = reduce_contrast(x, 1.0, (0.0, 1.0), (1, 4, 4))
    assert torch.allclose(flat, x.mean(dim=(1, 2, 3), keepdim=True).expand_as(x), atol=1e-7)


def test_image_shapes_and_refusals():
    assert image_shape_of((64,), "digits") == (1, 8, 8)
    assert image_shape_of((1, 28, 28), "mnist_5k") == (1, 28, 28)
    assert image_shape_of((784,), "custom", (28, 28)) == (1, 28, 28)
    assert image_shape_of((20,), "gaussian_mixture") is None
    assert image_shape_of((64,), None) is None  # flat rows of unknown data: not images
    with pytest.raises(ConfigError, match="does not fit"):
        image_shape_of((784,), None, (1, 28, 27))
    with pytest.raises(ConfigError, match="needs images"):
        apply_shift("rotate", 15, torch.rand(2, 20), image_shape=None, data_range=(0, 1))
    with pytest.raises(ConfigError, match="needs images"):
        apply_shift("contrast", 0.0, torch.rand(2, 20), image_shape=None, data_range=(0, 1))


def test_shift_specifications_are_checked():
    assert parse_shift("rotate:15, 30,15") == Shift("rotate", (15.0, 30.0))
    assert as_shifts([("noise", [0.1, 0.2]), "contrast:0.5"]) == [
        Shift("noise", (0.1, 0.2)), Shift("contrast", (0.5,))]
    assert as_shifts({"rotate": 90}) == [Shift("rotate", (90.0,))]
    for text, match in [("rot:15", "did you mean 'rotate'"), ("rotate", "KIND:S1"),
                        ("rotate:x", "not a number"), ("contrast:1.5", "outside"),
                        ("noise:-0.1", "outside"), ("noise:nan", "finite"),
                        ("noise:", "not a number")]:
        with pytest.raises(ConfigError, match=match):
            parse_shift(text)
    with pytest.raises(ConfigError, match="no severities"):
        as_shifts([("rotate", [])])
    with pytest.raises(ConfigError, match="finite"):
        as_shifts([("rotate", [True])])


def test_selective_table_gives_back_the_rows_it_counted():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, 4, generator=gen) * 3, dim=1).double()
    probs[:10] = probs[0]  # ties
    labels = torch.randint(0, 4, (50,), generator=gen)
    confidence, correct = selective_rows(selective_state(probs, labels))
    assert calibration.aurc(confidence, correct) == calibration.aurc(probs, labels)
    assert calibration.accuracy_at_coverage(confidence, correct, 0.8) == \
        calibration.accuracy_at_coverage(probs, labels, 0.8)


# ---- on a real run --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shift") / "run"
    bayesfl.simulate(strategy="fedlog", dataset="digits", clients=6, partition="labels:5",
                     rounds=1, seed=1, novel_fraction=0.2, body="mlp:32", feature_dim=16,
                     local_epochs=1, progress=False, out=out)
    return bayesfl.load_run(out)


@pytest.fixture(scope="module")
def report(run):
    return evaluate_shift(run, [("rotate", [30, 90]), ("noise", [0.2])],
                          ood=["unseen-labels", "novel-clients"], seed=5, posterior_samples=8,
                          progress=False)


def _client_data(run):
    dataset = bayesfl.load_dataset("digits", seed=1)
    from bayesfl.engine.setup import run_setup

    return run_setup(run.config, dataset, torch.device("cpu")).client_data


def test_unseen_label_rows_are_exactly_the_rows_of_labels_the_client_never_trained_on(run):
    data = _client_data(run)
    for k in range(len(data)):
        seen = set(data[k].train_y.tolist())
        inside, outside = unseen_label_rows(data, k)
        own = [x for x, y in zip(data[k].test_x, data[k].test_y.tolist(), strict=True)
               if y in seen]
        others = [x for d in data for x, y in zip(d.test_x, d.test_y.tolist(), strict=True)
                  if y not in seen]
        assert seen != set(range(10))
        assert torch.equal(inside, torch.stack(own))
        assert torch.equal(outside, torch.stack(others))


def test_pooled_figures_are_those_of_the_concatenated_rows(run, report):
    data = _client_data(run)
    trained = [k for k in range(len(data)) if k not in run.novel]
    for key in (PREDICTIVE, MAP_PLUGIN):
        for shift, severity in (("none", 0.0), ("rotate", 90.0)):
            probs, labels = [], []
            for k in trained:
                x = data[k].test_x if shift == "none" else rotate(data[k].test_x, 90, (1, 8, 8))
                probs.append(run.strategy.predict(run.clients[k].config, run.client_state(k),
                                                  run.evaluation_broadcast, x)[key])
                labels.append(data[k].test_y)
            p, y = torch.cat(probs), torch.cat(labels)
            (row,) = report.rows(scope="pooled", shift=shift, severity=severity,
                                 predictive=key)
            reference = calibration.Accumulator(run.config.n_bins).update(p, y).compute()
            assert row["count"] == len(y)
            assert row["accuracy"] == reference["accuracy"]
            for name in ("ece", "nll", "brier"):
                assert row[name] == pytest.approx(reference[name], rel=1e-12, abs=1e-15)
            assert row["aurc"] == calibration.aurc(p, y)
            assert row["accuracy_at_coverage"] == calibration.accuracy_at_coverage(p, y, 0.8)
        # the clean rows' pooled figures are the run's own summary
        (clean,) = report.rows(scope="pooled", shift="none", predictive=key)
        summary = run.summary if key == PREDICTIVE else run.summary["map_plugin"]
        assert clean["accuracy"] == pytest.approx(summary["accuracy_pooled"], abs=1e-12)
        assert clean["nll"] == pytest.approx(summary["nll"], rel=1e-9)
    # OOD detection: the merged AUROC of the clients is the AUROC of all their rows together
    scores, flags = [], []
    for k in trained:
        inside, outside = unseen_label_rows(data, k)
        p = run.strategy.predict(run.clients[k].config, run.client_state(k),
                                 run.evaluation_broadcast, torch.cat([inside, outside]))
        scores.append(calibration.ood_scores(p[PREDICTIVE], kind="entropy"))
        flags.append(torch.arange(len(inside) + len(outside)) >= len(inside))
    (row,) = report.rows("ood", scope="pooled", ood="unseen-labels", predictive=PREDICTIVE,
                         score="entropy")
    assert row["auroc"] == calibration.auroc(torch.cat(scores), torch.cat(flags))
    assert row["fpr_at_95"] == calibration.fpr_at_tpr(torch.cat(scores), torch.cat(flags))
    assert row["n_ood"] == int(torch.cat(flags).sum())


def test_the_report_has_every_figure_and_is_reproducible(run, report):
    assert report.predictives == [PREDICTIVE, MAP_PLUGIN]
    clients = {r["client"] for r in report.rows(scope="client")}
    assert clients == set(range(6))
    assert report.rows(scope="novel", shift="none")  # the novel client, merged apart
    scores = {r["score"] for r in report.rows("ood", scope="pooled", ood="unseen-labels")}
    assert scores == {"entropy", "max_prob", "mutual_information"}
    assert report.rows("ood", scope="pooled", ood="novel-clients", score="entropy")
    assert json.loads(report.to_json())["settings"]["shifts"] == {"rotate": [30.0, 90.0],
                                                                  "noise": [0.2]}
    # the noise draws depend on the seed and the client only: the same figures alone
    again = evaluate_shift(run, [("noise", [0.2])], seed=5, progress=False)
    other = evaluate_shift(run, [("noise", [0.2])], seed=6, progress=False)
    mine = report.rows(shift="noise")
    assert again.rows(shift="noise") == mine
    assert [r["nll"] for r in other.rows(shift="noise")] != [r["nll"] for r in mine]
    markdown = report.to_markdown()
    assert "### rotate (degrees)" in markdown and "unseen-labels" in markdown
    assert all(math.isfinite(r["nll"]) for r in report.rows(scope="pooled"))


def test_evaluate_shift_refuses_what_it_cannot_do(run):
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        evaluate_shift(run, progress=False)
    with pytest.raises(ConfigError, match="unknown ood set"):
        evaluate_shift(run, ood="labels", progress=False)
    with pytest.raises(ConfigError, match="takes a run"):
        evaluate_shift("runs/demo", [("noise", [0.1])], progress=False)
    with pytest.raises(ConfigError, match="coverage"):
        evaluate_shift(run, [("noise", [0.1])], coverage=1.5, progress=False)
    with pytest.raises(DataError, match="not the run's"):
        x = torch.rand(100, 64)
        evaluate_shift(run, [("noise", [0.1])], data=(x, torch.arange(100) % 10),
                       progress=False)


def test_rotate_is_refused_on_data_that_are_not_images():
    run = bayesfl.simulate(strategy="fedavg", dataset="gaussian_mixture", clients=3,
                           partition="iid", rounds=1, seed=1, body="mlp:8", feature_dim=4,
                           local_epochs=1, progress=False,
                           dataset_options={"n": 90, "num_classes": 3, "dim": 5})
    with pytest.raises(ConfigError, match=r"needs images.*gaussian_mixture"):
        evaluate_shift(run, [("rotate", [15])], progress=False)
    with pytest.raises(ConfigError, match="every client trained on every label"):
        evaluate_shift(run, ood="unseen-labels", progress=False)
    with pytest.raises(ConfigError, match="no novel clients"):
        evaluate_shift(run, ood="novel-clients", progress=False)
    # noise works on any data; a strategy without a posterior has no plug-in and no MI
    report = evaluate_shift(run, [("noise", [0.5])], progress=False)
    assert report.predictives == [PREDICTIVE]
    assert report.rows(scope="pooled", shift="noise", severity=0.5)
