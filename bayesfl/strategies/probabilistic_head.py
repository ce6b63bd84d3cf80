"""A probabilistic head on any federated body (``head=KIND``): last-layer Laplace, made federated.

After federated training (and for a novel client that never trained) a client of a strategy
that takes this option freezes the network it would predict with, computes its body's features
on its own training split and fits ``inference.fit_head(KIND, features, labels, C,
**head_options)`` on them. From then on it predicts with that posterior's predictive
(`PREDICTIVE`) and reports its network's softmax, the
strategy's plug-in, beside it (`MAP_PLUGIN`): with the same seed,
a run with ``head=KIND`` trains exactly as one without, so its ``map_plugin`` figures are the
plain strategy's. Rounds before personalisation have no head posterior: both keys hold the
plug-in.

=============  ========================================  ==========================  ===========
``head``       posterior (``inference.fit_head``)        predictive method           prior mean
=============  ========================================  ==========================  ===========
``laplace``    KL-optimal Gaussian from the Laplace one  ``centred_probit``          0 or the
               (full precision, λ by evidence)                                       global head
``conjugate``  FedLog's conjugate head                   ``probit``                  (its prior)
``mfvi``       mean-field Gaussian (pyro SVI)            ``centred_probit``          0
``sgld``       SGLD ensemble                             ``mc``                      0
=============  ========================================  ==========================  ===========

**Prior.** The Laplace head's prior is centred at zero (``head_prior="zero"``, the default) and
its precision chosen by the client's own evidence (``prior_precision="marglik"``). Where the
strategy has a global head (one every client shares: the averaged head of FedAvg(-FT) and
LG-FedAvg, FedBABU's never-trained initial head) ``head_prior="global"`` centres the prior on it
instead, letting the evidence decide how far the client's head may move from the federation's; a
personal head (FedPer, FedRep) has no global counterpart and is always zero-centred. Zero is the
default by measurement on S1 (below): with the global prior FedAvg-FT's head is about as
calibrated as its plug-in, with the zero-centred one far better (the generated S1 tables of the
docs' results page: the ``head_prior=global`` rows of the full S1 table, the FedAvg-FT +
head=laplace rows of the shift table); LG-FedAvg's seed-0 figures for both priors are in commit
``09e60cb``'s message (issue 25; not stored). The global prior changes little against the
plug-in (presumably the evidence keeps the head near the global one, as sharp as the
network's). The client's trained (or fine-tuned) head is not reused, neither as the mode nor as
the prior mean: ``fit_head`` refits the mode on the same features under the prior, so the
predictive is exactly ``fit_head``'s. (Centring the prior on FedPer's own trained head
double-counts the client's data: on S1, seed 0, the evidence chose the largest precision of its
range for every client measured, so the posterior collapsed onto the trained head: the
plug-in; measured at ``24761ae``, in its message, and ``214e1c1``, issue 25, not stored.)
The other kinds' fitters take only a number as the prior mean: they keep their own priors.

**Settings.** ``head_options`` go to ``fit_head`` unchanged (e.g. ``{"structure": "lowrank",
"rank": 50}`` for a head too large for a full precision, ``{"prior_precision": 1.0}``), checked
when the strategy is built. The Laplace default is ``structure="full"``: ``"diag"``'s
KL-optimal solver fails with a NumericalError on many plain inputs (issue 26).

**Measured** (S1, the FedSI paper's MNIST small regime: ``mnist-5k``, 10 clients x 5 labels x
50 training images, ``mlp`` body, features of width 100, 5 local epochs of Adam at 1e-3, batch
50, 30 rounds; FedPer with ``local_layers=1``; one thread). FedPer with ``head=laplace``
against its plug-in (plain FedPer), seeds 0-2: the "FedPer, `head=laplace`" rows of the full S1
table on the docs' results page (generated from ``bench/results/s1_30_h200.jsonl``) and of its
shift table (``bench/results/s1_shift.jsonl``). The ``head=conjugate`` figures typed here before
(commit ``b5749be``, issue 25) are not stored; ``bench/heads_calibration.py`` compares every
kind on digits (the heads table of the docs' inference page).

What the Laplace head (d = 10 x 101 = 1010, full precision) costs a client —
its evidence search and the KL-optimal Gaussian — is measured by ``bench/s1_cost.py`` (whole
S1 runs against FedPer's) and ``bench/laplace_head_speed.py`` (one fit against
laplace-torch's), tabled in the docs' results page; the conjugate head costs a fraction of
that.

**Failures.** A fit that fails for one client (an `inference.errors.InferenceError`: no
convergence, degenerate features; a failed factorisation) does not stop the run: that client
predicts with its plug-in, says why in a `HeadFitWarning`, and keeps the reason in its
state (`fallback_reason`). The KL-optimal Gaussian's solver is the usual cause: narrow
features make it likelier (on digits it failed for some clients at width 8 and for none at
width 16; measured at ``b5749be``, issue 25, not stored).

**State.** The head posterior is tensors in the client state (its ``state_dict()`` under
``head_posterior.``): a personalised state round-trips through safetensors (checkpoints, a
Flower ClientApp's ``Context.state``) and is rebuilt by the kind's posterior class.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import BayesFLWarning, ConfigError
from bayesfl.strategies.base import MAP_PLUGIN, PREDICTIVE, ClientState
from bayesfl.strategies.networks import batched_apply
from inference.errors import InferenceError
from inference.posterior import Posterior, posterior_class

HEAD_KINDS = ("laplace", "conjugate", "mfvi", "sgld")
"""The ``head`` option's values: the ``inference.fit_head`` kinds fitted on fixed features."""
HEAD_PRIORS = ("global", "zero")
PREDICTIVE_METHODS = {"laplace": "centred_probit", "conjugate": "probit",
                      "mfvi": "centred_probit", "sgld": "mc"}
