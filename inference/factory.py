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
conjugate          `inference.conjugate.feature_scale.            ConjugatePosterior
                   fit_conjugate_head`; options: ``prior=ConjugatePrior(
                   ...)`` or its fields (``chi``, ``nu``), ``solver``,
                   ``feature_scale`` (default ``"conditional"``),
                   ``feature_scale_bounds``, ``validation_data``,
                   ``max_root_steps``
laplace            `inference.laplace_head.fit_laplace_head`     GaussianPosterior
mfvi               `inference.mfvi.fit_mfvi_head`                GaussianPosterior (diag)
sgld               `inference.sgld.fit_sgld_head`                EnsemblePosterior
subnet_laplace     `inference.subnet.fit_subnet_laplace`;        SubnetLaplacePosterior
                   ``subnet_size=`` is an alias of ``subnet=``
=================  ==================================================  ======================

Inputs: features and labels may be torch tensors, NumPy arrays or nested lists
(`inference.inputs` has the dtype policy: float32 / float64 kept, narrower floats and
integers widened to float32, labels made int64 beside the features). Options are checked before
the fitting function runs: an unknown name raises `UnknownOptionError`
listing the valid ones, and a numeric option that is NaN, infinite, a bool, a string or out of
range raises [`InvalidInputError`][inference.errors.InvalidInputError] saying what it must be
(`inference.options.NUMERIC_OPTIONS`).

Modules are imported when their kind is asked for, so ``fit_head("laplace", ...)`` does not
import pyro.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from inference.errors import InvalidInputError, UnknownOptionError
from inference.inputs import as_features, as_labels, as_num_classes, as_targets
from inference.options import NUMERIC_OPTIONS, HeadKind, Likelihood, NumberRule, Option
from inference.posterior import Posterior
from inference.threads import MAX_THREADS, default_threads, torch_threads

FEATURE_HEAD_KINDS = (HeadKind.CONJUGATE, HeadKind.LAPLACE, HeadKind.MFVI, HeadKind.SGLD)
THREADS = NumberRule(integer=True, low=1, high=MAX_THREADS)


def _fit_conjugate(
    features: Tensor,
    labels: Tensor,
    num_classes: int,
    *,
    prior: Any = None,
    chi: float | Tensor | None = None,
    nu: float | None = None,
    solver: str = "exact",
    feature_scale: float | str = "conditional",
    feature_scale_bounds: tuple[float, float] = (1e-4, 1e4),
    validation_data: tuple[Any, Any] | None = None,
    max_root_steps: int | None = None,
) -> Posterior:
    """FedLog's conjugate head: ``prior=ConjugatePrior(...)`` or its fields (``chi``, ``nu``),
    ``solver=``, ``max_root_steps=`` (the exact solver's step limit, default 500), and the
    feature scale (`inference.conjugate.feature_scale.fit_conjugate_head`: chosen by the
    training labels' likelihood unless given)."""
    from inference.conjugate import ConjugatePrior
    from inference.conjugate.feature_scale import fit_conjugate_head

    fields = {k: v for k, v in (("chi", chi), ("nu", nu)) if v is not None}
    if prior is None:
        prior = ConjugatePrior(**fields)
    elif fields:
        raise InvalidInputError(f"pass either prior= or its fields, not both: {sorted(fields)}.")
    return fit_conjugate_head(features, labels, num_classes, prior=prior, solver=solver,
                              feature_scale=feature_scale,
                              feature_scale_bounds=feature_scale_bounds,
                              validation_data=validation_data,
                              **({} if max_root_steps is None else
                                 {"max_root_steps": max_root_steps}))


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


#: The fitting function of each kind: a function here, or (module, name) imported when asked.
_FITTERS: dict[HeadKind, Callable[..., Posterior] | tuple[str, str]] = {
    HeadKind.CONJUGATE: _fit_conjugate,
    HeadKind.LAPLACE: ("inference.laplace_head", "fit_laplace_head"),
    HeadKind.MFVI: ("inference.mfvi", "fit_mfvi_head"),
    HeadKind.SGLD: ("inference.sgld", "fit_sgld_head"),
    HeadKind.SUBNET_LAPLACE: _fit_subnet_laplace,
}


def fitting_function(kind: HeadKind | str) -> Callable[..., Posterior]:
    """The function `fit_head` calls for ``kind`` (its module is imported now)."""
    fitter = _FITTERS[HeadKind.parse(kind, "kind")]
    if isinstance(fitter, tuple):
        module, name = fitter
        fitter = getattr(importlib.import_module(module), name)
    return fitter


def _declared_by(kind: HeadKind, function: Callable[..., Posterior]) -> Callable[..., Any]:
    """The function whose signature declares ``kind``'s options (subnet Laplace: the fitting
    function behind the alias-resolving wrapper)."""
    if kind is HeadKind.SUBNET_LAPLACE:
        from inference.subnet import fit_subnet_laplace

        return fit_subnet_laplace
    return function


