r"""FedLog (Yu, Zhang & Poupart): a federated Bayesian logistic-regression head.

Paper: [FedLog: Personalized Federated Classification with Less Communication and More
Flexibility](https://arxiv.org/abs/2407.08337) (arXiv 2407.08337; the section names below are
its). Every client keeps its body private and trains it with cross-entropy through the
broadcast head $W$ (C, m), $m = d + 1$, bias column first, which it does not update (section
"FedLog", Eq. 10). It then uploads the sufficient statistic of its training features and its
sample count $n_c$ (sections "Model Construction" and "FedLog", Eq. 11):

$$S_c[y] = \sum_{i:\, y_i = y} [1, \phi(x_i)] \quad (C, m),$$

whose column 0 holds the class counts. The server sums the statistics, adds the conjugate
prior ($\chi = 0$, $\nu$) and sets $W$ to the posterior MAP (Eq. 12; exact solver of
`inference.conjugate`).

Round 0 (``init_round``) is the authors' code's "pretrain" round: clients send statistics of
their untrained bodies, so the first head is already a MAP (the paper's section "FedLog" starts
from a random head instead).

**Which statistics are summed** (``absent_clients``; the paper has every client take part in
every round, so it does not say). ``"latest"`` (default):
the server keeps every client's latest accepted statistics and sums them all, so a client not
sampled this round still counts with the statistics of its current body (its body changes only
when it trains, and then it uploads again). ``"omit"``: this round's participants only (the
paper's setting, where every client takes part every round). Measured on digits, 20 clients,
``--fraction 0.3``, 15 rounds: ``"omit"`` swings between rounds because the head is rebuilt
from 6 clients' classes; ``"latest"`` is stable (figures in the project's architecture notes).

**Prediction.** The federated posterior is the conjugate posterior of the summed statistics
(`inference.ConjugatePosterior`); clients evaluate with its posterior predictive and
report the MAP plug-in $\mathrm{softmax}(W [1, \phi])$ beside it. ``predictive="mc"``
(default) averages the softmax over ``mc_samples`` (256) draws of the posterior's Laplace
approximation, seeded from the run seed and the round (every client of a round sees the same draws);
``"probit"`` uses the Laplace logit moments through the probit approximation; ``"map"`` is the
plug-in. The default was chosen by measurement on digits (20 clients, ``shards:2``, ``mlp:200``,
30 rounds, seeds 0-4, final round; commit ``c1b40d9``, not stored): the MC predictive was the
best calibrated of the three, and probit was not reliably better than the plug-in (its
one-dimensional probit correction is only an approximation of the multi-class integral). On
digits the posterior is concentrated and the three agree closely (the generated FedLog checks
on the docs' results page: the posterior predictive's NLL against its plug-in's).

**Feature scale** (``feature_scale``). The model fixes the within-class standard deviation of
$[1, s\phi]$ at $1/\sqrt 2$ (`inference.ConjugatePosterior`); the paper has s = 1
(``feature_scale=1``, the default until issue 40); the default is ``"heldout"`` (below).
``"evidence"`` is federated type-II maximum likelihood: every round the server takes
the s that maximises the model's log evidence (`inference.conjugate.evidence`). The
evidence is a function of summed quantities, but not of the statistics alone: its s-dependence
has the term $-s^2 Q$, $Q = \sum_i \lVert\phi_i\rVert^2$, which the table does not determine.
So each upload carries ``square_sum`` (Q of the client's clamped training features, float64
(1,): 8 bytes more per upload), validated against the table (at least
$\sum_y \lVert S_y\rVert^2 / n_y$ by Cauchy-Schwarz, at most $n d B^2$) and cached like the
statistics for absent clients. The server keeps s in its state (reported as ``feature_scale`` in
every round's metrics), solves the head at s, and sends s with the evaluation broadcast. DP variants
keep s = 1 (Q would be a release outside the privacy budget); FedLog-C takes a fixed s only
(`FedLogC`). Measured (final round):

* digits, 10 clients, ``shards:2``, 8 rounds: the evidence puts s far above 1 at no accuracy
  cost, under any CPU rounding (what
  ``tests/bayesfl/strategies/fedlog/test_fedlog_feature_scale.py`` asserts); the NLL against
  s = 1 is not robust: at that s each misclassified test image is confidently wrong, and the
  sign of the difference turns on a few images and the rounding (figures in that test's
  comment).
* mnist-5k, 10 clients, ``labels:5:train=50``, ``mlp``, 5 epochs, 30 rounds (issue 25's S1):
  the ``feature_scale=evidence`` rows of the generated full S1 table on the docs' results page.
  It does not cure this over-confidence: the bodies fit their 250 training images (training
  NLL near 0 at s = 1), whose features have about the model's within-class variance, so the
  evidence keeps s near 1; test images' features are as spread but fall near other classes'
  means. The s best for the test NLL (chosen on the test set) is well below 1: no criterion of
  the training features sees that, held-out data do. The run's temperature step on 4% of each
  client's training images (``calibrate="temperature:0.04"``, 10 a client) lowers the NLL
  without losing accuracy, alone and with ``feature_scale="evidence"`` (commit ``ab42cac``'s
  message; the run's headline figures stay the uncalibrated ones; ``summary["calibration"]``
  has these). Holding out 10% cost accuracy (``4c66c92``, not stored).

**Held-out feature scale** (``feature_scale="heldout"``, **the default**; federated type-II
choice by held-out likelihood). Every client keeps a stratified ``heldout_fraction`` (default
4%) of its training examples out of its body's training and out of the statistics the bodies
train through, drawn once from the run seed and its id. The training broadcast is the summed
statistic of the kept examples and its count (as many floats as the head; clients solve the MAP
themselves, as FedLog-C's do). At the start of each round, before training, a client scores its
held-out examples with its current body (the one that made its share of the broadcast
statistics) on `inference.conjugate.heldout_scale.HELDOUT_SCALE_GRID`: the summed
``-log p(y | phi, W*(s))`` of the MAP ``W*(s)`` at 33 scales (solved once per broadcast and
shared by the clients a process runs), uploaded with its count (34 float64, 272 bytes). The
server adds the vectors and takes the minimiser, held to at most 1
(`scale_from_grid`, `inference.conjugate.heldout_scale.HELDOUT_SCALE_CAP`): held-out
examples show overconfidence by their errors, and a slice with none (an easy task, a few
examples a client: digits, ``shards:2``) would otherwise favour ever sharper predictions.

**Then the slices join the posterior.** After training, each client also uploads the statistics
of its held-out slice (``heldout_statistics``, (C, m) in the upload dtype, features of its
trained body; validated as the statistics are, with the slice's count from its bias column,
which must equal ``heldout_count`` once scored and may not exceed ``num_samples``). The server
sums them apart (``heldout_statistics``, ``heldout_num_samples`` in its state) and the
evaluation posterior is that of *every* training example at the chosen s: statistics = kept +
slices (`FedLog.configure_evaluation`). So the choice of s costs no example of the
posterior; the bodies still never train on the slices (they stay held out for the next round's
choice). The upload doubles (a second (C, m) table), counted like every other byte.

The bodies keep training through the head at s = 1: trained through the chosen s, a body grows
its features to undo it, and the choice chased them down (S1, seed 0: s fell every round to
the grid's end and the NLL rose; measured at ``2226352``, not stored). Through s = 1 the choice
settles within a few rounds and the calibration holds.

Measured (S1: mnist-5k, 10 clients, ``labels:5:train=50``, ``mlp``, 5 epochs, 30 rounds; seeds
0, 1, 2, paired; ``bench/s1_shift.py``, ``bench/results/s1_shift.jsonl``), ``feature_scale=1``
(the paper's) against the default: the "FedLog (s = 1)" and "FedLog (default)" rows of the
generated S1 shift table on the docs' results page (accuracy, NLL clean and with each client's
test images rotated by 30 and 60 degrees, unseen-label AUROC of the predictive entropy); commit
``2226352``'s message has the paired means when the default changed. Why it changed (issue 40):
at s = 1 FedLog was the worst-calibrated method of the S1 table, confidently wrong under any
shift. The withholding version (before the slices joined the posterior) cost accuracy in the
same setting (commit ``ba56973``'s message; ``bench/results/s1_30_cpu_fedlog.jsonl``). The
run's temperature step (``calibrate="temperature:0.04"``) keeps the argmax and the accuracy at
a higher NLL than the held-out scale's (``ab42cac``, not stored). Scores a client forges
within the honest bounds (`heldout_problem`) can pull the scale, as forged statistics can pull
the head. DP variants and FedLog-C keep s = 1 (a fixed s for FedLog-C).

**Why the posterior predictive is the plug-in here, and stays so** (issue 40). The conjugate
posterior is that of the generative model $\phi \mid y \sim \mathcal{N}(W_y / 2, I / 2)$ in the
scaled coordinates: its Laplace covariance is $(N \nabla^2 A(W^*))^{-1}$, the uncertainty of
the class means from ``N = nu + n`` examples, so a logit's posterior variance is about
$2 \lVert s\phi\rVert^2 / (N p_y)$ whatever the row: it grows with the feature norm, not with the
distance from the training features. On S1 (``bench/s1_posterior_spread.py``, which stores
``bench/results/s1_posterior_spread.jsonl``; no generated table) the posterior standard
deviation of the top logit is a few percent of the gap between the two largest MAP logits,
clean, rotated and on unseen labels, at s = 1 and at the chosen s (rotations *shrink* the
feature norm, and with it the spread). So the MC predictive (256 draws) is the plug-in to a
fraction of a percent: the "FedLog (default)" headline and plug-in rows of the generated S1
shift table. The prior ``nu`` = 1 is one pseudo-example against S1's 2,500 training rows; a
client's own posterior (N = 250) has the variance of the federated one tempered by T = 10,
which at the chosen s barely moves the NLL. Tempering the likelihood (the summed statistics
and count divided by T: the same MAP, covariance times T) does shift the predictive: at s = 1 a
T in the thousands lowers the NLL much as the scale does; at the chosen s, a T in the hundreds
lowers the 60-degree NLL but raises the clean one and lowers the AUROC. Chosen by the held-out
slices' NLL, T is 1 (the slices' NLL rises with T), and choosing (s, T) jointly on the slices
gives T = 1 and about the same s: the held-out rows ask for a uniform shrink of the logits
(s), not for one proportional to the feature norm (the posterior's). So no setting chosen
without test rows makes this posterior's predictive beat its plug-in on shifted NLL or
unseen-label AUROC in S1 by more than that fraction of a percent; the scale is what
calibrates FedLog. (The tempering and spread figures were typed at ``2226352``, issue 40.)

**Parts.** A FedLog strategy is built from two parts instead of flags:

* a *privacy placement* (`NoPrivacy`, `LocalDP`, `CentralDP`): what a
  client releases, what an upload must satisfy (one implementation for one upload and many),
  and how the server totals the statistics (section "Differential Privacy": features clamped
  to [-b, b]; Gaussian noise added by each client to its own statistic, or once by the server
  to the sum; sigma from the v2 accountant by default, ``accountant="k_round"``, or v1's per-release
  one, ``"single"``; local-DP uploads carry no ``num_samples``, which would leak n_c; DP runs report
  the noise-to-signal of the summed statistic, ``dp_noise_to_signal``, warn when the noise swamps
  it, and evaluate with the posterior widened by the known noise, see `_FedLogDP`);
* a *broadcast policy* (`HeadBroadcast` for FedLog, `StatisticsBroadcast` for
  FedLog-C, section "Interpretation and FedLog-C": the server broadcasts the statistic and N;
  each client solves the same deterministic MAP and adds the compactness loss
  $\alpha \lVert\phi(x) - \bar\phi_y\rVert^2$, $\bar\phi_y$ the class mean).

**What an honest upload satisfies.** Every body ends in a ReLU, and a client's features are
bounded by ``B`` (``feature_bound``, default 1000, far above what a trained digits body
reaches; a client clamps its features at B before summing, so an honest client never violates
it; with DP, B is the clip bound). So for clean statistics (no privacy or central DP) the
server rejects an upload unless, per class y: ``0 <= S[y, j] <= n_y B``, ``n_y = 0`` implies
``S[y, :] = 0``, and the counts are integral and sum to ``num_samples``; ``num_samples`` may not
exceed the client's first declared count, nor ``sample_screening_ratio`` (100) times the
round's median. Local-DP uploads are noisy and carry no count: no such check applies to them.
``statistics_aggregation="median"`` (clean statistics only) replaces each class's summed
features by ``n_y`` times the coordinate-wise median of the clients' class means, so one client
within the bounds moves a class mean by at most the spread of the honest ones.

**Server state.** Beside the head, the summed statistic, its count and flags, the server keeps
per-client tensors as one stack per kind, indexed by client id (N rows, N the run's clients):
with ``absent_clients="latest"`` ``latest/<upload tensor>`` (every client's latest accepted
upload, e.g. ``latest/statistics`` (N, C, m)) and ``latest/present`` (N,) bool (the rows that
hold one); with clean counts ``declared`` (N,) int64 (each client's first accepted
``num_samples``, 0 before it). The sums run over the present rows in client-id order, as the
former per-client tensors (``latest/<id>/<name>``, ``declared/<id>``) were summed: the same
numbers, with a few tensors instead of three per client in every aggregation and checkpoint
(48,000 at 16,000 clients). A checkpoint of that former layout lacks ``latest/present`` (or
``declared``) and is refused on resume as not written by this run.

Registry names: ``fedlog``, ``fedlog-c``, ``fedlog-dp-local``, ``fedlog-dp-central``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData, stratified_split
from bayesfl.errors import ConfigError
from bayesfl.messages import Message, Schema, TensorSpec, tensor_digest
from bayesfl.posterior import ClientPosterior, client_posterior
from bayesfl.strategies.base import (
    MAP_PLUGIN,
    PREDICTIVE,
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    Strategy,
    StrategyContext,
    check_one_body,
    derived_seed,
    model_state,
    stacked_tensors,
    with_parameters,
)
from bayesfl.strategies.networks import batched_apply
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.robust import (
    check_robust_options,
    coordinate_median,
    first_reasons,
    screening_reasons,
)
from bayesfl.strategies.uploads import NUM_SAMPLES_SPEC, num_samples_tensor, wire
from bayesfl.training import (
    cross_entropy_per_sample,
    forward_stacked_tensors,
    train_plain,
    train_stacked,
)
from inference.conjugate import (
    ClassMeans,
    ConjugatePosterior,
    ConjugatePrior,
    DPNoiseReport,
    NoisyConjugatePosterior,
    SufficientStatistics,
    clip_features,
    gaussian_sigma,
    privacy_signal_to_noise,
    privatize,
)
from inference.conjugate.evidence import evidence_feature_scale
from inference.conjugate.heldout_scale import (
    HELDOUT_SCALE_GRID,
    grid_heads,
    heldout_nll_by_group,
    heldout_nll_of_heads,
    scale_from_grid,
)
from inference.conjugate.privacy import SWAMPED_RATIO
from inference.conjugate.statistics import checked_batch
from inference.errors import InferenceError

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
PREDICTIVES = ("mc", "probit", "map")
ABSENT_CLIENTS = ("latest", "omit")
STATISTICS_AGGREGATIONS = ("sum", "median")
EVIDENCE = "evidence"
HELDOUT = "heldout"
SQUARE_SUM_SPEC = TensorSpec((1,), torch.float64)
HELDOUT_NLL_SPEC = TensorSpec((len(HELDOUT_SCALE_GRID),), torch.float64)
HELDOUT_COUNT_SPEC = TensorSpec((1,), torch.float64)
DEFAULT_HELDOUT_FRACTION = 0.04
"""Share of a client's training examples ``feature_scale="heldout"`` keeps out (10 of 250 in
S1): enough, summed over the clients, to place one scalar; little enough not to cost accuracy
(10% did: 0.907 against 0.916 in S1, measured with the temperature step)."""
HELDOUT_TABLE = "heldout_statistics"
"""Server tensor (C, m) float64 (``feature_scale="heldout"``): the summed statistics of the
clients' held-out slices, added to the summed statistics in the evaluation posterior."""
HELDOUT_COUNT = "heldout_num_samples"
"""Server tensor (1,) float64: the held-out slices' summed count."""
_CACHE = "latest/"
PRESENT = _CACHE + "present"
"""Server tensor (N,) bool: which clients' rows of the ``latest/<upload tensor>`` stacks hold
an accepted upload (``absent_clients="latest"``)."""
DECLARED = "declared"
"""Server tensor (N,) int64: every client's first accepted ``num_samples`` (0: none yet; an
accepted count is at least 1). One tensor indexed by client id, where the robust module's
ledger keeps one scalar per client (``declared/<id>``): 16,000 clients made 16,000 tensors of
every aggregation and checkpoint."""
PREDICT_ROWS = 256
"""Feature rows a client's (or a batched group's) predictive computes at once."""