"""The posterior predictive each kind reports (the conjugate head's own default is its MAP
plug-in, hence ``probit``)."""
POSTERIOR_KINDS = {"laplace": "gaussian", "conjugate": "conjugate", "mfvi": "gaussian",
                   "sgld": "ensemble"}
"""The registered posterior class (`inference.posterior.posterior_class`) of each kind."""
GLOBAL_PRIOR_KINDS = frozenset({"laplace"})
"""Kinds whose fitter takes a tensor prior mean (the global head)."""
RESERVED_OPTIONS = frozenset({"prior_mean", "threads"})

HEAD_PREFIX = "head_posterior."
"""Client-state prefix of the head posterior's ``state_dict()``."""
FALLBACK = "head_fallback.reason"
"""Client-state key of a client whose fit failed: the reason, UTF-8 bytes as uint8."""


class HeadFitWarning(BayesFLWarning):
    """A client's head posterior could not be fitted; it predicts with its plug-in (the message
    says which client and why)."""


@dataclass(frozen=True)
class ProbabilisticHead:
    """The ``head``, ``head_prior`` and ``head_options`` of a strategy, validated.

    Attributes:
        kind: one of `HEAD_KINDS`.
        prior: ``"zero"`` (a zero-centred Laplace prior) or ``"global"`` (centred on the
            global head where there is one).
        options: keyword options of ``inference.fit_head`` (checked).
    """

    kind: str
    prior: str = "zero"
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return PREDICTIVE_METHODS[self.kind]

    def fit(self, features: Tensor, labels: Tensor, num_classes: int,
            prior_mean: Tensor | None = None) -> Posterior:
        """``inference.fit_head(kind, features, labels, num_classes, **options)``, with
        ``prior_mean`` (a ``(C, m + 1)`` head, bias column first) where the kind takes one and
        ``head_prior="global"``; torch's current thread count."""
        from inference import fit_head

        options = dict(self.options)
        if prior_mean is not None and self.prior == "global" and self.kind in GLOBAL_PRIOR_KINDS:
            options["prior_mean"] = prior_mean.to(torch.float64)
        return fit_head(self.kind, features, labels, num_classes,
                        threads=torch.get_num_threads(), **options)

    def predict(self, posterior: Posterior, features: Tensor) -> Tensor:
        """The posterior predictive (B, C) float64 of ``features`` (B, m)."""
        return posterior.predict_proba(features.to(torch.float64),
                                       method=self.method).to(torch.float64)