def option_names(function: Callable[..., Any]) -> list[str] | None:
    """The keyword options ``function`` takes after its data arguments, or None if it takes
    any (``**options``)."""
    parameters = list(inspect.signature(function).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    data = 2 if parameters and parameters[0].name == "model" else 3
    return [p.name for p in parameters[data:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def checked_options(kind: HeadKind, function: Callable[..., Any],
                    options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every numeric one checked (and made a Python number) against
    `NUMERIC_OPTIONS`.

    A value passes unchecked where the fitting function's signature declares that kind of
    value for the option: ``None`` (``batch_size=None``), a string (an option that also takes
    a method name), or a tensor (``chi=``, a per-entry prior precision).

    Raises:
        UnknownOptionError: an option ``function`` does not take (the message lists them).
        InvalidInputError: a numeric option that is NaN, infinite, a bool, of a wrong type or
            out of range.
    """
    names = option_names(function)
    aliases = {"subnet_size"} if kind is HeadKind.SUBNET_LAPLACE else set()
    if names is not None:
        unknown = sorted(set(options) - set(names) - aliases)
        if unknown:
            raise UnknownOptionError(
                f"fit_head({kind.value!r}) takes no option {', '.join(map(repr, unknown))}; its "
                f"options are: {', '.join(names)}."
            )
    parameters = inspect.signature(function).parameters
    checked = dict(options)
    for name, value in options.items():
        rule = NUMERIC_OPTIONS.get(name)
        if rule is not None and not _declared_non_number(parameters.get(name), value):
            checked[name] = rule.parse(value, name)
    return checked


def _declared_non_number(parameter: inspect.Parameter | None, value: Any) -> bool:
    """Whether ``parameter``'s signature lets ``value`` (None, a string, a tensor) through."""
    if parameter is None:
        return False
    # Annotations are strings under `from __future__ import annotations`, else types.
    annotation = str(parameter.annotation)
    if value is None:
        return parameter.default is None or re.search(r"\bNone\b", annotation) is not None
    if isinstance(value, str):  # a plain str, a Literal, or one of inference.options' enums
        names = ["str", "Literal", *(cls.__name__ for cls in _option_classes())]
        return re.search(rf"\b({'|'.join(names)})\b", annotation) is not None
    if isinstance(value, Tensor):
        return re.search(r"\bTensor\b", annotation) is not None
    return False


def _option_classes(base: type = Option) -> list[type]:
    """Every subclass of `Option` (string-valued option enums)."""
    return [sub for cls in base.__subclasses__() for sub in (cls, *_option_classes(cls))]


def _feature_head_data(
    features: Any, labels: Any, num_classes: Any, likelihood: Any
) -> tuple[Tensor, Tensor, int]:
    """Features ``(N, m)``, labels ``(N,)`` (or regression targets) and ``C`` as the fitting
    functions take them, from tensors, NumPy arrays or lists (`inference.inputs`)."""
    gaussian = Likelihood.parse(likelihood, "likelihood") is Likelihood.GAUSSIAN
    num_classes = as_num_classes(num_classes)
    features = as_features(features)
    if features.shape[0] == 0:
        raise InvalidInputError("the training set is empty (0 rows of features).")
    if gaussian:
        targets = as_targets(labels, features.shape[0], device=features.device)
    else:
        targets = as_labels(labels, features.shape[0], num_classes, device=features.device)
    return features, targets, num_classes


def fit_head(kind: HeadKind | str, *args: Any, **options: Any) -> Posterior:
    """Fit the posterior named by ``kind`` (see the module docstring for the arguments).

    Examples::

        post = fit_head("laplace", phi, y, num_classes=10, prior_precision=1.0)
        post = fit_head("mfvi", phi, y, num_classes=10, num_steps=2000)
        post = fit_head("subnet_laplace", model, loader, subnet_size=800)
        probs = post.predict_proba(phi_test)        # (B, C) for every kind

    ``phi`` and ``y`` may be NumPy arrays (``y`` of any integer dtype). ``threads`` (option)
    sets torch's intra-op threads for the fit, restored afterwards; default
    `inference.threads.default_threads` (half the cores, 1 to 4: heads are small, and on a
    busy 2-core machine torch's default made an MFVI fit 8x slower than one thread).

    Raises:
        InvalidInputError: unknown ``kind``, wrong positional arguments, bad features or
            labels (shape, dtype, NaN, a label out of range), or bad option values.
        UnknownOptionError: an option the kind's fitting function does not take (also a
            ``TypeError``).
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
    threads = options.pop("threads", None)
    threads = default_threads() if threads is None else int(THREADS.parse(threads, "threads"))
    function = fitting_function(kind)
    options = checked_options(kind, _declared_by(kind, function), options)
    if kind in FEATURE_HEAD_KINDS:
        args = _feature_head_data(*args, options.get("likelihood", Likelihood.SOFTMAX))
    with torch_threads(threads):
        return function(*args, **options)