MOST_SAMPLES = 1e9
"""More samples than any data set a run holds (a billion, beyond in-memory data). A prior
pseudo-count (``prior_nu``) above it outweighs every statistic, and DP noise that swamps the
statistics of this many samples per class swamps any: both are refused as out of range."""


# ==== parts: privacy placement ===============================================================
class NoPrivacy:
    """Clean statistics: uploads carry ``num_samples`` and exact class counts."""

    noisy: ClassVar[bool] = False
    sends_num_samples: ClassVar[bool] = True
    sigma: float = 0.0
    clip: float | None = None
    bound_name: ClassVar[str] = "feature bound"

    def __init__(self, bound: float = math.inf) -> None:
        self.bound = bound
        """Feature bound B: an honest client's features lie in [0, B]."""

    def build_model(self, body: nn.Module) -> nn.Module:
        return body

    def schema(self, num_classes: int, m: int, dtype: torch.dtype) -> Schema:
        schema = {"statistics": TensorSpec((num_classes, m), dtype)}
        if self.sends_num_samples:
            schema["num_samples"] = NUM_SAMPLES_SPEC
        return schema

    def release(
        self, table: Tensor, n: int, dtype: torch.dtype, generator: torch.Generator
    ) -> dict[str, Tensor]:
        """What a client uploads of its statistic ``table`` (C, m) float64 over n samples."""
        return {"statistics": table.to(dtype), "num_samples": num_samples_tensor(n)}

    def problems(self, tables: Tensor, n: Tensor | None) -> list[str | None]:
        """Invariants of K schema-valid uploads: ``tables`` (K, C, m) float64, ``n`` (K,)
        int64. Per upload None or the first violated invariant, in this order: n >= 1;
        non-negative, integral class counts in column 0 that sum to n; feature sums that are
        non-negative (ReLU bodies), zero for an absent class, and within B times the count."""
        assert n is not None  # schema: clean uploads carry num_samples
        counts = tables[:, :, 0]
        sums = tables[:, :, 1:]
        # float32 uploads round each sum by a relative 6e-8; 1e-6 is slack for that only
        limit = self.bound * counts[:, :, None] * (1 + 1e-6)
        failures = [
            (n < 1, lambda k: f"num_samples must be >= 1, got {int(n[k])}"),
            ((counts < 0).any(1), lambda k: "bias column (class counts) has negative entries"),
            ((counts != counts.round()).any(1),
             lambda k: "bias column (class counts) is not integral"),
            (counts.sum(1) != n.to(torch.float64),
             lambda k: f"class counts sum to {int(counts[k].sum())} but num_samples is "
                       f"{int(n[k])}"),
            ((sums < 0).flatten(1).any(1),
             lambda k: "negative feature sums, impossible for features after a ReLU"),
            (((counts == 0)[:, :, None] & (sums != 0)).flatten(1).any(1),
             lambda k: "non-zero feature sums for a class with count 0"),
            ((sums > limit).flatten(1).any(1),
             lambda k: f"feature sums exceed the {self.bound_name} {self.bound:g} times the "
                       "class counts"),
        ]
        reasons: list[str | None] = [None] * tables.shape[0]
        for mask, reason in reversed(failures):  # the first failing check names the reason
            for k in mask.nonzero().flatten().tolist():
                reasons[k] = reason(k)
        return reasons

    def total(
        self, tables: Tensor, n: Tensor | None, generator: torch.Generator
    ) -> SufficientStatistics:
        """The server's total of K uploads (exact, order-independent sum)."""
        assert n is not None
        return SufficientStatistics.sum_tables(tables, int(n.sum()))


