"""Temperature scaling: exact derivatives, the exact 1-D optimum, bounds, degenerate data,
the search protocol the federated version uses, and before/after reports."""

import math
import warnings

import numpy as np
import pytest
import torch
from calibration_reference import calibrated_labels, random_probs

from calibration import evaluate
from calibration.errors import CalibrationError, InvalidInputError
from calibration.temperature import (
    TEMPERATURE_BOUNDS,
    NLLDerivatives,
    TemperatureAtBoundWarning,
    apply_temperature,
    fit_temperature,
    minimize_temperature,
    nll_derivatives,
    temperature_report,
    temperature_search,
)
from tests.devices import DEVICES


def overconfident(seed: int, n: int = 400, k: int = 5, sharpen: float = 3.0):
    """Logits of a calibrated model multiplied by ``sharpen`` (so the best T is near it)."""
    rng = np.random.default_rng(seed)
    probs = random_probs(rng, n, k, scale=1.2)
    labels = calibrated_labels(rng, probs)
    return torch.from_numpy(np.log(probs) * sharpen), torch.from_numpy(labels)


def grid_nll(logits: torch.Tensor, labels: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Summed NLL of softmax(logits * exp(-s)) at every s (a plain cross-entropy per point)."""
    out = []
    for chunk in s.split(2000):
        scaled = logits[None] * torch.exp(-chunk)[:, None, None]  # (S, N, K)
        log_p = torch.log_softmax(scaled, dim=2)
        out.append(-log_p.gather(2, labels.expand(len(chunk), -1)[..., None]).sum((1, 2)))
    return torch.cat(out)


def brute_force_minimum(logits, labels, low, high, step=1e-4):
    """(grid of s, NLL on it, argmin) for a grid of spacing ``step`` around the minimiser.

    A coarse grid (spacing 0.01) over [low, high] first, then the fine grid over the two
    coarse cells either side of the coarse argmin: the NLL is unimodal in s, so its minimiser
    lies there, and the fine grid is what a single grid of ``step`` would give near it.
    """
    coarse = torch.arange(low, high, 0.01, dtype=torch.float64)
    centre = float(coarse[grid_nll(logits, labels, coarse).argmin()])
    fine = torch.arange(centre - 0.02, centre + 0.02, step, dtype=torch.float64)
    values = grid_nll(logits, labels, fine)
    return fine, values, int(values.argmin())


def autograd_triple(logits: torch.Tensor, labels: torch.Tensor, s: float):
    log_t = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    nll = torch.nn.functional.cross_entropy(logits / torch.exp(log_t), labels, reduction="sum")
    (d1,) = torch.autograd.grad(nll, log_t, create_graph=True)
    (d2,) = torch.autograd.grad(d1, log_t)
    return nll.item(), d1.item(), d2.item()


# ---- the client side: NLL and its derivatives ---------------------------------------------
@pytest.mark.parametrize("s", [-2.0, -0.3, 0.0, 0.7, 3.0])
def test_derivatives_equal_autograd(s):
    logits, labels = overconfident(0, n=300)
    point = nll_derivatives(logits, labels, s, from_logits=True)
    nll, d1, d2 = autograd_triple(logits, labels, s)
    # both are float64 sums of 300 terms of the same quantity: they agree to rounding
    # (~1e-14 relative); 1e-10 still catches a wrong sign or a missing term of d2.
    assert point.nll_sum == pytest.approx(nll, rel=1e-10)
    assert point.d1 == pytest.approx(d1, rel=1e-10, abs=1e-10)
    assert point.d2 == pytest.approx(d2, rel=1e-10, abs=1e-10)
    assert point.count == 300 and point.log_temperature == s


def test_probabilities_are_scaled_through_their_logarithm():
    rng = np.random.default_rng(1)
    probs = random_probs(rng, 50, 4)
    labels = calibrated_labels(rng, probs)
    from_probs = nll_derivatives(probs, labels, 0.4, from_logits=False)
    from_logs = nll_derivatives(np.log(probs), labels, 0.4, from_logits=True)
    assert from_probs.nll_sum == pytest.approx(from_logs.nll_sum, rel=1e-13)
    assert from_probs.d1 == pytest.approx(from_logs.d1, rel=1e-12)
    assert from_probs.d2 == pytest.approx(from_logs.d2, rel=1e-12)


def test_a_zero_probability_is_floored_as_the_nll_metric_floors_it():
    probs = np.array([[0.0, 1.0], [0.5, 0.5]])
    point = nll_derivatives(probs, [0, 1], 0.0, from_logits=False)
    assert point.nll_sum == pytest.approx(-math.log(1e-12) + math.log(2), rel=1e-12)


def test_parts_add_up_and_refuse_different_temperatures():
    logits, labels = overconfident(2, n=90)
    whole = nll_derivatives(logits, labels, 0.5, from_logits=True)
    parts = [nll_derivatives(logits[i::3], labels[i::3], 0.5, from_logits=True)
             for i in range(3)]
    total = parts[0] + parts[1] + parts[2]
    assert total.count == whole.count
    for name in ("nll_sum", "d1", "d2"):
        assert getattr(total, name) == pytest.approx(getattr(whole, name), rel=1e-12)
    with pytest.raises(InvalidInputError, match="different temperatures"):
        _ = parts[0] + nll_derivatives(logits, labels, 0.6, from_logits=True)


# ---- the optimum ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed, sharpen", [(3, 3.0), (4, 0.4), (5, 1.0)])
def test_fit_is_the_minimum_of_a_fine_brute_force_grid(seed, sharpen):
    logits, labels = overconfident(seed, sharpen=sharpen)
    fit = fit_temperature(logits, labels, from_logits=True)
    step = 1e-4
    s, values, best = brute_force_minimum(logits, labels, -2.5, 2.5, step)
    assert 0 < best < len(s) - 1  # an interior minimum of the grid
    # a unimodal function's minimiser lies within one grid step of the grid's argmin
    assert abs(fit.log_temperature - float(s[best])) <= step
    # the parabola through the three grid points around the argmin has its vertex within
    # O(step^2 * |f'''/f''|) ~ 1e-8 of the true minimiser: 1e-6 catches a fit that merely
    # lands on the right grid cell
    f0, f1, f2 = (float(v) for v in values[best - 1:best + 2])
    vertex = float(s[best]) + step * (f0 - f2) / (2 * (f0 - 2 * f1 + f2))
    assert fit.log_temperature == pytest.approx(vertex, abs=1e-6)
    # the exact optimum is no worse than any grid point (up to float64 rounding of the sum)
    assert fit.nll * fit.count <= float(values.min()) * (1 + 1e-12)
    assert fit.temperature == pytest.approx(math.exp(fit.log_temperature), rel=1e-15)
    assert fit.at_bound is None and not fit.flat


def test_fit_converges_to_machine_precision_in_a_few_evaluations():
    logits, labels = overconfident(6, n=1000)
    fit = fit_temperature(logits, labels, from_logits=True)
    # the derivative at the optimum is rounding noise of a sum of 1000 O(1) terms
    assert abs(fit.d1) <= 1e-10 * fit.count
    # Newton from T = 1 converges quadratically; bisection alone would need ~50 evaluations
    assert fit.evaluations <= 12
    assert fit.nll_at_one == pytest.approx(evaluate(logits, labels, from_logits=True)["nll"],
                                           rel=1e-12)
    assert fit.nll < fit.nll_at_one


def test_an_overconfident_model_gets_t_above_one_and_an_underconfident_one_below():
    over = fit_temperature(*overconfident(7, sharpen=3.0), from_logits=True)
    under = fit_temperature(*overconfident(7, sharpen=0.3), from_logits=True)
    calibrated = fit_temperature(*overconfident(7, n=4000, sharpen=1.0), from_logits=True)
    assert over.temperature > 2.0
    assert under.temperature < 0.5
    assert calibrated.temperature == pytest.approx(1.0, abs=0.1)  # sampling noise of 4000


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_torch_float32_and_devices_give_the_same_fit(device):
    logits, labels = overconfident(8)
    reference = fit_temperature(logits.numpy(), labels.numpy(), from_logits=True)
    on_device = fit_temperature(logits.to(device), labels.to(device), from_logits=True)
    assert on_device.temperature == pytest.approx(reference.temperature, rel=1e-12)
    single = fit_temperature(logits.float(), labels, from_logits=True)
    # float32 logits differ from the float64 ones by ~6e-8 relative, so does the optimum
    assert single.temperature == pytest.approx(reference.temperature, rel=1e-5)


# ---- bounds and degenerate data ---------------------------------------------------------------
def test_separable_data_stop_at_the_lower_bound_and_say_so():
    labels = torch.arange(40) % 4
    logits = torch.nn.functional.one_hot(labels, 4).double() * 2.0  # label always on top
    with pytest.warns(TemperatureAtBoundWarning, match="lower bound.*separated"):
        fit = fit_temperature(logits, labels, from_logits=True)
    assert fit.at_bound == "lower"
    assert fit.temperature == TEMPERATURE_BOUNDS[0]
    assert fit.d1 > 0  # the NLL still rises with T there: the optimum lies beyond the bound
    with pytest.warns(TemperatureAtBoundWarning):
        narrow = fit_temperature(logits, labels, from_logits=True, bounds=(0.5, 2.0))
    assert narrow.temperature == 0.5 and narrow.at_bound == "lower"


def test_logits_certain_of_every_label_are_separable_not_flat():
    # exp(-1000) underflows: at T = 1 every row has p_y = 1 exactly, NLL and derivatives 0
    labels = torch.arange(12) % 3
    logits = torch.nn.functional.one_hot(labels, 3).double() * 1000.0
    with pytest.warns(TemperatureAtBoundWarning):
        fit = fit_temperature(logits, labels, from_logits=True)
    assert fit.at_bound == "lower" and not fit.flat and fit.nll == 0.0


def test_scores_that_rank_labels_last_stop_at_the_upper_bound():
    labels = torch.arange(40) % 4
    logits = -torch.nn.functional.one_hot(labels, 4).double()  # label always at the bottom
    with pytest.warns(TemperatureAtBoundWarning, match="upper bound"):
        fit = fit_temperature(logits, labels, from_logits=True)
    assert fit.at_bound == "upper" and fit.temperature == TEMPERATURE_BOUNDS[1]
    assert fit.d1 < 0
    assert fit.nll < math.log(4) + 0.01  # approaching the uniform prediction


def test_constant_rows_give_a_flat_nll_and_t_one_without_a_warning():
    logits = torch.full((30, 3), 0.7, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = fit_temperature(logits, torch.arange(30) % 3, from_logits=True)
    assert fit.flat and fit.temperature == 1.0 and fit.at_bound is None
    assert fit.nll == pytest.approx(math.log(3), rel=1e-15)


def test_the_same_logit_row_for_every_sample_is_fitted_like_any_data():
    # one prediction for all: T moves softmax(c / T) towards the label frequencies
    logits = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64).expand(60, 3)
    labels = torch.tensor([0] * 30 + [1] * 20 + [2] * 10)
    fit = fit_temperature(logits, labels, from_logits=True)
    s, _, best = brute_force_minimum(logits, labels, -1.0, 2.0)
    assert 0 < best < len(s) - 1 and abs(fit.log_temperature - float(s[best])) <= 1e-4


def test_labels_of_one_class_only_are_fitted():
    logits, _ = overconfident(9, n=200, k=3)
    logits[:, 0] += 2.0  # class 0 mostly, but not always, on top: an interior optimum
    labels = torch.zeros(200, dtype=torch.int64)
    fit = fit_temperature(logits, labels, from_logits=True)
    s, _, best = brute_force_minimum(logits, labels, -3.0, 3.0)
    assert 0 < best < len(s) - 1 and fit.at_bound is None
    assert abs(fit.log_temperature - float(s[best])) <= 1e-4


def test_a_single_class_column_is_refused():
    with pytest.raises(InvalidInputError, match="K >= 2"):
        fit_temperature(torch.zeros(5, 1), torch.zeros(5, dtype=torch.int64), from_logits=True)


def test_a_single_sample_is_fitted():
    with pytest.warns(TemperatureAtBoundWarning):
        fit = fit_temperature(np.array([[1.0, 0.5]]), [1], from_logits=True)
    assert fit.at_bound == "upper"  # one wrong sample: the NLL falls towards uniform


# ---- the search protocol ----------------------------------------------------------------------
def test_the_generator_protocol_and_the_callable_follow_the_same_path():
    logits, labels = overconfident(10)
    proposals = []
    search = temperature_search()
    s = next(search)
    while True:
        proposals.append(s)
        try:
            s = search.send(nll_derivatives(logits, labels, s, from_logits=True))
        except StopIteration as done:
            protocol_fit = done.value
            break
    seen = []

    def objective(s):
        seen.append(s)
        return nll_derivatives(logits, labels, s, from_logits=True)

    assert minimize_temperature(objective) == protocol_fit
    assert seen == proposals and proposals[0] == 0.0  # starts at T = 1
    assert protocol_fit.evaluations == len(proposals)


def test_summed_client_triples_give_the_pooled_temperature():
    logits, labels = overconfident(11, n=500)
    clients = [(logits[i::7], labels[i::7]) for i in range(7)]

    def federated(s):
        return sum((nll_derivatives(x, y, s, from_logits=True) for x, y in clients[1:]),
                   nll_derivatives(*clients[0], s, from_logits=True))

    pooled = fit_temperature(logits, labels, from_logits=True)
    # the same proposals and sums up to summation order: the optima agree to rounding
    assert minimize_temperature(federated).temperature == pytest.approx(pooled.temperature,
                                                                        rel=1e-12)


def test_the_search_refuses_inconsistent_triples():
    search = temperature_search()
    s = next(search)
    with pytest.raises(InvalidInputError, match="proposed log T"):
        search.send(NLLDerivatives(s + 1.0, 1.0, 0.1, 1.0, 5))
    search = temperature_search()
    s = next(search)
    s = search.send(NLLDerivatives(s, 10.0, 3.0, 1.0, 5))
    with pytest.raises(InvalidInputError, match="number of samples changed"):
        search.send(NLLDerivatives(s, 10.0, 1.0, 1.0, 6))
    search = temperature_search()
    s = next(search)
    with pytest.raises(InvalidInputError, match="finite"):
        search.send(NLLDerivatives(s, float("nan"), 0.0, 1.0, 5))
    search = temperature_search()
    s = next(search)
    with pytest.raises(InvalidInputError, match="without samples"):
        search.send(NLLDerivatives(s, 0.0, 0.0, 0.0, 0))


def test_an_objective_that_is_no_nll_runs_out_of_evaluations():
    # d2 < 0 everywhere and d1 alternating: nothing a sum of NLL terms can produce
    calls = iter(range(10**6))

    def erratic(s):
        return NLLDerivatives(s, 1.0, (-1.0) ** next(calls), -1.0, 3)

    with pytest.raises(CalibrationError, match="did not converge"):
        minimize_temperature(erratic, max_iterations=20)


@pytest.mark.parametrize("bounds", [(0.0, 1.0), (2.0, 1.0), (1.0, math.inf), "ab"])
def test_bad_bounds_are_refused(bounds):
    with pytest.raises(InvalidInputError, match="bounds"):
        fit_temperature(np.eye(2), [0, 1], from_logits=True, bounds=bounds)


def test_bad_inputs_are_refused_with_the_metrics_messages():
    with pytest.raises(InvalidInputError, match="NaN"):
        fit_temperature(np.array([[np.nan, 0.0]]), [0], from_logits=True)
    with pytest.raises(InvalidInputError, match="out of range"):
        fit_temperature(np.eye(2), [0, 2], from_logits=True)
    with pytest.raises(InvalidInputError, match="from_logits=True"):
        fit_temperature(np.array([[2.0, -1.0]]), [0], from_logits=False)  # logits as probs
    with pytest.raises(InvalidInputError, match="True or False"):
        fit_temperature(np.eye(2), [0, 1], from_logits="yes")


# ---- applying it and reporting ------------------------------------------------------------
def test_applying_t_to_probabilities_is_the_renormalised_power():
    rng = np.random.default_rng(12)
    probs = random_probs(rng, 20, 6)
    expected = probs ** (1 / 2.5)
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(apply_temperature(probs, 2.5, from_logits=False).numpy(),
                               expected, rtol=1e-12)
    np.testing.assert_allclose(apply_temperature(probs, 1.0, from_logits=False).numpy(), probs,
                               rtol=1e-12)
    logits = np.log(probs) + 3.0  # logits are shift-invariant
    np.testing.assert_allclose(apply_temperature(logits, 2.5, from_logits=True).numpy(),
                               expected, rtol=1e-12)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.inf, math.nan, True, "2"])
def test_applying_a_bad_temperature_is_refused(temperature):
    with pytest.raises(InvalidInputError, match="temperature"):
        apply_temperature(np.eye(2), temperature, from_logits=True)


def test_report_gives_metrics_before_and_after_and_fitting_data_improve():
    logits, labels = overconfident(13, n=600)
    fit = fit_temperature(logits, labels, from_logits=True)
    report = temperature_report(fit, logits, labels, from_logits=True, n_bins=10)
    assert report.before == evaluate(logits, labels, n_bins=10, from_logits=True)
    scaled = torch.softmax(logits / fit.temperature, dim=1)
    assert report.after == pytest.approx(evaluate(scaled, labels, n_bins=10), rel=1e-12)
    assert report.after["accuracy"] == report.before["accuracy"]  # T never changes the argmax
    # T minimises the NLL of these data, and T = 1 is one of the candidates
    assert report.after["nll"] < report.before["nll"]
    assert report.after["ece"] < report.before["ece"]  # 3x overconfident: a large, sure gain
    assert report.to_dict()["fit"]["temperature"] == fit.temperature
    bare = temperature_report(2.0, logits, labels, from_logits=True)
    assert bare.fit is None and bare.temperature == 2.0
