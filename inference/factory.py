"""``fit_head(kind, ...)``: one string swaps the inference method.

Calling convention:

* heads on fixed features — ``"conjugate"``, ``"laplace"``, ``"mfvi"``, ``"sgld"`` —
  take ``fit_head(kind, features, labels, num_classes, **options)`` with ``features (N, m)``
  from a fixed body, integer ``labels (N,)`` in ``[0, num_classes)``; their posteriors'
  ``predict_proba`` take features ``(B, m)``.
* the network posterior ``"subnet_laplace"`` takes ``fit_head(kind, model, loader, **options)``
  with ``model`` returning ``(B, C)`` logits at its MAP and ``loader`` yielding ``(X, y)``;
  its ``predict_proba`` takes network inputs.

``options`` go to the method's fitting function (see each for its documented options):

=================  ==================================================  ======================
kind               fitting function                                    returns
=================  ==================================================  ======================
conjugate          ``inference.conjugate``: ``ConjugatePosterior(       ConjugatePosterior
                   prior, SufficientStatistics.from_features(...))``;
                   options: ``prior=ConjugatePrior(...)`` or its
                   fields (``chi``, ``nu``), and ``solver``
laplace            :func:`inference.laplace_head.fit_laplace_head`     GaussianPosterior
mfvi               :func:`inference.mfvi.fit_mfvi_head`                GaussianPosterior (diag)
sgld               :func:`inference.sgld.fit_sgld_head`                EnsemblePosterior
subnet_laplace     :func:`inference.subnet.fit_subnet_laplace`;        SubnetLaplacePosterior
                   ``subnet_size=`` is an alias of ``subnet=``
=================  ==================================================  ======================

Modules are imported when their kind is asked for, so ``fit_head("laplace", ...)`` does not
import pyro.
"""

from __future__ import annotations

import importlib
from typing import Any

from inference.errors import InvalidInputError
from inference.options import HeadKind
from inference.posterior import Posterior

FEATURE_HEAD_KINDS = (HeadKind.CONJUGATE, HeadKind.LAPLACE, HeadKind.MFVI, HeadKind.SGLD)


def _fit_conjugate(features, labels, num_classes, **options) -> Posterior:
    """FedLog's conjugate head: ``prior=`` or the prior's fields, and ``solver=``."""
    from inference.conjugate import ConjugatePosterior, ConjugatePrior, SufficientStatistics

    solver = options.pop("solver", "exact")
    prior = options.pop("prior", None)
    if prior is None:
        prior = ConjugatePrior(**options)
    elif options:
        raise InvalidInputError(f"pass either prior= or its fields, not both: {sorted(options)}.")
    stats = SufficientStatistics.from_features(features, labels, num_classes)
    return ConjugatePosterior(prior, stats, solver=solver)


def _feature_head_fitter(module: str, function: str):
    """A fitter that imports ``module`` only when called and forwards to ``function``."""

    def fit(features, labels, num_classes, **options) -> Posterior:
        return getattr(importlib.import_module(module), function)(
            features, labels, num_classes, **options
        )

    return fit


def _fit_subnet_laplace(model, loader, **options) -> Posterior:
    """FedSI's subnet Laplace; ``subnet_size=`` is accepted as an alias of ``subnet=``."""
    from inference.subnet import fit_subnet_laplace

    if "subnet_size" in options:
        if "subnet" in options:
            raise InvalidInputError("pass subnet= or subnet_size=, not both.")
        options["subnet"] = options.pop("subnet_size")
    if "subnet" not in options:
        raise InvalidInputError("subnet_laplace needs subnet= (indices) or subnet_size= (count).")
    return fit_subnet_laplace(model, loader, **options)


_FITTERS = {
    HeadKind.CONJUGATE: _fit_conjugate,
    HeadKind.LAPLACE: _feature_head_fitter("inference.laplace_head", "fit_laplace_head"),
    HeadKind.MFVI: _feature_head_fitter("inference.mfvi", "fit_mfvi_head"),
    HeadKind.SGLD: _feature_head_fitter("inference.sgld", "fit_sgld_head"),
    HeadKind.SUBNET_LAPLACE: _fit_subnet_laplace,
}


def fit_head(kind: HeadKind | str, *args: Any, **options: Any) -> Posterior:
    """Fit the posterior named by ``kind`` (see the module docstring for the arguments).

    Examples::

        post = fit_head("laplace", phi, y, num_classes=10, prior_precision=1.0)
        post = fit_head("mfvi", phi, y, num_classes=10, num_steps=2000)
        post = fit_head("subnet_laplace", model, loader, subnet_size=800)
        probs = post.predict_proba(phi_test)        # (B, C) for every kind

    Raises:
        InvalidInputError: unknown ``kind``, wrong positional arguments, or bad option values.
        TypeError: an option the kind's fitting function does not take.
    """
    kind = HeadKind.parse(kind, "kind")
    expected = 3 if kind in FEATURE_HEAD_KINDS else 2
    if "num_classes" in options and kind in FEATURE_HEAD_KINDS and len(args) == 2:
        args = (*args, options.pop("num_classes"))
    if len(args) != expected:
        signature = ("(features, labels, num_classes, **options)" if expected == 3
                     else "(model, loader, **options)")
        raise InvalidInputError(
            f"fit_head({kind.value!r}, ...) takes {signature}; got {len(args)} positional "
            "arguments."
        )
    return _FITTERS[kind](*args, **options)