class LocalDP(NoPrivacy):
    """Local DP: every client clamps its features and adds N(0, sigma^2) to its statistic;
    no ``num_samples`` travels (the server uses the noisy counts, rounded, at least 1). Noisy
    uploads have no count invariant to check."""

    noisy = True
    sends_num_samples = False

    def __init__(self, sigma: float, clip: float) -> None:
        super().__init__(clip)
        self.sigma, self.clip = sigma, clip

    def build_model(self, body: nn.Module) -> nn.Module:
        return FeatureClamp(body, self.clip)

    def release(
        self, table: Tensor, n: int, dtype: torch.dtype, generator: torch.Generator
    ) -> dict[str, Tensor]:
        # one client's share is always swamped on its own; the server checks the sum
        noisy = privatize(SufficientStatistics(table, n), self.sigma, generator,
                          check_noise=False)
        return {"statistics": noisy.table.to(dtype)}

    def problems(self, tables: Tensor, n: Tensor | None) -> list[str | None]:
        return [None] * tables.shape[0]

    def total(
        self, tables: Tensor, n: Tensor | None, generator: torch.Generator
    ) -> SufficientStatistics:
        total = SufficientStatistics.sum_tables(tables, 0, privatized=True)
        noisy_n = int(total.table[:, 0].sum().round().item())
        return SufficientStatistics(total.table, max(1, noisy_n), privatized=True)


class CentralDP(NoPrivacy):
    """Central DP: clients clamp their features and upload clean statistics (checked, with
    the clamp bound on the feature sums); the server adds N(0, sigma^2) to the sum once."""

    noisy = True
    bound_name = "clamp bound"

    def __init__(self, sigma: float, clip: float) -> None:
        super().__init__(clip)
        self.sigma, self.clip = sigma, clip

    def build_model(self, body: nn.Module) -> nn.Module:
        return FeatureClamp(body, self.clip)

    def total(
        self, tables: Tensor, n: Tensor | None, generator: torch.Generator
    ) -> SufficientStatistics:
        # checked by the strategy from public figures (a warning computed from the clean sum
        # would itself be a release)
        return privatize(super().total(tables, n, generator), self.sigma, generator,
                         check_noise=False)


# ==== parts: broadcast policy ================================================================
class HeadBroadcast:
    """FedLog: the server broadcasts the MAP head W (C, m) float32."""

    solves_locally: ClassVar[bool] = False

    def tensors(self, state: ServerState, dtype: torch.dtype) -> dict[str, Tensor]:
        return {"head": state["head"].to(torch.float32)}

    def training_target(self, message: Message, strategy: FedLog) -> HeadObjective:
        return HeadObjective(message.tensors["head"].to(strategy.context.device))


class StatisticsBroadcast:
    """FedLog-C: the server broadcasts the summed statistic (wire dtype) and N; every client
    solves the same MAP and pulls its features towards the global class means (``alpha``)."""

    solves_locally: ClassVar[bool] = True

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def tensors(self, state: ServerState, dtype: torch.dtype) -> dict[str, Tensor]:
        tensors = {"statistics": state["statistics"].to(dtype),
                   "num_samples": state["num_samples"].to(torch.float64)}
        if "feature_scale" in state:  # FedLog's "heldout": clients solve at the chosen scale
            tensors["feature_scale"] = state["feature_scale"]
        return tensors

    def training_target(self, message: Message, strategy: FedLog) -> HeadObjective:
        table = message.tensors["statistics"].to(torch.float64)
        n = float(message.tensors["num_samples"].item())
        head = strategy.solve_head(table, n, privatized=True,
                                   feature_scale=strategy.training_scale(message)
                                   ).to(torch.float32)
        device = strategy.context.device
        if not (self.alpha > 0 and n > 0):
            return HeadObjective(head.to(device))
        # counts clamped at 1 inside: noisy or absent classes never divide by ~0
        means = ClassMeans.from_statistics(SufficientStatistics(table, 0, privatized=True),
                                           dtype=torch.float32).means
        return HeadObjective(head.to(device), means.to(device), self.alpha)


class HeadObjective:
    """Per-sample cross-entropy of ``softmax(W [1, phi])`` with ``W`` frozen, plus FedLog-C's
    compactness term ``alpha * ||phi - mean_y||^2`` when class means are given.

    Args:
        head: W (C, m) with the bias in column 0.
        class_means: (C, m - 1) global class-mean features, or None.
        alpha: weight of the compactness term.
    """

    def __init__(self, head: Tensor, class_means: Tensor | None = None, alpha: float = 0.0):
        self.bias = head[:, 0].contiguous()
        self.weight = head[:, 1:].contiguous()
        self.class_means = class_means
        self.alpha = alpha

    def __call__(self, features: Tensor, labels: Tensor) -> Tensor:
        logits = features @ self.weight.T + self.bias
        loss = cross_entropy_per_sample(logits, labels)  # F.cross_entropy, without sympy
        if self.class_means is not None and self.alpha > 0:
            loss = loss + self.alpha * (features - self.class_means[labels]).pow(2).sum(dim=-1)
        return loss


class FeatureClamp(nn.Module):
    """``clamp(body(x), -bound, bound)``: bounded features for differential privacy."""

    def __init__(self, body: nn.Module, bound: float) -> None:
        super().__init__()
        self.body = body
        self.bound = bound

    def forward(self, x: Tensor) -> Tensor:
        return clip_features(self.body(x), self.bound)


# ==== the strategy ===========================================================================
@register_strategy("fedlog",
                   broadcast="MAP head W",
                   upload="statistics S_c (class counts, feature sums), `num_samples`",
                   aggregate="exact sum of every client's latest statistics → exact MAP; "
                             "conjugate posterior predictive, MAP plug-in beside; screens "
                             "`num_samples`")
