"""The conjugate head on fixed features, with its feature scale chosen from the data.

FedLog's model (spec §1.2) says the body's features are, within each class, Gaussian with
standard deviation ``1/√2`` in every direction. A FedLog body is trained against the head and
learns features on that scale; a body trained for anything else (a network's own last hidden
layer, say) does not, and the conjugate MAP on its features is overconfident: on the digits
MLP of issue 12 the mean confidence is 1.000 and the NLL ten times the network's.

`fit_conjugate_head` therefore fits the model to ``s · phi`` (see
`ConjugatePosterior`'s ``feature_scale``) with ``s`` chosen by the
likelihood of the labels given the features, ``Σ_i log p(y_i | s phi_i, W*(s))``, with
``W*(s)`` the conjugate MAP of the scaled statistics, maximised over ``log s`` (grid of one
point a decade, then bounded Brent; `inference.hyperparameters`):

* ``"conditional"`` (default): on the training set itself. One scalar is fitted to ``N``
  labels, so it does not overfit; but when the body was trained on the same examples their
  features separate the classes better than new examples' do, and the choice leans towards
  overconfidence (measured in ``bench/heads_calibration.py``).
* ``"validation"``: on held-out ``validation_data`` — unbiased, needs data the head did not
  see (and that the body did not train on).
* ``"evidence"``: the model's own evidence instead (`inference.conjugate.evidence`, see
  below): computable from sums, which is what a federation has.

Why not the model's own evidence: the joint (generative) likelihood of the features fixes
``s`` so that the isotropic within-class variance matches the features' (``s ≈ 0.7`` on the
digits MLP), but it counts every one of the ``m`` correlated feature coordinates as
independent evidence about the class, and the conditional it implies is as overconfident as
before (test NLL about 0.6 against the network's 0.086). The label likelihood is the
criterion the predictive is judged by. The prior's pseudo-count ``nu`` only enters as
``N = nu + n`` and moves nothing for ``nu << n``; it is left to the caller.

Federated use: the server sees only summed statistics, from which it can apply a given ``s``
but cannot evaluate the label likelihood; FedLog (``bayesfl.strategies.fedlog.fedlog``) keeps
``s = 1``, which is what its bodies are trained against, unless ``feature_scale="evidence"``:
the model's own evidence (`inference.conjugate.evidence`), which needs the summed
statistics and one more summed number, ``sum_i ||phi_i||^2``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from inference.conjugate.evidence import evidence_feature_scale
from inference.conjugate.posterior import ConjugatePosterior, Solver
from inference.conjugate.prior import ConjugatePrior
from inference.conjugate.solver import DEFAULT_MAX_ROOT_STEPS
from inference.conjugate.statistics import SufficientStatistics
from inference.errors import InvalidInputError
from inference.hyperparameters import (
    DEFAULT_BOUNDS,
    Criterion,
    search_log_space,
)
from inference.options import FeatureScaleMethod


def fit_conjugate_head(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior: ConjugatePrior | None = None,
    solver: Solver = "exact",
    feature_scale: float | FeatureScaleMethod | str = FeatureScaleMethod.CONDITIONAL,
    feature_scale_bounds: tuple[float, float] = DEFAULT_BOUNDS,
    validation_data: tuple[Any, Any] | None = None,
    max_root_steps: int = DEFAULT_MAX_ROOT_STEPS,
) -> ConjugatePosterior:
    """The conjugate posterior of a head on fixed features, its feature scale chosen or given.

    Args:
        features: ``(N, m)`` body features (float, any device); labels: ``(N,)`` in
            ``[0, num_classes)``; num_classes: ``C``.
        prior: hyperparameters (default ``ConjugatePrior()``: chi = 0, nu = 1).
        solver: ``"exact"`` or ``"adam"`` (see `ConjugatePosterior`).
        feature_scale: ``s > 0``, or ``"conditional"`` / ``"validation"`` / ``"evidence"``
            (module docstring).
        feature_scale_bounds: ``(lower, upper)`` search interval of ``s``.
        validation_data: ``(features (V, m), labels (V,))`` for ``"validation"``.
        max_root_steps: the exact solver's step limit (`ConjugatePosterior`).

    Returns:
        The `ConjugatePosterior`; its ``feature_scale_selection`` records the choice
        (``None`` for a given number).

    Raises:
        InvalidInputError: bad data or options. A ``UserWarning`` says when the training labels
        favour the largest scale searched (the head separates them: the conditional choice is
        then unbounded; pass validation data).
    """
    statistics = SufficientStatistics.from_features(features, labels, num_classes)
    prior = ConjugatePrior() if prior is None else prior
    if not isinstance(feature_scale, str):
        return ConjugatePosterior(prior, statistics, solver=solver, feature_scale=feature_scale,
                                  max_root_steps=max_root_steps)
    method = FeatureScaleMethod.parse(feature_scale, "feature_scale")
    if method is FeatureScaleMethod.EVIDENCE:
        square_sum = float(features.to(torch.float64).pow(2).sum())
        choice = evidence_feature_scale(statistics, square_sum, prior=prior,
                                        bounds=feature_scale_bounds)
        posterior = ConjugatePosterior(prior, statistics, solver=solver,
                                       feature_scale=choice.value, max_root_steps=max_root_steps)
        posterior.feature_scale_selection = choice
        return posterior
    if method is FeatureScaleMethod.CONDITIONAL:
        data = (features, labels)
    else:
        data = _validation_tensors(validation_data, statistics, num_classes)
    criterion = Criterion(_label_nll(statistics, prior, solver, *data,
                                     max_root_steps=max_root_steps), _CRITERION_NAMES[method],
                          method.value, maximise=False)
    choice = search_log_space(criterion, "feature_scale", feature_scale_bounds)
    # The largest scale searched as good as the choice (NLL falling to its end, or to 0 in
    # float64): the head separates the training labels and their likelihood wants s -> inf.
    if method is FeatureScaleMethod.CONDITIONAL and choice.grid[-1][1] <= choice.criterion:
        warnings.warn(
            f"the training labels' likelihood is as high at the largest feature scale searched "
            f"({choice.bounds[1]:g}) as at the chosen {choice.value:g}: the head separates the "
            "training set, so the conditional choice is unbounded and overconfident; pass "
            "feature_scale='validation' with validation_data, or a number.", UserWarning,
            stacklevel=2)
    posterior = ConjugatePosterior(prior, statistics, solver=solver, feature_scale=choice.value,
                                   max_root_steps=max_root_steps)
    posterior.feature_scale_selection = choice
    return posterior


_CRITERION_NAMES = {FeatureScaleMethod.CONDITIONAL: "training_nll",
                    FeatureScaleMethod.VALIDATION: "validation_nll"}


def _label_nll(statistics: SufficientStatistics, prior: ConjugatePrior, solver: Solver,
               features: Tensor, labels: Tensor, *, max_root_steps: int = DEFAULT_MAX_ROOT_STEPS):
    """``s -> mean −log p(y | s phi, W*(s))`` (nats) over ``features``, ``labels``."""
    inputs = torch.cat([torch.ones_like(features[:, :1]), features], dim=1).to(
        device=statistics.device, dtype=torch.float64)
    labels = labels.to(statistics.device)

    def nll(scale: float) -> float:
        head = ConjugatePosterior(prior, statistics, solver=solver, feature_scale=scale,
                                  max_root_steps=max_root_steps).map()
        return float(torch.nn.functional.cross_entropy(inputs @ head.T, labels))

    return nll


def _validation_tensors(validation_data: Any, statistics: SufficientStatistics,
                        num_classes: int) -> tuple[Tensor, Tensor]:
    """``validation_data`` as float features ``(V, m)`` and int64 labels ``(V,)``."""
    from inference.inputs import as_features, as_labels

    if validation_data is None:
        raise InvalidInputError(
            "feature_scale='validation' needs validation_data=(features, labels) held out from "
            "training; or use feature_scale='conditional' (training data only).")
    try:
        val_features, val_labels = validation_data
    except (TypeError, ValueError):
        raise InvalidInputError(
            "validation_data must be a pair (features (V, m), labels (V,)).") from None
    val_features = as_features(val_features, statistics.feature_dim, "validation features")
    val_labels = as_labels(val_labels, val_features.shape[0], num_classes,
                           device=val_features.device, name="validation labels")
    if val_features.shape[0] == 0:
        raise InvalidInputError("validation_data is empty (0 rows of features).")
    return val_features, val_labels
