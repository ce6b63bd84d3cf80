"""The factor memo (`inference.gaussian.factor_memo`, issue 41): a fitted head's posterior
rebuilt from its own ``state_dict()`` takes the factor and inverse the fit computed, and
predicts bit for bit as it would have by factorising; any other tensors (copies, modified,
freed, over the budget) get no factor."""

from __future__ import annotations

import gc

import pytest
import torch

from inference.gaussian import GaussianPosterior, factor_memo
from inference.gaussian import full as full_precision
from inference.laplace_head import fit_laplace_head
from tests.inference.test_newton_cg import relu_data


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch):
    """Each test with a memo of its own: entries other tests left (freed whenever a garbage
    collection finds their states) would change its byte counts."""
    monkeypatch.setattr(factor_memo, "_ENTRIES", type(factor_memo._ENTRIES)())
    monkeypatch.setattr(factor_memo, "_FREED", [])


@pytest.fixture
def factorisations(monkeypatch):
    """The dense factorisations the posteriors run, counted."""
    calls = []
    plain = full_precision.cholesky_with_jitter
    monkeypatch.setattr(full_precision, "cholesky_with_jitter",
                        lambda *args, **kwargs: calls.append(1) or plain(*args, **kwargs))
    return calls


@pytest.fixture
def fitted():
    x, y = relu_data(rows=80, seed=0)
    return fit_laplace_head(x, y, 4)


@pytest.fixture
def test_x():
    return relu_data(rows=30, seed=7)[0]


def factored_from_scratch(state):
    """The posterior of ``state``'s values (copies: never in the memo)."""
    copies = {k: v.clone() for k, v in state.items()}
    return GaussianPosterior.from_state_dict(copies)


def test_a_posterior_rebuilt_from_its_own_state_factorises_nothing_and_predicts_the_same(
        fitted, test_x, factorisations):
    state = fitted.state_dict()
    rebuilt = GaussianPosterior.from_state_dict(state)
    probs = rebuilt.predict_proba(test_x)
    mean = rebuilt.flat_mean
    assert factorisations == []  # the fit's factor and inverse
    scratch = factored_from_scratch(state)
    # bit for bit: the total precision is the same sum of the same numbers
    assert torch.equal(probs, scratch.predict_proba(test_x))
    assert torch.equal(mean, scratch.flat_mean)
    assert factorisations == [1]  # the copies' posterior factorised its own


def test_tensors_modified_in_place_get_no_factor(fitted, test_x, factorisations):
    state = fitted.state_dict()
    state["likelihood.dense"].diagonal().add_(1.0)  # another precision now
    rebuilt = GaussianPosterior.from_state_dict(state)
    probs = rebuilt.predict_proba(test_x)
    assert factorisations == [1]
    assert torch.equal(probs, factored_from_scratch(state).predict_proba(test_x))


def test_copies_of_the_tensors_get_no_factor(fitted, factorisations):
    state = fitted.state_dict()
    factored_from_scratch(state).flat_mean  # noqa: B018 (a property that solves)
    assert factorisations == [1]


def test_an_entry_goes_when_its_tensors_are_freed():
    x, y = relu_data(rows=80, seed=0)
    fitted = fit_laplace_head(x, y, 4)
    state = fitted.state_dict()
    entry = fitted.natural.precision.cholesky().nbytes * 2  # factor and inverse
    assert factor_memo.held_bytes() == entry
    del fitted, state
    gc.collect()
    assert factor_memo.held_bytes() == 0


def test_the_memo_keeps_at_most_its_budget_least_recently_used_first(monkeypatch):
    x, y = relu_data(rows=60, classes=3, seed=1)
    posteriors = [fit_laplace_head(x[:, :k], y, 3) for k in (4, 5, 6)]
    sizes = [p.natural.precision.cholesky().nbytes * 2 for p in posteriors]
    monkeypatch.setattr(factor_memo, "BUDGET_BYTES", sizes[0] + sizes[1] + sizes[2] - 1)
    states = [p.state_dict() for p in posteriors[:2]]
    GaussianPosterior.from_state_dict(states[0])  # the first is used again: the second is older
    states.append(posteriors[2].state_dict())
    assert factor_memo.held_bytes() == sizes[0] + sizes[2]
    assert factor_memo.recall([states[1][k] for k in sorted(states[1])
                               if k.startswith(("prior.", "likelihood."))]) is None


def test_a_factor_larger_than_the_budget_is_not_kept(fitted, monkeypatch):
    monkeypatch.setattr(factor_memo, "BUDGET_BYTES", 100)
    fitted.state_dict()
    assert factor_memo.held_bytes() == 0


def test_inference_mode_tensors_are_not_remembered(fitted, test_x, factorisations):
    """They have no version counter, so a change in place could not be seen: their posterior
    factorises as usual, and its state dict is taken without error."""
    with torch.inference_mode():
        state = {k: v.clone() for k, v in fitted.state_dict().items()}
        posterior = GaussianPosterior.from_state_dict(state)
        probs = posterior.predict_proba(test_x)
        before = factor_memo.held_bytes()  # the fitted posterior's own entry
        rebuilt = GaussianPosterior.from_state_dict(posterior.state_dict())
        assert factor_memo.held_bytes() == before
        assert torch.equal(rebuilt.predict_proba(test_x), probs)
    assert factorisations == [1, 1]


def test_a_freed_tensors_callback_only_notes_its_entry_and_the_next_call_removes_it(
        ):
    """The weak-reference callback may run in another thread or inside a garbage collection
    that interrupts the memo's own loop over its entries, so it never changes them itself."""
    x, y = relu_data(rows=80, seed=0)
    fitted = fit_laplace_head(x, y, 4)
    state = fitted.state_dict()
    del fitted, state
    gc.collect()
    assert len(factor_memo._ENTRIES) == 1 and factor_memo._FREED  # noted, not removed
    assert factor_memo.held_bytes() == 0  # the next call removes it
    assert not factor_memo._ENTRIES and not factor_memo._FREED