class FedLog(Strategy):
    """FedLog: body trained through the broadcast head, statistics up, MAP head down.

    Args:
        context: the run configuration.

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    init_round: ClassVar[bool] = True
    is_posterior: ClassVar[bool] = True

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("prior_nu", float, 1.0,
               "the conjugate prior's nu (chi = 0), a pseudo-count of samples in `[0, "
               "MOST_SAMPLES]`; the paper's default is 1."),
        Option("upload_dtype", str, "float32",
               "\"float32\" (the paper's accounting) or \"float64\" for the statistic."),
        Option("absent_clients", str, "latest",
               "`\"latest\"` (sum every client's latest statistics, default) or `\"omit\"` (this "
               "round's participants only); see the module docstring."),
        Option("predictive", str, "mc",
               'the headline predictive, `"mc"` (default), `"probit"` or `"map"`.'),
        Option("mc_samples", int, 256,
               'Laplace draws of the `"mc"` predictive.'),
        Option("feature_bound", float, 1000.0,
               "B, the bound of honest features (clients clamp at it; the server rejects sums "
               "above `n_y B`). Not an option of the DP variants (their clip is B)."),
        Option("statistics_aggregation", str, "sum",
               '`"sum"` (the paper) or `"median"` (robust class means; clean statistics only), '
               "see the module docstring."),
        Option("sample_screening_ratio", float, 100.0,
               "reject a `num_samples` above this many times the round's median (None: no "
               "screening).",
               nullable=True),
        Option("feature_scale", (float, str), "heldout",
               "the model's feature scale s (the posterior is that of `[1, s phi]`, "
               '`inference.ConjugatePosterior`): `"heldout"` (default): s of least '
               "summed NLL on slices of the clients' training examples kept out of the bodies' "
               'training, whose statistics then join the posterior (module docstring, "Held-out '
               'feature scale"; S1: NLL 1.30 -> 0.30, 30-degree rotations 6.0 -> 1.15, accuracy '
               "equal); a number > 0: that fixed s (`1` is the paper's model, FedLog's default "
               'before issue 40); or `"evidence"`: the server chooses s every round by '
               "maximising the conjugate model's log evidence of the summed statistics "
               "(federated type-II maximum likelihood; each upload then carries `square_sum`, "
               "one float64). Not an option of the DP variants (s = 1); FedLog-C takes a fixed "
               "s (default 1)."),
        Option("heldout_fraction", float, 0.04,
               "the share of each client's training examples `\"heldout\"` keeps out of the "
               "bodies' training (0 < f < 0.5, default 0.04)."),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        prior_nu: float = 1.0,
        upload_dtype: str = "float32",
        absent_clients: str = "latest",
        predictive: str = "mc",
        mc_samples: int = 256,
        feature_bound: float = 1000.0,
        statistics_aggregation: str = "sum",
        sample_screening_ratio: float | None = 100.0,
        feature_scale: float | str = HELDOUT,
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    ) -> None:
        super().__init__(context)
        self.feature_scale = checked_feature_scale(feature_scale)
        self.evidence = self.feature_scale == EVIDENCE
        self.heldout = self.feature_scale == HELDOUT
        self.chooses_scale = self.evidence or self.heldout
        if isinstance(heldout_fraction, bool) or not isinstance(heldout_fraction, int | float) \
                or not 0 < heldout_fraction < 0.5:
            raise ConfigError(f"heldout_fraction must be a number in (0, 0.5), got "
                              f"{heldout_fraction!r}: the share of each client's training "
                              "examples feature_scale='heldout' keeps out of training")
        self.heldout_fraction = float(heldout_fraction)
        self._grid_memo: tuple[str, Tensor | None] | None = None
        self._split_memo: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        check_robust_options("mean", 0.0, None, sample_screening_ratio)
        if not (isinstance(feature_bound, int | float) and not isinstance(feature_bound, bool)
                and 0 < feature_bound < math.inf):
            raise ConfigError(f"feature_bound must be a finite number > 0, got "
                              f"{feature_bound!r}")
        if statistics_aggregation not in STATISTICS_AGGREGATIONS:
            raise ConfigError(f"statistics_aggregation must be one of "
                              f"{', '.join(STATISTICS_AGGREGATIONS)}; got "
                              f"{statistics_aggregation!r}")
        self.feature_bound = float(feature_bound)
        self.statistics_aggregation = statistics_aggregation
        self.sample_screening_ratio = (None if sample_screening_ratio is None
                                       else float(sample_screening_ratio))
        if upload_dtype not in _DTYPES:
            raise ConfigError(f"upload_dtype must be one of {sorted(_DTYPES)}, got "
                              f"{upload_dtype!r}")
        if isinstance(prior_nu, bool) or not isinstance(prior_nu, int | float) \
                or not 0 <= prior_nu <= MOST_SAMPLES:
            raise ConfigError(
                f"prior_nu must be a number in [0, {MOST_SAMPLES:g}], got {prior_nu!r}: it is "
                "the prior's pseudo-count of samples (1, the paper's, weighs as one sample), and "
                "a prior worth more samples than any data set flattens the head to uniform "
                "probabilities")
        if absent_clients not in ABSENT_CLIENTS:
            raise ConfigError(f"absent_clients must be one of {', '.join(ABSENT_CLIENTS)}; "
                              f"got {absent_clients!r}")
        if predictive not in PREDICTIVES:
            raise ConfigError(f"predictive must be one of {', '.join(PREDICTIVES)}; got "
                              f"{predictive!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ConfigError(f"mc_samples must be an integer >= 1, got {mc_samples!r}")
        self.mc_samples = mc_samples
        self.prior_nu = float(prior_nu)
        self.upload_dtype = _DTYPES[upload_dtype]
        self.absent_clients = absent_clients
        self.predictive = predictive
        self.m = context.feature_dim + 1
        self._posterior_memo: tuple[str, ConjugatePosterior | None, Tensor | None] | None = None
        self.privacy: NoPrivacy = self.make_privacy()
        self.broadcast: HeadBroadcast | StatisticsBroadcast = self.make_broadcast()
        if statistics_aggregation == "median" and not self.privacy.sends_num_samples:
            raise ConfigError("statistics_aggregation='median' needs exact class counts; "
                              "local-DP uploads are noisy: use 'sum'")
        if self.evidence and statistics_aggregation == "median":
            raise ConfigError("feature_scale='evidence' needs the sum of the clients' squared "
                              "feature norms, which statistics_aggregation='median' does not "
                              "screen: use statistics_aggregation='sum' or a number")
        if self.heldout and statistics_aggregation == "median":
            raise ConfigError("feature_scale='heldout' sums the clients' held-out NLL, which "
                              "statistics_aggregation='median' does not screen: use "
                              "statistics_aggregation='sum' or a number")

    def make_privacy(self) -> NoPrivacy:
        """The privacy placement part (FedLog: none)."""
        return NoPrivacy(self.feature_bound)

    def make_broadcast(self) -> HeadBroadcast | StatisticsBroadcast:
        """The broadcast policy part (FedLog: the MAP head; with ``feature_scale="heldout"``
        the statistics, as many floats, from which clients solve the head at any scale)."""
        return StatisticsBroadcast(0.0) if self.heldout else HeadBroadcast()

    def build_model(self, body: nn.Module) -> nn.Module:
        return self.privacy.build_model(body)

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        C, m = self.num_classes, self.m
        state = {
            "head": torch.zeros(C, m, dtype=torch.float32),
            "statistics": torch.zeros(C, m, dtype=torch.float64),
            "num_samples": torch.zeros(1, dtype=torch.float64),
            "privatized": torch.zeros(1, dtype=torch.bool),
        }
        if self.chooses_scale:
            state["feature_scale"] = torch.ones(1, dtype=torch.float64)
        if self.heldout:
            state[HELDOUT_TABLE] = torch.zeros(C, m, dtype=torch.float64)
            state[HELDOUT_COUNT] = torch.zeros(1, dtype=torch.float64)
        return state | self._client_tables()

    def _client_tables(self) -> ServerState:
        """The server's per-client tensors, one stack per kind indexed by client id (N rows,
        N the run's clients): with ``absent_clients="latest"`` every upload tensor's latest
        accepted value (``latest/<name>``, (N, *its shape), the upload's dtype) and which rows
        hold one (`PRESENT`); with clean counts the declared-sample ledger
        (`DECLARED`). Their shapes are the run's, so a resumed state whose rows or
        layout differ (another client count, a client id out of range, a wrong dtype) is
        refused by the engine's check against the fresh state."""
        N = self.context.clients
        tables: ServerState = {}
        if self.absent_clients == "latest":
            tables[PRESENT] = torch.zeros(N, dtype=torch.bool)
            for name, spec in self.upload_schema({}, 0).items():
                tables[_CACHE + name] = torch.zeros((N, *spec.shape), dtype=spec.dtype)
        if self.privacy.sends_num_samples:
            tables[DECLARED] = torch.zeros(N, dtype=torch.int64)
        return tables

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        return self.broadcast.tensors(state, self.upload_dtype)

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        schema = self.privacy.schema(self.num_classes, self.m, self.upload_dtype)
        if self.evidence:
            schema["square_sum"] = SQUARE_SUM_SPEC
        if self.heldout:
            schema["heldout_nll"] = HELDOUT_NLL_SPEC
            schema["heldout_count"] = HELDOUT_COUNT_SPEC
            schema["heldout_statistics"] = TensorSpec((self.num_classes, self.m),
                                                      self.upload_dtype)
        return schema

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """The federated posterior's parameters: the summed statistic (float64), its count
        and whether it is privatized (clients build the conjugate posterior from them)."""
        tensors = {"statistics": state["statistics"], "num_samples": state["num_samples"],
                   "privatized": state["privatized"]}
        if HELDOUT_TABLE in state:  # "heldout": the slices' statistics join the posterior
            tensors["statistics"] = state["statistics"] + state[HELDOUT_TABLE]
            tensors["num_samples"] = state["num_samples"] + state[HELDOUT_COUNT]
        if "feature_scale" in state:
            tensors["feature_scale"] = state["feature_scale"]
        return self.down_message(round, tensors)

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """The privacy placement's invariants of the statistics, then (clean counts) the
        declared-sample ledger and the screening of ``num_samples``."""
        tables = torch.stack([m.tensors["statistics"] for m in messages]).to(torch.float64)
        ids = [m.header.client_id for m in messages]
        if not self.privacy.sends_num_samples:
            return first_reasons(client_id_problems(ids, self.context.clients),
                                 self.privacy.problems(tables, None))
        n = torch.cat([m.tensors["num_samples"] for m in messages])
        return first_reasons(
            client_id_problems(ids, self.context.clients),
            self.privacy.problems(tables, n),
            (square_sum_problems(tables, torch.cat([m.tensors["square_sum"] for m in messages]),
                                 self.privacy.bound)
             if self.evidence else [None] * len(messages)),
            ([heldout_problem(m.tensors["heldout_nll"], m.tensors["heldout_count"],
                              float(m.tensors["num_samples"].item())) for m in messages]
             if self.heldout else [None] * len(messages)),
            (self.heldout_statistics_problems(messages)
             if self.heldout else [None] * len(messages)),
            declared_count_problems(plan.state[DECLARED], ids, n),
            screening_reasons(n.to(torch.float64), self.sample_screening_ratio, "num_samples"),
        )

    def heldout_statistics_problems(self, messages: Sequence[Message]) -> list[str | None]:
        """``feature_scale="heldout"``: the invariants of the held-out slices' statistics.

        A slice's count is its table's bias column summed (``heldout_count`` counts the rows
        *scored*, 0 in round 0, when there are no statistics to judge them against): the
        table must meet the statistics' invariants (`NoPrivacy.problems`) with that
        count, or be all zeros for an empty slice; the count may not exceed the kept examples
        (``num_samples``: the slice is under half), and equals ``heldout_count`` whenever the
        slice was scored."""
        tables = torch.stack([m.tensors["heldout_statistics"] for m in messages]
                             ).to(torch.float64)
        sizes = tables[:, :, 0].sum(dim=1)
        whole = torch.isfinite(sizes) & (sizes == sizes.round()) & (sizes >= 0)
        n = torch.where(whole, sizes, torch.zeros_like(sizes)).to(torch.int64)
        reasons = self.privacy.problems(tables, n.clamp(min=1))
        out: list[str | None] = []
        for k, (message, reason) in enumerate(zip(messages, reasons, strict=True)):
            kept = float(message.tensors["num_samples"].item())
            scored = float(message.tensors["heldout_count"].item())
            if int(n[k]) == 0 and bool(whole[k]):
                out.append(None if not bool(tables[k].any()) else
                           "heldout_statistics: non-zero sums for an empty held-out slice")
            elif reason is not None:
                out.append("heldout_statistics: " + reason.replace(
                    "num_samples", "their count"))
            elif int(n[k]) > kept:
                out.append(f"heldout_statistics count {int(n[k])} exceeds the {kept:g} "
                           "training examples kept (a held-out slice is under half)")
            elif scored > 0 and scored != int(n[k]):
                out.append(f"heldout_statistics count {int(n[k])} differs from the "
                           f"{scored:g} held-out examples scored (heldout_count)")
            else:
                out.append(None)
        return out

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """Sum the statistics (this round's, or every client's latest), add central noise if
        any, and solve the MAP head."""
        if not uploads:
            return state
        ids = self._client_ids(uploads)
        if self.absent_clients == "latest":
            cache = self.cached_uploads(state, uploads, ids)
            present = cache[PRESENT]

            def column(name: str) -> Tensor:  # the summed clients' rows, by client id
                return cache[_CACHE + name][present]
        else:  # this round's uploads, in client-id order
            cache, order = {}, ids.argsort().tolist()

            def column(name: str) -> Tensor:
                return torch.stack([uploads[k].tensors[name] for k in order])
        tables = column("statistics").to(torch.float64)
        n = column("num_samples").reshape(-1) if self.privacy.sends_num_samples else None
        if self.statistics_aggregation == "median":
            tables = median_class_means(tables)
        total = self.privacy.total(tables, n, generator)
        table, count = total.table, float(total.n)
        privatized = total.privatized or self.broadcast.solves_locally
        if self.broadcast.solves_locally:  # clients solve from the wire-dtype table: match it
            table = table.to(self.upload_dtype).to(torch.float64)
        scale = self.feature_scale
        if self.evidence:
            square_sum = float(column("square_sum").reshape(-1).sum())
            scale = self.choose_feature_scale(table, count, square_sum,
                                              float(state["feature_scale"].item()))
        train_scale = scale
        if self.heldout:
            scale = self.heldout_scale(uploads, float(state["feature_scale"].item()))
            train_scale = 1.0
        # the head clients train through (FedLog's broadcast); "heldout" keeps it at s = 1
        # and applies the chosen s in the evaluation posterior only
        head = self.solve_head(table, count, privatized=privatized,
                               feature_scale=train_scale).to(torch.float32)
        new = {"head": head, "statistics": table,
               "num_samples": torch.tensor([count], dtype=torch.float64),
               "privatized": torch.tensor([privatized])}
        if self.chooses_scale:
            new["feature_scale"] = torch.tensor([scale], dtype=torch.float64)
        if self.heldout:  # the slices' statistics, summed like the statistics
            new[HELDOUT_TABLE] = column("heldout_statistics").to(torch.float64).sum(dim=0)
            new[HELDOUT_COUNT] = new[HELDOUT_TABLE][:, 0].sum().reshape(1)
        new.update(cache)
        if self.privacy.sends_num_samples:
            declared = state[DECLARED].clone()
            counts = torch.cat([u.tensors["num_samples"] for u in uploads])
            first = declared[ids] == 0  # a client's first accepted count stays its declaration
            declared[ids[first]] = counts[first]
            new[DECLARED] = declared
        return new

    def _client_ids(self, uploads: Sequence[Message]) -> Tensor:
        """The uploads' client ids (K,) int64 (distinct: one upload per client and round).

        Raises:
            ConfigError: an id that is not one of the run's clients (the transports only
                deliver uploads of clients they sampled).
        """
        ids = torch.tensor([u.header.client_id for u in uploads], dtype=torch.int64)
        N = self.context.clients
        if bool(((ids < 0) | (ids >= N)).any()):
            bad = int(ids[(ids < 0) | (ids >= N)][0])
            raise ConfigError(f"an upload of client {bad}, not one of this run's clients "
                              f"(0 to {N - 1})")
        return ids

    def cached_uploads(self, state: ServerState, uploads: Sequence[Message],
                       ids: Tensor) -> ServerState:
        """``absent_clients="latest"``: the ``latest/<name>`` stacks and `PRESENT` of
        ``state`` (new tensors; ``state`` is left as it is) with the rows of ``ids`` set to
        their ``uploads``."""
        present = state[PRESENT].clone()
        present[ids] = True
        cache = {PRESENT: present}
        for name in uploads[0].tensors:
            stack = state[_CACHE + name].clone()
            stack[ids] = torch.stack([u.tensors[name] for u in uploads]).to(stack.dtype)
            cache[_CACHE + name] = stack
        return cache

    def solve_head(self, table: Tensor, n: float, *, privatized: bool,
                   feature_scale: float | None = None) -> Tensor:
        """Posterior MAP head W (C, m) float64 (of body features) of the summed statistic
        ``table`` with count ``n`` under the prior chi = 0, ``nu`` (exact solver), with
        ``feature_scale`` (None: the fixed option, 1 when the server chooses it)."""
        if feature_scale is None:
            feature_scale = 1.0 if self.chooses_scale else float(self.feature_scale)
        stats = SufficientStatistics(table.to(torch.float64), round(n), privatized=privatized)
        return ConjugatePosterior(ConjugatePrior(nu=self.prior_nu), stats,
                                  feature_scale=feature_scale).map()

    def choose_feature_scale(self, table: Tensor, n: float, square_sum: float,
                             previous: float = 1.0) -> float:
        """The feature scale of largest log evidence (`inference.conjugate.evidence.
        evidence_feature_scale`) of the summed ``table`` (count ``n``) and the summed squared
        feature norms ``square_sum``, under this strategy's prior. Should the search fail (a
        non-finite evidence), the round keeps ``previous`` and a ``RuntimeWarning`` says why:
        the run goes on with the scale it had."""
        stats = SufficientStatistics(table.to(torch.float64), round(n))
        try:
            return evidence_feature_scale(stats, square_sum,
                                          prior=ConjugatePrior(nu=self.prior_nu)).value
        except InferenceError as error:
            warnings.warn(f"feature_scale='evidence': no scale chosen this round ({error}); "
                          f"keeping s = {previous:g}", RuntimeWarning, stacklevel=2)
            return previous

    def heldout_scale(self, uploads: Sequence[Message], previous: float) -> float:
        """``feature_scale="heldout"``: the scale of least held-out NLL summed over this round's
        uploads (`inference.conjugate.heldout_scale.scale_from_grid`); ``previous`` when
        no upload holds a held-out example yet (round 0 has no statistics to judge)."""
        count = sum(float(u.tensors["heldout_count"].item()) for u in uploads)
        if count == 0:
            return previous
        total = torch.stack([u.tensors["heldout_nll"] for u in uploads]).sum(dim=0)
        return scale_from_grid(total)

    # ==== client half ======================================================================
    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """Train the body through the broadcast head (not in round 0), then upload the
        statistic of the training features (one client, ``torch.optim.Adam``); with
        ``feature_scale="heldout"`` first score the held-out share on the scale grid."""
        model = self.client_model(config, state)
        round = broadcast.header.round
        data, heldout = self.split_heldout(data)
        scores = (self.heldout_scores(broadcast, batched_apply(model, heldout.train_x),
                                      heldout.train_y) if heldout is not None else None)
        if round > 0:
            train_plain(model, data.train_x, data.train_y,
                        self.broadcast.training_target(broadcast, self), self.context.training,
                        generator=generator)
        features = batched_apply(model, data.train_x)
        table = self.client_statistics(data, features).cpu()
        square_sum = (self.square_sums([data], features).cpu() if self.evidence else None)
        if heldout is not None and scores is not None:  # the slice's statistics, trained body
            held_table = self.slice_statistics([heldout], batched_apply(model, heldout.train_x))
            scores = (*scores, held_table[0])
        return model_state(model), self._upload(config, data, round, table, generator,
                                                square_sum, scores)

    def split_heldout(self, data: ClientData) -> tuple[ClientData, ClientData | None]:
        """``feature_scale="heldout"``: (the client's data less its held-out share, the share
        as a ``ClientData`` whose ``train_*`` hold it); else ``(data, None)``.

        The share is a stratified ``heldout_fraction`` of the training examples, drawn once
        from the run seed and the client id (the same in every round, so the body never
        trains on it); a client with fewer than two training examples keeps them all."""
        if not self.heldout:
            return data, None
        if data.num_train < 2:
            return data, replace(data, train_x=data.train_x[:0], train_y=data.train_y[:0])
        # the split depends on the client id and its labels only: drawn once a client, then
        # reused while its labels are the same (the draw was ~40% of the rule's cost a round)
        memo = self._split_memo.get(data.client_id)
        if memo is not None and memo[0].shape == data.train_y.shape \
                and memo[0].device == data.train_y.device and torch.equal(memo[0], data.train_y):
            keep_t, held_t = memo[1], memo[2]
        else:
            rng = np.random.default_rng(derived_seed(self.context.seed, data.client_id, 29))
            keep, held = stratified_split(data.train_y.cpu().numpy(), self.heldout_fraction,
                                          rng)
            keep_t, held_t = (torch.from_numpy(np.sort(i)).to(data.train_y.device)
                              for i in (keep, held))
            self._split_memo[data.client_id] = (data.train_y.clone(), keep_t, held_t)
        return (replace(data, train_x=data.train_x[keep_t], train_y=data.train_y[keep_t]),
                replace(data, train_x=data.train_x[held_t], train_y=data.train_y[held_t]))

    def heldout_scores(self, broadcast: Message, features: Tensor, labels: Tensor
                       ) -> tuple[Tensor, Tensor]:
        """(summed held-out NLL on the scale grid (G,) float64, count (1,) float64) of a
        client's held-out ``features`` under the broadcast statistics (zeros before the first
        aggregation, which has no statistics to judge)."""
        heads = self._grid_heads(broadcast)
        count = torch.tensor([float(labels.shape[0])], dtype=torch.float64)
        if heads is None or labels.shape[0] == 0:
            return torch.zeros(len(HELDOUT_SCALE_GRID), dtype=torch.float64), count * 0
        features = self.bounded(features.to(torch.float64))
        return heldout_nll_of_heads(heads, features, labels), count

    def group_heldout_scores(self, broadcast: Message, features: Tensor,
                             labels: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """`heldout_scores` of a group's clients at once: ``features`` ``(sum V_k, m - 1)``
        their held-out rows one client after another, ``labels[k]`` ``(V_k,)``. The grid's heads
        are looked up once and every client is scored in one batched pass
        (`inference.conjugate.heldout_scale.heldout_nll_by_group`), not 33 small
        cross-entropies a client."""
        heads = self._grid_heads(broadcast)
        sizes = [int(y.shape[0]) for y in labels]
        zeros = torch.zeros(len(HELDOUT_SCALE_GRID), dtype=torch.float64)
        if heads is None:
            return [(zeros, torch.zeros(1, dtype=torch.float64)) for _ in sizes]
        features = self.bounded(features.to(torch.float64))
        nll = heldout_nll_by_group(heads, features, torch.cat(list(labels)), sizes)
        return [(nll[k].clone() if v > 0 else zeros, torch.tensor([float(v)], dtype=torch.float64))
                for k, v in enumerate(sizes)]

    def _grid_heads(self, broadcast: Message) -> Tensor | None:
        """The MAP heads (G, C, m) of the broadcast's statistics on the scale grid (as every
        client and the server solve them: privatized, wire dtype), or None while they hold no
        sample; memoised by content (every client of a round scores with the same heads)."""
        key = tensor_digest(broadcast.tensors, str(broadcast.header.round))
        if self._grid_memo is None or self._grid_memo[0] != key:
            n = float(broadcast.tensors["num_samples"].item())
            table = broadcast.tensors["statistics"].to(torch.float64)
            heads = (grid_heads(SufficientStatistics(table, round(n), privatized=True),
                                ConjugatePrior(nu=self.prior_nu)) if n > 0 else None)
            self._grid_memo = (key, heads)
        return self._grid_memo[1]

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        """`fit` of same-body clients at once: vmapped training, one stacked forward and
        one scatter for all statistics."""
        template = self.template(check_one_body(configs))
        params, buffers = stacked_tensors(template, states)
        splits = [self.split_heldout(d) for d in datas]
        datas = [kept for kept, _ in splits]
        xs, ys = [d.train_x for d in datas], [d.train_y for d in datas]
        round = broadcast.header.round
        scores: list[tuple[Tensor, ...] | None] = [None] * len(datas)
        if self.heldout:
            held = [h for _, h in splits]
            held_features = forward_stacked_tensors(template, params, buffers,
                                                    [h.train_x for h in held])
            scores = self.group_heldout_scores(broadcast, held_features,
                                               [h.train_y for h in held])
        if round > 0:
            train_stacked(template, params, buffers, xs, ys,
                          self.broadcast.training_target(broadcast, self),
                          self.context.training, generators=generators)
        features = forward_stacked_tensors(template, params, buffers, xs)
        tables = self.batch_statistics(datas, features).cpu()
        squares = (self.square_sums(datas, features).cpu() if self.evidence
                   else [None] * len(datas))
        if self.heldout:  # the slices' statistics, of the trained bodies
            held_tables = self.slice_statistics(held, forward_stacked_tensors(
                template, params, buffers, [h.train_x for h in held]))
            scores = [(*score, table) for score, table in zip(scores, held_tables,
                                                              strict=True)]
        uploads = self._uploads(configs, datas, round, tables, generators, squares, scores)
        return [(with_parameters(s, p), u) for s, p, u in zip(states, params, uploads,
                                                               strict=True)]

    def _uploads(
        self, configs: Sequence[ClientConfig], datas: Sequence[ClientData], round: int,
        tables: Tensor, generators: Sequence[torch.Generator],
        squares: Tensor | Sequence[None], scores: Sequence[tuple[Tensor, ...] | None],
    ) -> list[Message]:
        """`_upload` of K clients, the same messages (the same bytes encoded): ``tables``
        (K, C, m) converted to the upload dtype once and each client's tensors taken as rows
        of the stacks (contiguous CPU views, as `wire` gives them), instead of a
        conversion, a ``num_samples`` tensor and `wire` per client (~45 us a client,
        0.7 s at 16,000). Every message still gets its validated header and ``Message``. A
        privacy placement with its own ``release`` (noise drawn from each client's
        generator) goes client by client."""
        if type(self.privacy).release is not NoPrivacy.release:
            return [self._upload(c, d, round, t, g, q, h)
                    for c, d, t, g, q, h in zip(configs, datas, tables, generators, squares,
                                                scores, strict=True)]
        statistics = tables.detach().to("cpu", self.upload_dtype).contiguous()
        counts = torch.tensor([[d.num_train] for d in datas], dtype=torch.int64)
        square_rows = (squares.detach().to("cpu", torch.float64).reshape(-1, 1).contiguous()
                       if isinstance(squares, Tensor) else squares)
        uploads = []
        for k, (config, square, heldout) in enumerate(zip(configs, square_rows, scores,
                                                          strict=True)):
            tensors = {"statistics": statistics[k], "num_samples": counts[k]}
            if square is not None:
                tensors["square_sum"] = square
            if heldout is not None:
                tensors.update(wire(self.heldout_tensors(heldout)))
            uploads.append(Message(self.header(round, config.client_id, "up"), tensors))
        return uploads

    def _upload(
        self, config: ClientConfig, data: ClientData, round: int, table: Tensor,
        generator: torch.Generator, square_sum: Tensor | None = None,
        heldout: tuple[Tensor, ...] | None = None,
    ) -> Message:
        tensors = self.privacy.release(table, data.num_train, self.upload_dtype, generator)
        if square_sum is not None:
            tensors["square_sum"] = square_sum.reshape(1).to(torch.float64)
        if heldout is not None:
            tensors.update(self.heldout_tensors(heldout))
        return self.up_message(round, config.client_id, tensors)

    def heldout_tensors(self, heldout: tuple[Tensor, ...]) -> dict[str, Tensor]:
        """The upload tensors of a held-out slice: (its summed NLL on the scale grid, its
        count, its statistics (C, m) float64, sent in the upload dtype as the statistics are).
        """
        nll, count, table = heldout
        return {"heldout_nll": nll, "heldout_count": count,
                "heldout_statistics": table.to(self.upload_dtype)}

    def square_sums(self, datas: Sequence[ClientData], features: Tensor) -> Tensor:
        """``Q_k = sum_i ||phi_i||^2`` (K,) float64 of K clients' training ``features``
        (concatenated client after client), clamped at the feature bound as the statistics
        are: the one number of the evidence that the statistics do not hold."""
        squares = self.bounded(features.to(torch.float64)).pow(2).sum(dim=1)
        sizes = [d.num_train for d in datas]
        return torch.stack([part.sum() for part in squares.split(sizes)])

    def bounded(self, features: Tensor) -> Tensor:
        """``features`` clamped at the feature bound B (non-finite values left for the
        statistics' own check to reject)."""
        bound = self.privacy.bound
        return torch.where(features > bound, torch.full_like(features, bound), features)

    def client_statistics(self, data: ClientData, features: Tensor) -> Tensor:
        """S_c (C, m) float64 of one client's training ``features`` (n_c, m - 1), clamped at
        the feature bound."""
        features = self.bounded(features.to(torch.float64))
        stats = SufficientStatistics.from_features(features, data.train_y, self.num_classes)
        return stats.table

    def slice_statistics(self, slices: Sequence[ClientData], features: Tensor) -> Tensor:
        """The held-out slices' statistics (K, C, m) float64 on the CPU (zeros for an empty
        slice), from ``features``: their rows concatenated slice after slice."""
        if features.shape[0] == 0:
            return torch.zeros(len(slices), self.num_classes, self.m, dtype=torch.float64)
        return self.batch_statistics(slices, features).cpu()

    def batch_statistics(self, datas: Sequence[ClientData], features: Tensor) -> Tensor:
        """S_c (K, C, m) float64 of K clients at once, from ``features`` (sum_k n_k, m - 1):
        their training features concatenated client after client.

        One scatter over (client, class) rows adds the samples to each table in the order
        `SufficientStatistics.from_features` adds them, so every table is the one
        `client_statistics` gives (non-finite features fall back to it, which raises).
        """
        C = self.num_classes
        labels = torch.cat([d.train_y for d in datas])
        features, labels = checked_batch(features, labels.to(features.device), C)
        features = self.bounded(features)
        sizes = torch.tensor([d.num_train for d in datas], device=features.device)
        owner = torch.repeat_interleave(torch.arange(len(datas), device=features.device), sizes)
        rows = torch.empty(features.shape[0], self.m, dtype=torch.float64, device=features.device)
        rows[:, 0] = 1.0
        rows[:, 1:] = features
        tables = torch.zeros(len(datas) * C, self.m, dtype=torch.float64,
                             device=features.device)
        tables.index_add_(0, owner * C + labels, rows)
        if not bool(torch.isfinite(tables).all()):
            for d, f in zip(datas, features.split(sizes.tolist()), strict=True):
                self.client_statistics(d, f)  # raises for the first client with a bad feature
        return tables.view(len(datas), C, self.m)

    def head_posterior(self, broadcast: Message) -> ConjugatePosterior | None:
        """The conjugate posterior of an evaluation broadcast (None while it has no count:
        ``nu = 0`` and no statistics yet).

        The last one is memoised by the broadcast's content digest: every client of a round
        receives the same broadcast, so a process that runs many of them one by one (the
        simulator's plain loop) solves the MAP once, not once per client.
        """
        return self._memo(broadcast)[0]

    def _memo(self, broadcast: Message) -> tuple[ConjugatePosterior | None, Tensor | None]:
        """(posterior, its MC predictive draws) of a broadcast, memoised by content."""
        key = tensor_digest(broadcast.tensors, str(broadcast.header.round))
        if self._posterior_memo is None or self._posterior_memo[0] != key:
            posterior, draws = self._solve_posterior(broadcast), None
            if posterior is not None and self.predictive == "mc":
                # seeded from the run seed and the round: every client sees the same draws
                generator = torch.Generator(posterior.device).manual_seed(
                    derived_seed(self.context.seed, broadcast.header.round, 13))
                draws = posterior.sample(self.mc_samples, generator=generator)
            self._posterior_memo = (key, posterior, draws)
        return self._posterior_memo[1], self._posterior_memo[2]

    def _solve_posterior(self, broadcast: Message) -> ConjugatePosterior | None:
        table = broadcast.tensors["statistics"].to(torch.float64)
        n = float(broadcast.tensors["num_samples"].item())
        if not self.prior_nu + n > 0:
            return None
        privatized = bool(broadcast.tensors["privatized"].any())
        stats = SufficientStatistics(table, round(n), privatized=privatized)
        return ConjugatePosterior(ConjugatePrior(nu=self.prior_nu), stats,
                                  feature_scale=self.broadcast_scale(broadcast))

    def training_scale(self, broadcast: Message) -> float:
        """The scale of the head a client trains its body through: the broadcast one, but 1
        under ``feature_scale="heldout"`` (module docstring: a body trained through the
        chosen scale grows its features to undo it, and the choice chases them down)."""
        return 1.0 if self.heldout else self.broadcast_scale(broadcast)

    def broadcast_scale(self, broadcast: Message) -> float:
        """The feature scale a broadcast carries (``"evidence"``), else the fixed option
        (1 before the first aggregation of an ``"evidence"`` run)."""
        scale = broadcast.tensors.get("feature_scale")
        if scale is not None:
            return float(scale.item())
        return 1.0 if self.chooses_scale else float(self.feature_scale)

    def server_metrics(self, state: ServerState) -> dict[str, float]:
        """``feature_scale``: the scale the server chose (``feature_scale="evidence"``)."""
        if "feature_scale" not in state:
            return {}
        return {"feature_scale": float(state["feature_scale"].item())}

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        features = batched_apply(self.client_model(config, state), x)
        return self._predictives(broadcast, features)

    def predict_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> list[dict[str, Tensor]]:
        both = self.predict_rows(configs, states, broadcast, xs)
        sizes = [int(x.shape[0]) for x in xs]
        split = {k: v.split(sizes) for k, v in both.items()}
        return [{k: split[k][i] for k in both} for i in range(len(xs))]

    def predict_rows(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        broadcast: Message,
        xs: Sequence[Tensor],
    ) -> dict[str, Tensor]:
        """Both predictives of the group's rows at once: one stacked forward, one posterior
        for all clients' rows (the head is shared), kept concatenated."""
        template = self.template(check_one_body(configs))
        params, buffers = stacked_tensors(template, states)
        features = forward_stacked_tensors(template, params, buffers, xs)
        return self._predictives(broadcast, features)

    def _predictives(self, broadcast: Message, features: Tensor) -> dict[str, Tensor]:
        posterior, draws = self._memo(broadcast)
        if posterior is None:
            uniform = torch.full((features.shape[0], self.num_classes), 1.0 / self.num_classes,
                                 dtype=torch.float64)
            return {PREDICTIVE: uniform, MAP_PLUGIN: uniform}
        # rows in blocks: every row's probabilities are its own (the same numbers), and the
        # MC predictive's (draws, rows, classes) logits of a block stay in cache (16,000
        # clients' 40,000 test rows at once: 1.6 GB and 3x the time)
        features = features.to(torch.float64)
        chunks = features.split(PREDICT_ROWS) if features.shape[0] else (features,)
        return {
            PREDICTIVE: torch.cat([posterior.predict_proba(chunk, method=self.predictive,
                                                           samples=draws).cpu()
                                   for chunk in chunks]),
            MAP_PLUGIN: torch.cat([posterior.predict_proba(chunk, method="map").cpu()
                                   for chunk in chunks]),
        }

    def posterior(
        self, config: ClientConfig, state: ClientState, broadcast: Message
    ) -> ClientPosterior:
        """The conjugate posterior of the summed statistics, seen through this client's body
        (``predict_proba`` takes inputs; ``sample`` draws heads (n, C, m))."""
        head = self.head_posterior(broadcast)
        if head is None:
            raise ConfigError("the federated posterior has no data yet (prior_nu = 0 and no "
                              "statistics were aggregated)")
        return client_posterior(self.client_model(config, state), head, self.predictive,
                                input_shape=self.context.input_shape or None,
                                n_samples=self.mc_samples)


@register_strategy("fedlog-c",
                   broadcast="summed statistics, N",
                   upload="S_c, `num_samples`",
                   aggregate="as FedLog (each client solves the MAP locally, compactness loss)")
class FedLogC(FedLog):
    """FedLog-C: broadcast the statistic, local MAP solve, compactness loss.

    A fixed ``feature_scale`` applies (every client solves the MAP at it); ``"evidence"`` is
    refused: the compactness loss shrinks the training features' within-class spread by design
    (S1 of issue 25, seed 0: 0.0027 a coordinate, the test features' 0.023), so the evidence of
    the training statistics overstates s (10), and training against that head lost accuracy
    (0.903 -> 0.855) and NLL (0.53 -> 3.39).

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("alpha", float, 0.01,
               "weight of the compactness term (not reported in the paper; default 0.01)."),
        Option("feature_scale", (float, str), 1.0,
               "a fixed s > 0 (default 1, the paper's model; FedLog's held-out default is not "
               "FedLog-C's)."),
    )

    def __init__(self, context: StrategyContext, *, alpha: float = 0.01,
                 feature_scale: float | str = 1.0, **options) -> None:
        if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha >= 0):
            raise ConfigError(f"fedlog-c alpha must be a finite value >= 0, got {alpha!r}")
        options["feature_scale"] = feature_scale
        if isinstance(options.get("feature_scale"), str) \
                and options["feature_scale"] == EVIDENCE:
            raise ConfigError("fedlog-c takes a fixed feature_scale, not 'evidence': its "
                              "compactness loss shrinks the training features' within-class "
                              "spread, so their evidence overstates the scale (use fedlog for "
                              "'evidence')")
        self.alpha = float(alpha)
        super().__init__(context, **options)

    def make_broadcast(self) -> StatisticsBroadcast:
        return StatisticsBroadcast(self.alpha)


class _FedLogDP(FedLog):
    """FedLog with clamped features and Gaussian noise on the statistics.

    **Noise against signal.** After every aggregation the server compares the noise in the
    summed statistic with the largest signal it can hold
    (`inference.conjugate.privacy_signal_to_noise`: ``R`` noisy releases summed, ``K``
    clients' under local DP, 1 under central DP; class counts ``n / C``). The count is the
    released one, so the figure is post-processing of DP outputs: exact under central DP; under
    local DP the sum of the noisy count column (noise ``sigma sqrt(R C)``, a quarter of ``n``
    on digits at epsilon 16 and 10 rounds), averaged over the rounds so far (the data do not
    change between rounds). The figure is in the server state and every round's metrics as
    ``dp_noise_to_signal`` (with ``dp_sigma`` and ``dp_noise_std``); a
    `inference.conjugate.PrivacyNoiseWarning` is raised once per run when it exceeds
    0.5 (chance-level models from about 1) even with the count one standard error higher, so
    an unlucky noisy count does not raise it.

    **Noise-aware predictive** (``noise_aware=True``, default). The server tells clients the
    noise variance ``R sigma^2`` of the statistic; their posterior is
    `inference.conjugate.NoisyConjugatePosterior`: the same MAP (the head clients train
    with is unchanged), its Laplace covariance widened by the noise propagated through the MAP
    (``H^-1 + R sigma^2 H^-1 M M^T H^-1``), so the MC and probit predictives stop being
    confidently wrong when the noise dominates. ``noise_aware=False`` takes the noisy
    statistic at face value (the paper).

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    ACCOUNTANTS = ("k_round", "single")
    placement: ClassVar[type[LocalDP] | type[CentralDP]]

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("epsilon", float, 1.0,
               "the privacy budget: of the whole run (all rounds + the init round) with "
               '`accountant="k_round"`, of each release with `accountant="single"`. An epsilon '
               "whose noise would swamp even `MOST_SAMPLES` samples per class is refused, "
               "naming the smallest usable one (`epsilon=1e-300` overflowed every upload)."),
        Option("delta", float, 0.01,
               "the privacy budget: of the whole run (all rounds + the init round) with "
               '`accountant="k_round"`, of each release with `accountant="single"`. An epsilon '
               "whose noise would swamp even `MOST_SAMPLES` samples per class is refused, "
               "naming the smallest usable one (`epsilon=1e-300` overflowed every upload)."),
        Option("clip", float, 2.0,
               "the feature bound b; features are clamped to [-b, b] (after the body's ReLU)."),
        Option("accountant", str, "k_round",
               '`"k_round"` (v2 composition, default) or `"single"` (v1, per release).'),
        Option("noise_aware", bool, True,
               "whether the predictive accounts for the known noise (see above)."),
        Option("feature_scale", (float, str), 1.0,
               "1 only (the paper's model; a chosen s would need releases outside the privacy "
               "budget)."),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        epsilon: float = 1.0,
        delta: float = 0.01,
        clip: float = 2.0,
        accountant: str = "k_round",
        noise_aware: bool = True,
        feature_scale: float | str = 1.0,
        **options,
    ) -> None:
        if "feature_bound" in options:
            raise ConfigError(f"{self.name} bounds features by its clip ({clip}); set clip, "
                              "not feature_bound")
        if feature_scale != 1.0:
            raise ConfigError(f"{self.name} keeps feature_scale = 1: the evidence needs every "
                              "client's squared feature norms, a release its privacy budget "
                              "does not cover")
        for option, value in (("epsilon", epsilon), ("delta", delta), ("clip", clip)):
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise ConfigError(f"{self.name} {option} must be a finite number, got "
                                  f"{value!r}")
        if not (epsilon > 0 and 0 < delta < 1 and clip > 0):
            raise ConfigError("DP needs epsilon > 0, 0 < delta < 1 and clip > 0; got "
                              f"epsilon={epsilon}, delta={delta}, clip={clip}")
        if accountant not in self.ACCOUNTANTS:
            raise ConfigError(f"DP accountant must be one of {', '.join(self.ACCOUNTANTS)}; "
                              f"got {accountant!r}")
        if not isinstance(noise_aware, bool):
            raise ConfigError(f"{self.name} noise_aware must be true or false, got "
                              f"{noise_aware!r}")
        self.epsilon, self.delta, self.clip = float(epsilon), float(delta), float(clip)
        self.accountant = accountant
        self.noise_aware = noise_aware
        releases = context.rounds + (1 if self.init_round else 0)
        self.sigma = gaussian_sigma(self.epsilon, self.delta, rounds=releases,
                                    feature_dim=context.feature_dim, bound=self.clip,
                                    composition=accountant)
        self._check_budget(context, releases)  # before any model is built
        self._noise_warned = False
        super().__init__(context, feature_scale=1.0, **options)

    def _noise_to_signal(self, context: StrategyContext, sigma: float) -> float:
        """Noise-to-signal of the summed statistic with `MOST_SAMPLES` samples per class
        (every client's release summed under local DP): the least noise ``sigma`` can mean."""
        if not math.isfinite(sigma):
            return math.inf
        return privacy_signal_to_noise(
            sigma, MOST_SAMPLES, feature_dim=context.feature_dim, bound=self.clip,
            clients=context.clients,
            placement="central" if self.placement.sends_num_samples else "local").noise_to_signal

    def _check_budget(self, context: StrategyContext, releases: int) -> None:
        """Refuse an epsilon whose noise swamps the statistics of any data set (noise-to-signal
        above 1 even at `MOST_SAMPLES` samples per class): every model would be chance
        level, and a tiny epsilon overflows the uploads so that every one is rejected. The
        message gives the smallest epsilon out of that range (found by bisection: sigma falls
        as epsilon grows); the noise-to-signal warning covers the budgets above it."""
        if self._noise_to_signal(context, self.sigma) <= SWAMPED_RATIO:
            return

        def sigma(epsilon: float) -> float:
            return gaussian_sigma(epsilon, self.delta, rounds=releases,
                                  feature_dim=context.feature_dim, bound=self.clip,
                                  composition=self.accountant)

        low, high = math.log(self.epsilon), math.log(1e6)
        for _ in range(100):
            middle = (low + high) / 2
            if self._noise_to_signal(context, sigma(math.exp(middle))) > SWAMPED_RATIO:
                low = middle
            else:
                high = middle
        step = 10.0 ** (math.floor(math.log10(math.exp(high))) - 1)
        smallest = math.ceil(math.exp(high) / step) * step  # two digits, rounded up: accepted
        # a float32 upload holds noise up to ~3e38: beyond, every local-DP upload is rejected
        overflow = (" (and its uploads would overflow float32 and all be rejected)"
                    if not self.placement.sends_num_samples and self.sigma > 1e37 else "")
        raise ConfigError(
            f"{self.name} epsilon={self.epsilon:g} is out of range: its Gaussian noise (sigma "
            f"{self.sigma:.3g} per cell of each release, delta {self.delta:g}, {releases} "
            f"releases) is larger than the statistics of even {MOST_SAMPLES:g} samples per "
            f"class, so every model would be chance level{overflow}; use epsilon >= "
            f"{smallest:.2g} for this run (a warning tells when the noise still degrades "
            "the model; budgets of 0.1 to 10 are usual)")

    def make_privacy(self) -> NoPrivacy:
        return self.placement(self.sigma, self.clip)

    # ---- server half: the noise in the summed statistic ---------------------------------
    def init(self) -> ServerState:
        zero = torch.zeros(1, dtype=torch.float64)
        return super().init() | {"noise_variance": zero, "dp_noise_to_signal": zero.clone(),
                                 "dp_count_sum": zero.clone(), "dp_count_releases": zero.clone()}

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """FedLog's aggregation, then the noise variance of the summed statistic and its
        noise-to-signal figure (warned about once per run when it is too high)."""
        new = super().aggregate(state, uploads, round, generator)
        if new is state:
            return state
        releases = self.releases(new, uploads)
        count, standard_error = float(new["num_samples"].item()), 0.0
        zero = torch.zeros(1, dtype=torch.float64)
        new["dp_count_sum"] = state.get("dp_count_sum", zero)
        new["dp_count_releases"] = state.get("dp_count_releases", zero)
        if not self.privacy.sends_num_samples:  # local DP: average the noisy counts
            new["dp_count_sum"] = new["dp_count_sum"] + count
            new["dp_count_releases"] = new["dp_count_releases"] + 1
            times = float(new["dp_count_releases"].item())
            count = float(new["dp_count_sum"].item()) / times
            standard_error = self.sigma * math.sqrt(releases * self.num_classes / times)
        report = self.noise_report(count, releases)
        new["noise_variance"] = torch.tensor([report.noise_std**2], dtype=torch.float64)
        new["dp_noise_to_signal"] = torch.tensor([report.noise_to_signal], dtype=torch.float64)
        if not self._noise_warned and self.noise_report(count + standard_error, releases).warns:
            self._noise_warned = report.warn(stacklevel=2)
        return new

    def releases(self, state: ServerState, uploads: Sequence[Message]) -> int:
        """How many noisy releases the summed statistic of ``state`` holds: every summed
        client's under local DP (this round's uploads, or every cached client's with
        ``absent_clients="latest"``), one under central DP."""
        if not self.privacy.noisy or self.privacy.sends_num_samples:
            return 1  # central: the server adds the noise once to the sum
        if self.absent_clients == "latest":
            return int(state[PRESENT].sum())
        return len(uploads)

    def noise_report(self, num_samples: float, releases: int) -> DPNoiseReport:
        """The noise-to-signal report of a summed statistic of ``num_samples`` samples (class
        counts taken as ``num_samples / C``, at least 1 in all) and ``releases`` noisy
        releases."""
        return privacy_signal_to_noise(
            self.sigma, max(num_samples, 1.0) / self.num_classes, feature_dim=self.feature_dim,
            bound=self.clip, clients=releases,
            placement="central" if self.privacy.sends_num_samples else "local")

    def server_metrics(self, state: ServerState) -> dict[str, float]:
        """``dp_noise_to_signal``, ``dp_sigma`` (per release) and ``dp_noise_std`` (per cell
        of the summed statistic) of the server state."""
        return {"dp_noise_to_signal": float(state["dp_noise_to_signal"].item()),
                "dp_sigma": self.sigma,
                "dp_noise_std": math.sqrt(float(state["noise_variance"].item()))}

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """FedLog's evaluation broadcast plus ``noise_variance`` (float64 (1,)): the variance
        of the noise in each cell of the summed statistic."""
        message = super().configure_evaluation(state, round)
        return self.down_message(round, {**message.tensors,
                                         "noise_variance": state["noise_variance"]})

    # ---- client half: the noise-aware posterior ----------------------------------------
    def _solve_posterior(self, broadcast: Message) -> ConjugatePosterior | None:
        posterior = super()._solve_posterior(broadcast)
        variance = broadcast.tensors.get("noise_variance")
        if posterior is None or not self.noise_aware or variance is None:
            return posterior
        noise_variance = float(variance.item())
        if not noise_variance > 0:
            return posterior
        return NoisyConjugatePosterior(
            posterior.prior, posterior.statistics, noise_variance,
            count_from_noise=not self.privacy.sends_num_samples)


def checked_feature_scale(value: object) -> float | str:
    """FedLog's ``feature_scale`` option: a finite number > 0 (as a float), ``"evidence"`` or
    ``"heldout"``.

    Raises:
        ConfigError: anything else, with what is accepted.
    """
    if isinstance(value, str) and value in (EVIDENCE, HELDOUT):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"feature_scale must be a finite number > 0 (1 is the paper's model) "
                          f"or {EVIDENCE!r} / {HELDOUT!r} (chosen by the server from the summed "
                          "statistics or the clients' held-out NLL), "
                          f"got {value!r}")
    return float(value)


def square_sum_problems(tables: Tensor, square_sums: Tensor, bound: float) -> list[str | None]:
    """Invariants of K uploads' ``square_sum`` Q (K,) float64 beside their clean ``tables``
    (K, C, m) float64: per upload None or the first violated one of: Q finite; Q at least
    ``sum_y ||S_y||^2 / n_y`` over the feature columns (Cauchy-Schwarz: a class's squared
    norms sum to at least its count times its squared mean); Q at most ``n d B^2``."""
    counts = tables[:, :, 0]
    sums = tables[:, :, 1:]
    least = (sums.pow(2).sum(2) / counts.clamp(min=1)).sum(1)
    most = counts.sum(1) * sums.shape[2] * bound**2
    reasons: list[str | None] = []
    for q, low, high in zip(square_sums.tolist(), least.tolist(), most.tolist(), strict=True):
        if not math.isfinite(q):
            reasons.append(f"square_sum is {q}, not a finite number")
        elif q < low * (1 - 1e-6):  # float32 statistics: 6e-8 relative rounding per entry
            reasons.append(f"square_sum {q:.6g} is below {low:.6g}, the least the feature sums "
                           "allow (sum over classes of |S_y|^2 / n_y)")
        elif q > high * (1 + 1e-6):
            reasons.append(f"square_sum {q:.6g} exceeds {high:.6g}: num_samples x feature "
                           f"dimension x the feature bound {bound:g} squared")
        else:
            reasons.append(None)
    return reasons


def client_id_problems(ids: Sequence[int], clients: int) -> list[str | None]:
    """Per upload, a reason when its client id is not one of the run's ``clients`` (the
    server's per-client tensors have a row for each of those only)."""
    return [None if 0 <= cid < clients else
            f"client id {cid} is not one of this run's clients (0 to {clients - 1})"
            for cid in ids]


def declared_count_problems(declared: Tensor, ids: Sequence[int], counts: Tensor
                            ) -> list[str | None]:
    """Per upload, a reason if its sample count (``counts`` (K,) int64) exceeds the first one
    its client declared (``declared`` (N,) int64 by client id, 0 where none was accepted yet;
    ids out of range are left to `client_id_problems`): the check and the words of
    `bayesfl.strategies.robust.declared_problems`, over the stacked ledger."""
    reasons: list[str | None] = [None] * len(ids)
    index = torch.tensor(ids, dtype=torch.int64)
    inside = (index >= 0) & (index < declared.shape[0])
    first = torch.zeros_like(counts)
    first[inside] = declared[index[inside]]
    for k in ((first > 0) & (counts > first)).nonzero().flatten().tolist():
        reasons[k] = (f"num_samples {int(counts[k])} exceeds the {int(first[k])} this client "
                      "declared in its first accepted upload")
    return reasons


def median_class_means(tables: Tensor) -> Tensor:
    """Statistics (K, C, m) whose per-class feature sums are replaced by ``n_{k,y}`` times the
    coordinate-wise median of the class means of the clients holding class y, so their sum
    over clients is ``n_y`` times that median; counts are unchanged."""
    robust = tables.clone()
    counts = tables[:, :, 0]
    for y in range(tables.shape[1]):
        holders = counts[:, y] > 0
        if not bool(holders.any()):
            continue
        means = tables[holders, y, 1:] / counts[holders, y, None]
        robust[:, y, 1:] = counts[:, y, None] * coordinate_median(means)[None, :]
    return robust


@register_strategy("fedlog-dp-local",
                   broadcast="MAP head W",
                   upload="noisy S_c (no count)",
                   aggregate="noisy counts and sums summed")
class FedLogLocalDP(_FedLogDP):
    """FedLog with local differential privacy (each client perturbs its own statistic)."""

    placement = LocalDP


@register_strategy("fedlog-dp-central",
                   broadcast="MAP head W",
                   upload="clean S_c, `num_samples`",
                   aggregate="sum, plus noise once")
class FedLogCentralDP(_FedLogDP):
    """FedLog with central differential privacy (the server perturbs the sum once)."""

    placement = CentralDP


def heldout_problem(nll: Tensor, count: Tensor, num_samples: float) -> str | None:
    """Why a ``feature_scale="heldout"`` upload's scores are impossible, or None.

    Honest scores are finite and >= 0 (sums of -log of probabilities), all 0 with no held-out
    example, and the count is a whole number no larger than the training examples the client
    kept (``heldout_fraction`` < 1/2). Within these a client can still bias the scale, as any
    participant can bias the summed statistics."""
    value = float(count.item())
    if not (math.isfinite(value) and value >= 0 and value == round(value)):
        return f"heldout_count must be a whole number >= 0, got {value!r}"
    if value > num_samples:
        return (f"heldout_count {value:g} exceeds the {num_samples:g} training examples kept: the "
                "held-out share is under half of a client's examples")
    if not bool(torch.isfinite(nll).all()) or bool((nll < 0).any()):
        return "heldout_nll must be finite and >= 0 (sums of -log probabilities)"
    if value == 0 and bool((nll != 0).any()):
        return "heldout_nll must be 0 with no held-out example"
    return None