def head_from_options(strategy: str, head: object, prior: object = "zero",
                      options: object = None) -> ProbabilisticHead | None:
    """The validated head option of ``strategy`` (None: no probabilistic head).

    Raises:
        ConfigError: an unknown kind or prior, options that are not a table, an option
            ``fit_head(kind)`` does not take or a bad value (the inference layer's message).
    """
    if head is None:
        if options:
            raise ConfigError(f"{strategy} head_options need a head: set head to one of "
                              f"{HEAD_KINDS}")
        return None
    if head not in HEAD_KINDS:
        raise ConfigError(f"{strategy} head must be one of {HEAD_KINDS} (or None for the "
                          f"plain plug-in), got {head!r}")
    if prior not in HEAD_PRIORS:
        raise ConfigError(f"{strategy} head_prior must be one of {HEAD_PRIORS}, got {prior!r}")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{strategy} head_options must be a table of fit_head options, got "
                          f"{options!r}")
    reserved = sorted(RESERVED_OPTIONS & set(options))
    if reserved:
        raise ConfigError(f"{strategy} head_options may not set {reserved}: the prior mean is "
                          f"set by head_prior, the threads by the run")
    from inference.factory import checked_options, fitting_function
    from inference.options import HeadKind

    kind = HeadKind.parse(head, "head")
    try:
        checked = checked_options(kind, fitting_function(kind), dict(options))
    except InferenceError as err:
        raise ConfigError(f"{strategy} head_options: {err}") from None
    return ProbabilisticHead(str(head), str(prior), checked)


def head_features(model: nn.Module, x: Tensor) -> Tensor:
    """The features (B, m) float64 the head of ``model`` (a ClassifierNet) sees."""
    return batched_apply(model.body, x).to(torch.float64)


def head_parameters(model: nn.Module) -> Tensor:
    """The linear head of ``model`` as one (C, m + 1) float64 table, bias column first (the
    layout of [`inference`][inference]'s heads)."""
    head = model.head
    return torch.cat([head.bias.detach()[:, None], head.weight.detach()], 1).to(torch.float64)


def with_head_posterior(
    head: ProbabilisticHead,
    state: ClientState,
    model: nn.Module,
    data: ClientData,
    num_classes: int,
    client_id: int,
    prior_mean: Tensor | None = None,
) -> ClientState:
    """``state`` (the client's personalised network ``model``) plus the head posterior fitted
    on its training features; if the fit fails, plus the reason instead (and a
    `HeadFitWarning`)."""
    state = {k: v for k, v in state.items()
             if not k.startswith(HEAD_PREFIX) and k != FALLBACK}
    try:
        posterior = head.fit(head_features(model, data.train_x), data.train_y, num_classes,
                             prior_mean)
        tensors = posterior.state_dict()
    except (InferenceError, torch.linalg.LinAlgError) as err:
        reason = f"{type(err).__name__}: {err}"
        warnings.warn(f"client {client_id}: the {head.kind} head posterior could not be "
                      f"fitted ({reason}); it predicts with its plug-in", HeadFitWarning,
                      stacklevel=2)
        return {**state, FALLBACK: torch.tensor(list(reason.encode()), dtype=torch.uint8)}
    return {**state, **{HEAD_PREFIX + k: _owned(v) for k, v in tensors.items()}}


