"""solve_map: the exact FedLog MAP (spec §2.3) against independent solves of the full problem."""

import math

import mpmath
import numpy as np
import pytest
import torch

from inference.conjugate.solver import map_gradient, map_objective, solve_map, solve_map_adam
from inference.errors import InvalidInputError
from tests.devices import DEVICES

# The issue asks for 1e-6; measured agreement with the reference is <= 5e-13, so 1e-9 is used.
RELATIVE_TOLERANCE = 1e-9
GRADIENT_TOLERANCE = 1e-8


def reference_map(S: torch.Tensor, N: float) -> torch.Tensor:
    """Independent MAP of the full C*k problem: torch L-BFGS (strong Wolfe line search,
    float64, analytic gradient by autograd) on -J from the paper's start S/(2N), run until the
    line search can no longer decrease the objective, then one Newton-CG step. It uses neither
    the row-parallel structure, nor the scalar reduction, nor the Laplace formulas."""
    S = S.double().cpu()
    x = (S / N / 2.0).clone().requires_grad_(True)
    scale = float(S.abs().max()) or 1.0
    optimizer = torch.optim.LBFGS([x], lr=1, max_iter=400, tolerance_grad=0.0,
                                  tolerance_change=0.0, history_size=20,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = -stable_objective(x, S, N) / scale
        loss.backward()
        return loss

    optimizer.step(closure)
    return newton_polish(x.detach(), S, N)


def newton_polish(W: torch.Tensor, S: torch.Tensor, N: float, cg_steps: int = 60
                  ) -> torch.Tensor:
    """One Newton step from the L-BFGS point: H d = -g by conjugate gradients, with H v from
    autograd double backward. L-BFGS stops where the objective's rounding hides progress
    (~1e-7 relative); the gradient is still informative there, and Newton squares the error."""
    W = W.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(-map_objective(W, S, N), W, create_graph=True)
    r = -g.detach()
    d, p = torch.zeros_like(r), r.clone()
    rr = (r * r).sum()
    threshold = 1e-14 * float(rr.sqrt())
    for _ in range(cg_steps):
        if float(rr.sqrt()) <= threshold:
            break
        Hp = torch.autograd.grad(g, W, grad_outputs=p, retain_graph=True)[0]
        step = rr / (p * Hp).sum()
        d, r = d + step * p, r - step * Hp
        rr_new = (r * r).sum()
        p, rr = r + (rr_new / rr) * p, rr_new
    return (W + d).detach()


def stable_objective(W: torch.Tensor, S: torch.Tensor, N: float) -> torch.Tensor:
    """J(W) + N log C, written so that tiny heads keep their relative precision:
    logsumexp(q) - log C = log1p(mean(expm1(q))) when every q = ||W_y||^2/4 is small."""
    q = W.pow(2).sum(1) / 4.0
    if float(q.detach().max()) < 1.0:
        centred = torch.log1p(torch.expm1(q).mean())
    else:
        centred = torch.logsumexp(q, 0) - math.log(q.numel())
    return (W * S).sum() - N * centred


def random_problem(C: int, k: int, seed: int, empty: bool = True, negative: bool = True):
    """Statistics like a client sum: counts in column 0, feature sums elsewhere; some classes
    empty, some rows negated (as DP noise can make them)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 200, (C,), generator=g).double()
    S = torch.randn(C, k, generator=g, dtype=torch.float64) * counts.sqrt().unsqueeze(1) * 2
    S[:, 0] = counts
    if empty and C > 1:
        S[torch.arange(C) % 4 == 1] = 0.0
    N = float(S[:, 0].sum()) + 1.0
    if negative:
        S[torch.arange(C) % 3 == 2] *= -1.0
    return S, N


def relative_gradient(W: torch.Tensor, S: torch.Tensor, N: float) -> float:
    return float(map_gradient(W, S, N).abs().max() / S.abs().max())


def relative_error(W: torch.Tensor, reference: torch.Tensor | np.ndarray) -> float:
    """max |W - reference| / max |reference| (the relative error the issue asks for)."""
    W, reference = W.cpu().numpy(), np.asarray(reference)
    return float(np.abs(W - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("C", [2, 10, 100, 1000])
@pytest.mark.parametrize("k", [3, 65, 513])
def test_map_matches_full_problem_solve_and_zeroes_the_gradient(C, k):
    S, N = random_problem(C, k, seed=C * 1000 + k)
    W = solve_map(S, N)
    assert relative_error(W, reference_map(S, N)) <= RELATIVE_TOLERANCE
    assert relative_gradient(W, S, N) <= GRADIENT_TOLERANCE


@pytest.mark.parametrize("C", [2, 10, 100])
@pytest.mark.parametrize(
    ("statistic_scale", "count_scale"),
    [(1e-6, 1.0), (1e-6, 1e-6), (1e6, 1e6), (1.0, 1e6)],
    ids=["tiny-S", "tiny-S-and-N", "huge-S-and-N", "huge-N"],
)
def test_map_is_accurate_for_tiny_and_huge_statistics(C, statistic_scale, count_scale):
    S, N = random_problem(C, 65, seed=C)
    S, N = S * statistic_scale, N * count_scale
    W = solve_map(S, N)
    assert relative_error(W, reference_map(S, N)) <= RELATIVE_TOLERANCE
    assert relative_gradient(W, S, N) <= GRADIENT_TOLERANCE


def high_precision_map(S: torch.Tensor, N: float, digits: int = 50) -> np.ndarray:
    """MAP from the scalar reduction solved in 50-digit arithmetic (mpmath's Lambert W)."""
    mpmath.mp.dps = digits
    norms = [mpmath.sqrt(sum(mpmath.mpf(x) ** 2 for x in row)) for row in S.tolist()]
    N_mp = mpmath.mpf(N)

    def probabilities(l):
        out = []
        for a in norms:
            if a == 0:
                out.append(mpmath.exp(-l))
            else:
                w = mpmath.lambertw(2 * a * a * mpmath.exp(2 * l) / N_mp**2).real
                out.append(mpmath.sqrt(2) * a / (N_mp * mpmath.sqrt(w)))
        return out

    l = mpmath.findroot(lambda l: mpmath.log(mpmath.fsum(probabilities(l))),
                        (mpmath.log(len(norms)), mpmath.mpf(10) ** 30), solver="anderson")
    rows = []
    for a, p, row in zip(norms, probabilities(l), S.tolist(), strict=True):
        factor = 0 if a == 0 else 2 / (N_mp * p)
        rows.append([float(factor * mpmath.mpf(x)) for x in row])
    return np.array(rows)


@pytest.mark.parametrize("statistic_scale", [1e6, 1e12])
def test_map_is_accurate_when_statistics_dwarf_the_count(statistic_scale):
    # ||W_y||^2 / 4 reaches 1e10..1e22 here, so the gradient itself cannot be evaluated in
    # float64 (one ulp of W moves p by more than 1e-8); the forward error is what is checked.
    S, N = random_problem(10, 5, seed=3)
    S = S * statistic_scale
    W = solve_map(S, N)
    reference = high_precision_map(S, N)
    assert float((W.pow(2).sum(1) / 4).max()) > 1e9
    assert relative_error(W, reference) <= 1e-12


def test_rows_are_positive_multiples_of_statistic_rows_and_empty_classes_are_zero():
    S, N = random_problem(12, 7, seed=5)
    W = solve_map(S, N)
    empty = S.abs().sum(1) == 0
    assert bool((W[empty] == 0).all())
    ratio = (W[~empty] * S[~empty]).sum(1) / S[~empty].pow(2).sum(1)
    assert bool((ratio > 0).all())
    torch.testing.assert_close(W[~empty], ratio.unsqueeze(1) * S[~empty], rtol=1e-13, atol=0)


def test_moment_matching_holds_at_the_map():
    # spec §2.1: p_y W_y / 2 == S_y / N (float64, rtol 1e-12)
    S, N = random_problem(20, 9, seed=6, empty=False)
    W = solve_map(S, N)
    p = torch.softmax(W.pow(2).sum(1) / 4, 0)
    torch.testing.assert_close(p.unsqueeze(1) * W / 2, S / N, rtol=1e-12, atol=1e-15)


def test_single_class_has_the_closed_form_two_s_over_n():
    S = torch.tensor([[3.0, -1.0, 2.5]], dtype=torch.float64)
    torch.testing.assert_close(solve_map(S, 4.0), 2 * S / 4.0, rtol=1e-14, atol=0)


def test_all_zero_statistics_give_the_zero_head():
    assert bool((solve_map(torch.zeros(5, 4, dtype=torch.float64), 3.0) == 0).all())


def test_map_is_deterministic_and_float32_input_is_solved_in_float64():
    S, N = random_problem(30, 11, seed=7)
    first = solve_map(S.float(), N)
    assert first.dtype == torch.float64
    assert torch.equal(first, solve_map(S.float(), N))


def test_random_restarts_of_lbfgs_reach_the_same_head():
    S, N = random_problem(6, 4, seed=8)
    W = solve_map(S, N)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randn(6, 4, generator=generator, dtype=torch.float64)
        x = start.clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS([x], lr=1, max_iter=500, tolerance_grad=1e-14,
                                      tolerance_change=0, history_size=50,
                                      line_search_fn="strong_wolfe")

        def closure(x=x, optimizer=optimizer):
            optimizer.zero_grad()
            loss = -map_objective(x, S, N) / N
            loss.backward()
            return loss

        optimizer.step(closure)
        assert relative_error(x.detach(), W) <= 1e-6  # plain L-BFGS precision (no polishing)


def test_paper_adam_loop_stops_short_but_agrees_to_two_percent():
    # spec §2.2/§9: Adam stops ~1-3% short (max-abs error over max entry; 5e-2 allowed here),
    # never above the optimum, with >= 95% arg-max agreement.
    S, N = random_problem(10, 21, seed=9, empty=False, negative=False)
    W = solve_map(S, N)
    W_adam, steps = solve_map_adam(S, N)
    assert steps > 1 and steps < 10_000, "the Adam loop should stop on its own tolerance"
    assert float((W_adam - W).abs().max() / W.abs().max()) <= 5e-2
    assert float(map_objective(W_adam, S, N)) <= float(map_objective(W, S, N))
    x = torch.cat([torch.ones(2000, 1), torch.randn(2000, 20)], 1).double()
    agreement = ((x @ W.T).argmax(1) == (x @ W_adam.T).argmax(1)).double().mean()
    assert float(agreement) >= 0.95


@pytest.mark.parametrize("device", DEVICES)
def test_map_stays_on_the_statistics_device(device):
    S, N = random_problem(8, 5, seed=10)
    W = solve_map(S.to(device), N)
    assert W.device.type == device
    torch.testing.assert_close(W.cpu(), solve_map(S, N), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("N", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_or_non_finite_count_is_rejected(N):
    with pytest.raises(InvalidInputError, match="N must be"):
        solve_map(torch.ones(2, 3, dtype=torch.float64), N)


@pytest.mark.parametrize(
    "S",
    [torch.ones(3, dtype=torch.float64), torch.tensor([[1.0, math.nan]]),
     torch.tensor([[1.0, math.inf]]), torch.ones(2, 2, dtype=torch.int64)],
    ids=["1-D", "nan", "inf", "integer"],
)
def test_malformed_statistic_is_rejected(S):
    with pytest.raises(InvalidInputError):
        solve_map(S, 1.0)


def test_statistics_that_would_overflow_the_head_are_rejected():
    with pytest.raises(InvalidInputError, match="too large"):
        solve_map(torch.tensor([[1e200, 0.0]], dtype=torch.float64), 1.0)
    # Each row alone is in range, but with C = 1e5 equal rows log Z = C^2 a^2 / N^2 ~ 1e310.
    many = torch.zeros(100_000, 2, dtype=torch.float64)
    many[:, 0] = 1e150
    with pytest.raises(InvalidInputError, match="too large"):
        solve_map(many, 1.0)


def test_a_root_find_out_of_steps_names_its_figures_and_the_other_solver():
    # Valid statistics converge in a few Newton steps; one step is not enough for this one, so
    # the cap (max_steps) is what makes the failure reachable.
    from inference.errors import NumericalError

    S = torch.tensor([[3.0, 1.0], [0.5, 2.0], [1.0, 1.0]], dtype=torch.float64)
    with pytest.raises(NumericalError, match=r"did not converge in 1 steps \(bracket .*C = 3.*"
                       r"solve_map_adam"):
        solve_map(S, 10.0, max_steps=1)


def test_a_root_find_out_of_steps_says_how_to_raise_the_limit_and_the_limit_is_reachable():
    from inference import fit_head
    from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics
    from inference.errors import NumericalError

    g = torch.Generator().manual_seed(0)
    features, labels = torch.randn(60, 4, generator=g), torch.arange(60) % 5
    stats = SufficientStatistics.from_features(features, labels, 5)
    S, N = stats.table.double(), float(stats.n) + 1.0  # the default prior's (chi 0, nu 1)
    with pytest.raises(NumericalError) as info:
        solve_map(S, N, max_steps=1)
    message = str(info.value)
    assert "did not converge in 1 steps" in message
    assert "max_root_steps=" in message and "solver='adam'" in message
    # the default converges, and so does any limit at or above what it needs
    torch.testing.assert_close(solve_map(S, N, max_steps=50), solve_map(S, N), rtol=0, atol=0)
    # reachable where users build heads: the posterior and fit_head("conjugate", ...)
    with pytest.raises(NumericalError, match="did not converge in 1 steps"):
        ConjugatePosterior(ConjugatePrior(), stats, max_root_steps=1).map()
    with pytest.raises(NumericalError, match="did not converge in 1 steps"):
        fit_head("conjugate", features, labels, num_classes=5, feature_scale=1.0,
                 max_root_steps=1).map()  # the MAP is solved when first asked for
    assert ConjugatePosterior(ConjugatePrior(), stats, max_root_steps=1).to("cpu") \
        .max_root_steps == 1
    for bad in (0, 2.5, True):
        with pytest.raises(InvalidInputError, match="max_steps must be an integer >= 1"):
            solve_map(S, N, max_steps=bad)