def _owned(tensor: Tensor) -> Tensor:
    """``tensor`` itself where the state can own it, else a detached copy.

    The posterior the fit returned is dropped after `with_head_posterior`, so its tensors can
    become the state's without a copy (a 1,010-parameter head's precision: 8 MB); and a Gaussian
    head's factor is remembered for these very tensor objects, so the posterior rebuilt from
    the state to predict does not factorise again (`inference.gaussian.factor_memo`, issue 41).
    A view of a larger buffer is copied (the state would keep the whole buffer alive), and a
    tensor that requires grad is detached."""
    if tensor.requires_grad or tensor.untyped_storage().nbytes() != tensor.nbytes:
        return tensor.detach().clone()
    return tensor


def head_posterior(head: ProbabilisticHead, state: ClientState) -> Posterior | None:
    """The head posterior kept in ``state``, or None (not personalised yet, or the fit
    failed)."""
    n = len(HEAD_PREFIX)
    tensors = {k[n:]: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
    if not tensors:
        return None
    return posterior_class(POSTERIOR_KINDS[head.kind]).from_state_dict(tensors)


def fallback_reason(state: ClientState) -> str | None:
    """Why the client's head posterior could not be fitted, or None."""
    reason = state.get(FALLBACK)
    return None if reason is None else bytes(reason.tolist()).decode()


class HeadPosterior:
    """The ``head=KIND`` of a strategy's client half (module docstring): fits the head
    posterior into a personalised client state, reads it back and predicts with it. It holds
    the validated option and the run's number of classes and input shape, never client state.

    Args:
        head: the validated option (`head_from_options`).
        num_classes: C.
        input_shape: the shape of one input (None: the body's own).
    """

    def __init__(self, head: ProbabilisticHead, num_classes: int,
                 input_shape: tuple[int, ...] | None = None) -> None:
        self.option, self.num_classes, self.input_shape = head, num_classes, input_shape

    @property
    def kind(self) -> str:
        return self.option.kind

    @property
    def method(self) -> str:
        return self.option.method

    def fit(self, personalized: ClientState, model: nn.Module, data: ClientData,
            client_id: int, prior_mean: Tensor | None = None) -> ClientState:
        """``personalized`` (the client's network ``model``) plus its head posterior
        (`with_head_posterior`), ``prior_mean`` a ``(C, m + 1)`` global head or None."""
        return with_head_posterior(self.option, personalized, model, data, self.num_classes,
                                   client_id, prior_mean)

    def posterior(self, state: ClientState) -> Posterior | None:
        """The head posterior in a personalised ``state``, or None."""
        return head_posterior(self.option, state)

    def body_posterior(self, client_id: int, state: ClientState,
                       model: Callable[[], nn.Module]) -> Any:
        """The client's head posterior behind the body of its network to predict with (built
        by ``model``): ``predict_proba`` takes inputs, ``sample`` draws heads (C, d + 1).

        Raises:
            ConfigError: ``state`` holds no head posterior (not personalised, or its fit
                failed: the reason is given).
        """
        from bayesfl.posterior import client_posterior

        posterior = self.posterior(state)
        if posterior is None:
            why = fallback_reason(state)
            raise ConfigError(f"client {client_id} has no {self.kind} head "
                              "posterior: " + ("its fit failed (" + why + ")" if why else
                                               "it is fitted when the client personalises"))
        return client_posterior(model().body, posterior, self.method,
                                input_shape=self.input_shape)

    def rows(self, state: ClientState, x: Tensor, plugin: Tensor,
             model: Callable[[], nn.Module]) -> dict[str, Tensor]:
        """A client's evaluation rows: its posterior predictive of ``x`` (B, ...) under
        `PREDICTIVE` and its ``plugin`` softmax (B, C) under `MAP_PLUGIN` (both the plug-in
        before personalisation or after a failed fit); ``model`` builds its network."""
        posterior = self.posterior(state)
        if posterior is None:  # not personalised yet, or its fit failed
            return {PREDICTIVE: plugin, MAP_PLUGIN: plugin}
        features = head_features(model(), x)
        return {PREDICTIVE: self.option.predict(posterior, features).cpu(), MAP_PLUGIN: plugin}
