r"""FedSI (Chen et al. 2024, "Federated Subnetwork Inference"): a Bayesian FedBABU.

Paper: [FedSI: Federated Subnetwork Inference for Efficient Uncertainty
Quantification](https://arxiv.org/abs/2404.15657) (arXiv 2404.15657; the section numbers below
are its, e.g. "III-B"). The client network is `ClassifierNet`: a
shared body theta (every ``body.*`` parameter, |R| of them, flattened in ``model.body.parameters()``
order) and a personal linear head phi.

**Server** (section III-B, "Global Aggregation"). It keeps a diagonal Gaussian
$\mathcal{N}(\mu, \mathrm{diag}(g))$ over the body: $\mu$ starts at the body's initialisation
(one init seed per body spec), $g$ at ``prior_var`` ($\alpha$) for every entry (Algorithm 1's
"Initialize"; the paper gives no values). It broadcasts ``mean`` and ``variance`` (float32, |R|
each) and aggregates the uploads: ``mu`` = the mean of the clients' means; the variances by
``aggregation`` (below), entries no client made stochastic reset to alpha, then clamped to
``[variance_floor, alpha]``.

**Client round** (sections III-A, steps 1-3, and III-B, "Local Updating"). Warm start
$\theta = \mu$; ``local_epochs`` of Adam (``local_lr``, the run's batch size, one optimiser
state for the whole round) on the body only, the head frozen at its initial value $\phi^0$,
minimising (the broadcast Gaussian as prior, `prior_penalty`)

$$\overline{\mathrm{CE}} + \frac{1}{2n} \sum_r \frac{(\theta_r - \mu_r)^2}{g_r};$$

Then, in eval mode at the MAP,
`inference.subnet.select_subnet` picks the |S| body entries of largest diagonal-Laplace
variance $1 / (\mathrm{diag}\,\mathrm{GGN} + 1/g)$ and `inference.subnet.fit_subnet_laplace`
fits the dense |S| x |S| GGN Laplace with prior precision ``1/g_S`` (GGN summed over the client's
training set). Upload: ``mean`` (the MAP of every body entry, float32 (|R|,)), ``std``
(marginal posterior standard deviations, float32 (|R|,), **exactly zero outside the subnet**),
``subnet`` (the declared indices, int32 (|S|,), sorted) and ``num_samples``. The head and
the covariance never leave the client.

**Personalisation** (section III-A, step 4; after training and for a novel client that never
trained): the body is fixed at the global mean, the head is fine-tuned from phi^0
(``finetune_epochs`` of Adam at ``finetune_lr``, the run's batch size, body frozen), then the subnet
is selected again and the Laplace refitted at $(\mu, \phi_{\mathrm{fin}})$ with prior precision
$1/g$ (fine-tune first: the paper lists the Laplace step first, but Eq. 17 takes the Jacobian at
$\phi_{\mathrm{fin}}$). Prediction: ``{"predictive": GLM predictive (probit, or MC with
predictive="glm_mc"), "map_plugin": softmax(f(x; mu, phi_fin))}``. Rounds before personalisation
evaluate the global mean with the client's initial head (FedBABU's "before fine-tuning"); there is
no client posterior then, so both keys hold that softmax.

**FedSI-Fac** (``fedsi-fac``, a baseline of the paper's section IV): ``posterior="diag_all"``: a
diagonal GGN Laplace over every body entry (`inference.subnet.DiagonalLaplacePosterior`), all
standard deviations sent (no ``subnet`` tensor), diagonal GLM predictive.

**FedSI-Fac's predictive against its plug-in** (digits, 5 iid clients, 3 rounds, seed 0, one
thread): ECE 0.427 / NLL 0.864 against the plug-in's 0.059 / 0.336 (seeds 1 and 2: 0.405 /
0.774 and 0.396 / 0.826 against 0.057 / 0.305 and 0.034 / 0.380; with ``alpha_selection=
"evidence"``: 0.427 / 0.848, 0.395 / 0.792, 0.364 / 0.803 against 0.030 / 0.308, 0.030 /
0.318, 0.028 / 0.447). The posterior is what it should be: its GGN diagonal agrees with
laplace-torch's ``DiagLaplace`` on the personalised network to 1e-7 relative and its probit
predictive gives the same ECE to four digits. Two things make it worse than the plug-in here.
The plug-in is under-confident already (confidence 0.852 at accuracy 0.911), and the probit
predictive only shrinks logits (kappa <= 1). And a diagonal posterior over all 23,050 body
weights is nearly its prior in this regime (the GGN diagonal's median is 0.5 against a prior
precision of 1/alpha = 100), so every weight keeps a variance near alpha = 1e-2 and the logit
variances add up to 7-61 (median 22, kappa 0.2-0.5); a Kronecker-factored Laplace with the same
prior (laplace-torch) gives ECE 0.21 on the client where the diagonal gives 0.44: the
factorisation ignores that the data pin down functions of the weights, not weights one by one.
Scaling the personalised posterior's precision moves the predictive monotonically towards the
plug-in and never past it (x3: ECE 0.278, x10: 0.151, x30: 0.094, x100: 0.073). After 10
rounds the gap is smaller (ECE 0.156 / NLL 0.421 against 0.026 / 0.299; x30: 0.027 / 0.300,
the plug-in's). With an over-confident plug-in (``finetune_stop="fixed"``, 300 epochs:
confidence 0.920 at accuracy 0.909, ECE 0.027; with evidence 0.951 at 0.924) the predictive's
ECE is 0.470 (0.506): the spread is far more than any plug-in needs. The evidence does not ask
for a tighter prior (alpha = 0.021, 0.037-0.038, 0.046-0.048 in the three rounds); the paper's
alpha = 1e-4 narrows the gap (ECE 0.226 against 0.189) but the body barely learns (accuracy
0.79; 1e-3: 0.78, ECE 0.357 against 0.155). FedSI's subnet posterior (5% of the body, full
covariance) in the same run adds almost nothing to its plug-in: ECE 0.059 / NLL 0.332 against
0.057 / 0.332.

Options: every point the paper leaves open is one, with a recommended default, declared
with its meaning in ``FedSI.OPTIONS`` (``bayesfl strategies fedsi`` lists them; so does the
options table of the docs' FedSI page).

Fine-tuning defaults: the paper gives no epochs or learning rate for step 4 (section III-A); we
tried 5-10 epochs at lr 1e-3 to 1e-2. Measured on
digits (5 clients, ``shards:2``, body ``mlp``, feature_dim 16, 3 rounds, batch 64): 5 epochs
at 1e-3 left the random head nearly untouched (accuracy 0.15), 5 at 1e-2 gave 0.88 and 10 at
1e-2 gave 0.92 (NLL 0.63 -> 0.42), hence 10 at 1e-2.

Since then the fine-tuning length is chosen per client by held-out NLL
(`bayesfl.strategies.head_tuning`; ``finetune_epochs`` is its upper bound): with a fixed
count, 10 epochs left the plug-in under-confident on the paper's MNIST setting and 300
over-confident, so the constant, not the data, decided the calibration.

The Laplace runs every round (``laplace_every = 1``, the paper's schedule; no option).

**The local MAP** (``map_solver``). The paper trains the body with Adam at 1e-2 on
``CE + prior``. Adam normalises each coordinate's step to about ``lr``; with the paper's prior
variance 1e-4 the prior std is 1e-2 = ``lr``, so the prior's gradient makes every coordinate
oscillate by about one prior std around the broadcast mean. Measured on mnist-5k (one S1
client, round 1): the round ends at objective 3.86, above its start (2.33), while the MAP
(L-BFGS) is 2.261 at distance 0.057 from ``mu``; Adam ended 0.239 away. Each round thus added
noise of the size of the weights' scale, and the federated body got *worse* with rounds (S1,
subnet of 400: fine-tuned accuracy 0.863 after round 1, 0.709 after 25). ``"proximal"`` takes
Adam's step on the CE and then solves the prior's term exactly
(`bayesfl.training.GaussianProx`): same objective, same MAP (2.26095 after the round's
25 steps), stable for any prior; the same run then rises every round (0.857 -> 0.899 after
25). ``"adam"`` keeps the paper's literal recipe. A group of clients (`FedSI.fit_group`, the
simulator's batched fit) trains its proximal MAPs together, one vmapped gradient of all of them
a step (`bayesfl.training.train_batched` with each client's prior as its prox): the same
shuffles and the same MAPs as client by client up to float rounding. On S1 (10 clients, 25
steps) that is ~0.20 CPU-s a round against 0.27 one by one: the arithmetic (the matrix
products, Adam's and the prior's passes over 78,500 weights a client) is most of the cost,
not the per-step dispatch; the prior's step runs on each cache-sized slice right after its
Adam update and reads that update's denominator (four passes, not eight: 0.23 -> 0.20), and
the vmapped weight gradient's product, computed in the transposed layout, is 3x the plain
one's.

**The prior's variance** (``prior_var``, alpha). The paper sets alpha = 1e-4 (a prior std of
0.01, precision 1e4 per weight against n = 250 samples): even with the exact local MAP the body
moves only ~0.06 (L2 over 78,500 weights) a round and learns slowly. S1 (mnist-5k, 10 clients
x 5 labels, 250 images each, 30 rounds x 5 epochs, 3 seeds; README "Results"), per-round
accuracy after rounds 1 / 5 / 15 / 30 and the final NLL: alpha = 1e-4 0.880 / 0.882 / 0.898 /
0.910, NLL 0.296; 1e-2 0.909 / 0.922 / 0.929 / 0.932, NLL 0.245; 1e-1 0.919 / 0.928 / 0.934 /
0.941, NLL 0.272. 1e-2, the best calibrated, is the default; 1e-4 stays available as the
paper's value.

**Prior variance by federated evidence** (``alpha_selection="evidence"``, not in the paper).
Each client, at its local MAP ``theta`` and with the diagonal GGN ``h`` of its data over the
body (the one subnet selection computes anyway), reports the Laplace log evidence of the prior
``N(mu, alpha I)`` on the fixed grid `ALPHA_GRID` (49 float64, 392 bytes an upload):
``-||theta - mu||^2 / (2 alpha) - (1/2) sum_r log(1 + alpha h_r)`` (`alpha_log_evidence`;
the alpha-free ``log p(D | theta)`` is dropped). The clients' likelihoods are independent given
the shared prior, so the sum is the federation's evidence of alpha; the server takes its
maximiser (`inference.log_grid.argmin_on_log_grid`) as the next round's alpha: the base
prior of the aggregated Gaussian (`rebase_prior`): an entry nobody made stochastic gets
alpha, every other keeps the precision the clients' data added to the old base prior,
``1 / g = (1 / g_agg - 1 / alpha_old) + 1 / alpha`` (``fedsi_alpha`` in every round's metrics).
(alpha used to only reset the former and cap the latter; for FedSI-Fac, whose every entry is
stochastic with a variance below the old alpha, a larger alpha then changed nothing: evidence
and fixed alpha gave the same figures to the last digit; now, on digits with 5 iid clients,
FedSI-Fac's alpha rises 1e-2 -> 0.021 -> 0.037-0.038 -> 0.046-0.048 in 3 rounds (seeds 0-2),
where it read 0.021, 0.020, 0.019 while it never reached the prior.) Followed further (seeds 0
and 1; FedSI's subnet at seed 0 within 8% through round 7) it peaks and falls, converging to no
fixed point: 0.021, 0.038, 0.047-0.048, 0.037-0.038, 0.023, 0.013 in rounds 1-6, then
7.5e-3-7.7e-3, 4.7e-3-4.9e-3, 2.9e-3-3.0e-3, 2.0e-3-2.2e-3, 1.5e-3-1.6e-3 (rounds 7-11),
5.3e-4-6.2e-4 at round 15 (x0.6-0.8 a round, still falling: towards the paper's 1e-4), the
round's plug-in meanwhile ECE 0.10-0.12 -> 0.021-0.031 at round 6, NLL 0.39-0.50 -> 0.29-0.33,
then ECE 0.017-0.053, NLL 0.25-0.39 in rounds 7-15 (round-to-round noise, no trend yet). After
15 rounds the small alpha has shrunk the variances and FedSI-Fac's predictive is its plug-in
(ECE 0.031 / 0.039, NLL 0.322 / 0.317 against 0.031 / 0.040, 0.325 / 0.331; FedSI 0.035 / 0.326
both). The chosen alpha is MacKay's effective-parameter form ``||theta - mu||^2 = alpha gamma``,
``gamma = sum_r alpha h_r / (1 + alpha h_r)`` (15-160 of 23,050: the data are weak, so alpha ~
sqrt(||theta - mu||^2 / sum_r h_r), to 2% in rounds 1-7), and ``theta - mu`` is one round's move
from the re-centred mean: it rises while the clients still move together (``||theta - mu||^2``
0.28 -> 6.6 at ``sum h`` 630 -> 3,100) and falls once their modes meet (5.6, 2.3, 0.73, 0.23 at
``sum h`` ~4,200), the fall described below. This is MacKay's evidence
update at the current mode, one step per round; the mode itself is the MAP under the round's
prior.
Measured on S1, seed 0, CPU, before that change (alpha as a cap; FedSI's subnet leaves ~95% of
the entries at alpha either way): with 1 local
epoch a round alpha went 1e-2 -> 0.018 -> 0.022 in two rounds (near the default chosen by the
test NLL above); with S1's 5 epochs it fell every round, 1e-2 -> 9.8e-3, 7.5e-3, 5.7e-3,
4.5e-3, 3.7e-3 (x0.78 a round), at accuracy 0.920 / NLL 0.256 / ECE 0.015 after 5 rounds
(the fixed 1e-2: 0.919 / 0.253 / 0.012, same seed and CPU;
``bench/results/s1_5_cpu_fedsi_evidence.jsonl``). The fall is the update's
known weakness here, not noise: the mode is solved under the prior being judged and the mean
is re-centred on the clients every round, so as they agree ``||theta - mu||`` shrinks and the
evidence asks for a tighter prior, which keeps the next modes closer still. Followed for 30
rounds it would reach the paper's slow-learning 1e-4 regime; hence not the default.

**Per-round figures** (`FedSI.evaluate_group`). The client's head is frozen at phi^0
until personalisation, so evaluating the global body with it measures a random classifier
(chance). Every round instead fine-tunes each client's head on the current global mean (as
personalisation does, without the Laplace) and reports that plug-in under both keys: the
figures a user would get by stopping now, before the posterior. ``round_view`` in the
metrics says so.

**Product aggregation** (``aggregation="product"``, not in the paper). Per entry r, the
clients that made r stochastic contribute ``N(mu_ir, s_ir^2)``; the new variance is
``1 / sum_i s_ir^-2`` over them (each client's posterior already contains the broadcast prior,
which is *not* divided out: the product is a plain product of the uploaded Gaussians) and the
new mean is the precision-weighted mean, in which a client that kept r deterministic weighs
``1 / g_r`` (it claims nothing beyond the prior there). Entries nobody made stochastic get the
plain mean and alpha, as in the paper's rule.

**What an honest upload satisfies** (`FedSI.upload_problems`, each failure named):
``num_samples >= 1`` and not above the client's first declared count; the declared subnet
sorted, unique and inside the body; every ``std`` >= 0; ``std`` exactly 0 outside the declared
subnet and > 0 inside it (the posterior precision is positive definite); ``std`` at most the
broadcast prior std (a Laplace marginal variance ``[(H + D)^-1]_rr <= D^-1_rr`` for a
PSD GGN H; relative slack 1e-3 for float32 rounding); the mean's distance to ``mu`` within
``screening_ratio`` times the round's median. The subnet size is fixed by the schema
(``subnet`` has shape (|S|,)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.posterior import client_posterior
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
    seeded_rng,
)
from bayesfl.strategies.head_tuning import HEAD_STOPS, HeadTuning, tune_head, tune_heads
from bayesfl.strategies.networks import ClassifierNet, batched_apply, cross_entropy_per_sample
from bayesfl.strategies.options import option_integer, option_number
from bayesfl.strategies.probabilistic_head import (
    ProbabilisticHead,
    head_features,
    head_from_options,
    head_posterior,
    with_head_posterior,
)
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.robust import (
    count_problems,
    declarations,
    first_reasons,
    screening_reasons,
)
from bayesfl.strategies.uploads import NUM_SAMPLES_SPEC, num_samples_tensor
from bayesfl.training import GaussianProx, LocalTraining, train_batched, train_plain
from inference.log_grid import argmin_on_log_grid, geometric_grid
from inference.subnet import (
    SubnetLaplacePosterior,
    fit_subnet_laplace,
    rank_by_variance,
    select_subnet,
)
from inference.subnet.diagonal import diagonal_ggn
from inference.subnet.diagonal_posterior import DiagonalLaplacePosterior, fit_diagonal_laplace
from inference.subnet.fit import subnet_laplace_state
from inference.subnet.lowrank import (
    LOWRANK_KEYS,
    lowrank_ggn,
    lowrank_predict_proba,
    subnet_lowrank_posterior,
    subnet_marginal_variance,
)
from inference.subnet.parameters import check_subnet_indices, resolve_subnet_size

POSTERIORS = ("subnet_full", "subnet_diag", "diag_all")
AGGREGATIONS = ("mean_std", "mean_var", "mean_nonzero", "moment_match", "product")
WEIGHTS = ("uniform", "n_i")
HEAD_INITS = ("shared", "per_client")
EVAL_SELECTIONS = ("diag_laplace", "global_var")
PREDICTIVES = ("glm_probit", "glm_mc")
MAP_SOLVERS = ("proximal", "adam")
ALPHA_SELECTIONS = ("fixed", "evidence")
ALPHA_GRID: tuple[float, ...] = geometric_grid(-48, 0, 8, 10.0)
"""Prior variances a client scores with ``alpha_selection="evidence"``: ``10^(k/8)``,
``k = -48 .. 0`` (1e-6 to 1, eight a decade: 49 float64 numbers an upload)."""
PERSONALIZED = "personalized"
"""Client-state key set by `FedSI.personalize`."""
ROUND_VIEW = "round_view"
"""Key of the transient state `FedSI.evaluate_group` evaluates before personalisation."""
POSTERIOR_PREFIX = "posterior."
LOWRANK_PREFIX = "lowrank."
"""Prefix of the personal posterior's truncated Woodbury factors (`FedSI.personalize`)."""
STD_TOLERANCE = 1e-3
"""Relative slack of the ``std <= prior std`` check: float32 rounding of the broadcast
variance and of the uploaded std is ~1e-7; 1e-3 only has to separate rounding from a lie."""


Posterior = SubnetLaplacePosterior | DiagonalLaplacePosterior


def _body(name: str) -> bool:
    """The local MAP's trainable parameters: the body (the head stays frozen at phi^0)."""
    return name.startswith("body.")


def prior_penalty(theta: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    """``0.5 * sum_r (theta_r - mean_r)^2 / variance_r``: minus the log density of the
    broadcast Gaussian prior up to a constant. All (|R|,); returns a scalar."""
    return 0.5 * ((theta - mean).square() / variance).sum()


def alpha_log_evidence(theta: Tensor, mean: Tensor, diag: Tensor,
                       grid: tuple[float, ...] = ALPHA_GRID) -> Tensor:
    """A client's log evidence of the prior ``N(mean, alpha I)`` on its body, at every alpha of
    ``grid``, up to terms that do not depend on alpha (``alpha_selection="evidence"``).

    The Laplace approximation at the client's local MAP ``theta`` with the diagonal GGN
    ``diag`` ``h`` of its data (MacKay's evidence at the current mode):
    ``log Z(alpha) = log p(D | theta) - ||theta - mean||^2 / (2 alpha) - (R/2) log alpha
    - (1/2) sum_r log(h_r + 1/alpha) + const = -||theta - mean||^2 / (2 alpha)
    - (1/2) sum_r log(1 + alpha h_r) + const``. Each term is <= 0.

    Args:
        theta, mean: (R,) the local MAP and the broadcast prior mean; diag: (R,) >= 0.

    Returns:
        (len(grid),) float64 on the CPU.
    """
    distance = (theta.to(torch.float64) - mean.to(torch.float64)).square().sum()
    h = diag.to(torch.float64).clamp_min(0)
    alphas = torch.tensor(grid, dtype=torch.float64, device=h.device)
    log_det = torch.log1p(alphas[:, None] * h[None, :]).sum(1)
    return (-distance / (2 * alphas) - 0.5 * log_det).cpu()


def evidence_problem(log_evidence: Tensor) -> str | None:
    """Why an uploaded ``log_evidence`` is impossible, or None: honest values are finite and
    <= 0 (both terms of `alpha_log_evidence` are). Within that a client can still pull
    alpha, as any participant can pull the mean."""
    if not bool(torch.isfinite(log_evidence).all()):
        return "log_evidence must be finite"
    if bool((log_evidence > 0).any()):
        return "log_evidence must be <= 0 (its terms are -distance / (2 alpha) and -log det / 2)"
    return None


def body_vector(model: nn.Module) -> Tensor:
    """The body's parameters as one flat vector (|R|,) (``model.body.parameters()`` order)."""
    return parameters_to_vector(model.body.parameters()).detach().clone()


def aggregate_gaussians(
    means: Tensor,
    stds: Tensor,
    weights: Tensor,
    prior_variance: Tensor,
    *,
    rule: str,
    alpha: float,
    floor: float,
) -> tuple[Tensor, Tensor]:
    """The server's new ``(mean, variance)`` from K uploads (module docstring).

    Args:
        means, stds: (K, R) float64 uploads.
        weights: (K,) non-negative weights summing to 1 (means of every rule but "product").
        prior_variance: (R,) the variances broadcast this round (the "product" rule weighs a
            deterministic client's mean by their inverse).
        rule: one of `AGGREGATIONS`.
        alpha: the base prior variance (entries nobody made stochastic; the upper clamp).
        floor: the lower clamp of the variances.

    Returns:
        ``(mean (R,), variance (R,))`` float64.
    """
    stochastic = stds > 0
    anyone = stochastic.any(0)
    w = weights.to(means.dtype).view(-1, 1)
    if rule == "product":
        precision = torch.where(stochastic, stds.square().reciprocal(),
                                prior_variance.reciprocal().expand_as(stds))
        mean = (precision * means).sum(0) / precision.sum(0)
        stochastic_precision = torch.where(stochastic, precision, torch.zeros_like(precision))
        variance = stochastic_precision.sum(0).reciprocal()  # inf where nobody: reset below
    else:
        mean = (w * means).sum(0)
        if rule == "mean_std":
            variance = (w * stds).sum(0).square()
        elif rule == "mean_var":
            variance = (w * stds.square()).sum(0)
        elif rule == "mean_nonzero":
            chose = w * stochastic
            variance = (chose * stds.square()).sum(0) / chose.sum(0).clamp_min(1e-300)
        elif rule == "moment_match":
            variance = (w * (stds.square() + means.square())).sum(0) - mean.square()
        else:
            raise ConfigError(f"unknown aggregation {rule!r}; valid: {', '.join(AGGREGATIONS)}")
    variance = torch.where(anyone, variance, torch.full_like(variance, alpha))
    return mean, variance.clamp(min=floor, max=alpha)


def rebase_prior(variance: Tensor, old_alpha: float, new_alpha: float, *,
                 floor: float) -> Tensor:
    """The aggregated variances with their base prior variance ``old_alpha`` replaced by
    ``new_alpha``: ``1 / (1 / v - 1 / old_alpha + 1 / new_alpha)``, i.e. the precision the
    clients' data added (``1 / v - 1 / old_alpha`` >= 0, the likelihood term) kept and the prior
    term swapped (the project's contract: prior + likelihood terms, kept apart). Entries at
    ``old_alpha`` (nobody made them stochastic) become exactly ``new_alpha``.

    Args:
        variance: (R,) float64 in ``(0, old_alpha]`` (`aggregate_gaussians`'s clamp).
        floor: the lower clamp of the result.

    Returns:
        (R,) float64 in ``[floor, new_alpha]``.
    """
    data = (variance.reciprocal() - 1.0 / old_alpha).clamp_min(0.0)
    rebased = torch.where(data > 0, (data + 1.0 / new_alpha).reciprocal(),
                          torch.full_like(variance, new_alpha))
    return rebased.clamp(min=floor, max=new_alpha)


@register_strategy("fedsi",
                   broadcast="Gaussian (mean, variance) over the shared network",
                   upload="subnet means, marginal stds (zeros off the subnet), subnet indices, "
                          "`num_samples`",
                   aggregate="the paper's mean/std rule (or product of Gaussians); head "
                             "fine-tune and subnet refit to personalise; GLM-probit predictive; "
                             "screens the mean's distance to the broadcast")
class FedSI(Strategy):
    """FedSI: a Gaussian over the shared body, subnet Laplace on every client (module doc).

    Options: declared once, as data, in ``OPTIONS`` (types, defaults, bounds, help);
    their table is on the family's docs page and in ``bayesfl strategies NAME``
    (generated by ``python -m bayesfl.strategies.listing``).
    """

    personalizes: ClassVar[bool] = True
    is_posterior: ClassVar[bool] = True
    default_posterior: ClassVar[str] = "subnet_full"
    round_view: ClassVar[str | None] = (
        "plug-in of a head fine-tuned on the global body (no posterior before personalisation)")

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("prior_var", float, 0.01,
               "alpha, the base prior *variance* (paper section III-A); the paper's is 1e-4 "
               "(see \"The prior's variance\" below)"),
        Option("subnet_fraction", float, 0.05,
               "|S| = floor(fraction |R|), >= 1 (paper Eqs. 13-14; 5% MLP)"),
        Option("subnet_size", int, None,
               "an explicit |S| (overrides the fraction)"),
        Option("posterior", str, None,
               '"subnet_full" (FedSI), "subnet_diag" (diagonal posterior on the subnet), '
               '"diag_all" (FedSI-Fac; its default) (open in the paper)',
               shown="subnet_full", choices=POSTERIORS),
        Option("aggregation", str, "mean_std",
               'variances: "mean_std" (the paper: mean of the stds, zeros included, squared), '
               '"mean_var", "mean_nonzero" (over the clients that chose r), "moment_match" '
               '(mixture moments), "product" (precision-weighted product of Gaussians, below) '
               "(open in the paper)",
               choices=AGGREGATIONS),
        Option("weights", str, "uniform",
               'client weights of the means: "uniform" (paper) or "n_i" (sample counts)',
               choices=WEIGHTS),
        Option("variance_floor", float, 1e-12,
               "lower clamp of g (open in the paper)"),
        Option("prior_in_map", bool, True,
               "the Gaussian prior term in the local MAP (open in the paper)"),
        Option("map_solver", str, "proximal",
               'how the local MAP treats the prior: "proximal" (Adam on the CE, the prior '
               "applied exactly after each step) or \"adam\" (the prior in Adam's gradient, the "
               "paper's literal recipe; see \"The local MAP\" below)",
               choices=MAP_SOLVERS),
        Option("local_lr", float, 0.01,
               "Adam lr of local training (paper section IV); None: the run's lr",
               nullable=True),
        Option("head_init", str, "shared",
               'phi^0 shared by clients of a body spec, or "per_client" (open in the paper)',
               choices=HEAD_INITS),
        Option("filter_zero_curvature", bool, True,
               "rank zero-curvature entries last; False: the paper's literal rule"),
        Option("eval_selection", str, "diag_laplace",
               "selection at personalisation: diagonal-Laplace variance at (mu, phi_fin), or "
               '"global_var" (rank by g alone) (open in the paper)',
               choices=EVAL_SELECTIONS),
        Option("finetune_epochs", int, 100,
               "most head fine-tuning epochs (open in the paper; see below)"),
        Option("finetune_lr", float, 0.01,
               "head fine-tuning Adam lr (open in the paper; see below)"),
        Option("finetune_stop", str, "heldout_nll",
               '"heldout_nll": the epoch count of lowest NLL on 20% of the training data held '
               'out, then that many on all of it; "fixed": finetune_epochs',
               choices=HEAD_STOPS),
        Option("predictive", str, "glm_probit",
               '"glm_probit" (Eq. 19) or "glm_mc" (Monte Carlo); on S1 within 1% of the plug-in, '
               'and '
               'no setting chosen without test rows widens it (docs: FedSI, "Does the posterior '
               'earn its spread?")',
               choices=PREDICTIVES),
        Option("mc_samples", int, 100,
               'weight-space draws of "glm_mc"'),
        Option("screening_ratio", float, 10.0,
               "reject an upload whose ||mean - mu|| exceeds this many times the round's median "
               "(None: off)",
               nullable=True),
        Option("curvature_batch", int, 256,
               "rows per curvature / Jacobian chunk (memory only)"),
        Option("alpha_selection", str, "fixed",
               '"fixed": alpha = prior_var throughout; "evidence": alpha chosen every round by '
               "the clients' summed Laplace evidence, starting from prior_var (below)",
               choices=ALPHA_SELECTIONS),
        Option("head", str, None,
               "a probabilistic head after personalisation (`laplace`, `conjugate`, `mfvi`, "
               "`sgld`; `bayesfl.strategies.probabilistic_head`): fitted on the client's "
               "features of the global body, zero-centred prior; it replaces the subnet GLM "
               "predictive (the network's plug-in stays beside it); `posterior()` returns it"),
        Option("head_options", dict, None,
               "`inference.fit_head` options of that head"),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        prior_var: float = 1e-2,
        subnet_fraction: float = 0.05,
        subnet_size: int | None = None,
        posterior: str | None = None,
        aggregation: str = "mean_std",
        weights: str = "uniform",
        variance_floor: float = 1e-12,
        prior_in_map: bool = True,
        map_solver: str = "proximal",
        local_lr: float | None = 1e-2,
        head_init: str = "shared",
        filter_zero_curvature: bool = True,
        eval_selection: str = "diag_laplace",
        finetune_epochs: int = 100,
        finetune_lr: float = 1e-2,
        finetune_stop: str = "heldout_nll",
        predictive: str = "glm_probit",
        mc_samples: int = 100,
        screening_ratio: float | None = 10.0,
        curvature_batch: int = 256,
        alpha_selection: str = "fixed",
        head: str | None = None,
        head_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(context)
        name = self.name
        # the personal head starts at phi^0, not at a global head: its prior is zero-centred
        self.head: ProbabilisticHead | None = head_from_options(name, head, "zero", head_options)
        self.prior_var = option_number(name, "prior_var", prior_var, 0.0)
        self.variance_floor = option_number(name, "variance_floor", variance_floor, 0.0)
        if not 0 < self.variance_floor <= self.prior_var:
            raise ConfigError(f"{name} needs 0 < variance_floor <= prior_var, got "
                              f"{variance_floor!r} and {prior_var!r}")
        self.subnet_fraction = option_number(name, "subnet_fraction", subnet_fraction, 0.0)
        if not 0 < self.subnet_fraction <= 1:
            raise ConfigError(f"{name} subnet_fraction must be in (0, 1], got {subnet_fraction!r}")
        self.subnet_size = (None if subnet_size is None
                            else option_integer(name, "subnet_size", subnet_size, 1))
        self.posterior_kind = self.default_posterior if posterior is None else posterior
        for option, value, valid in (
            ("posterior", self.posterior_kind, POSTERIORS),
            ("aggregation", aggregation, AGGREGATIONS), ("weights", weights, WEIGHTS),
            ("head_init", head_init, HEAD_INITS),
            ("eval_selection", eval_selection, EVAL_SELECTIONS),
            ("predictive", predictive, PREDICTIVES),
            ("map_solver", map_solver, MAP_SOLVERS),
            ("finetune_stop", finetune_stop, HEAD_STOPS),
            ("alpha_selection", alpha_selection, ALPHA_SELECTIONS),
        ):
            if value not in valid:
                raise ConfigError(f"{name} {option} must be one of {', '.join(valid)}; got "
                                  f"{value!r}")
        for option, value in (("prior_in_map", prior_in_map),
                              ("filter_zero_curvature", filter_zero_curvature)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} {option} must be true or false, got {value!r}")
        self.aggregation, self.weights, self.head_init = aggregation, weights, head_init
        self.eval_selection, self.predictive = eval_selection, predictive
        self.map_solver = map_solver
        self.evidence = alpha_selection == "evidence"
        if self.evidence and not ALPHA_GRID[0] <= self.prior_var <= ALPHA_GRID[-1]:
            raise ConfigError(f"{name} alpha_selection='evidence' starts from prior_var in "
                              f"[{ALPHA_GRID[0]:g}, {ALPHA_GRID[-1]:g}] (its grid), got "
                              f"{prior_var!r}")
        self.prior_in_map, self.filter_zero_curvature = prior_in_map, filter_zero_curvature
        self.local_lr = None if local_lr is None else option_number(name, "local_lr", local_lr)
        if self.local_lr is not None and self.local_lr <= 0:
            raise ConfigError(f"{name} local_lr must be > 0, got {local_lr!r}")
        self.finetune_epochs = option_integer(name, "finetune_epochs", finetune_epochs, 0)
        self.finetune_lr = option_number(name, "finetune_lr", finetune_lr)
        if self.finetune_lr <= 0:
            raise ConfigError(f"{name} finetune_lr must be > 0, got {finetune_lr!r}")
        self.head_tuning = HeadTuning(self.finetune_epochs, float(self.finetune_lr),
                                      context.training.batch_size, finetune_stop)
        self.mc_samples = option_integer(name, "mc_samples", mc_samples, 1)
        self.screening_ratio = (None if screening_ratio is None
                                else option_number(name, "screening_ratio", screening_ratio, 1.0))
        self.curvature_batch = option_integer(name, "curvature_batch", curvature_batch, 1)

    # ==== sizes ============================================================================
    @property
    def sends_subnet(self) -> bool:
        """Whether uploads declare a subnet (not for FedSI-Fac's diagonal over everything)."""
        return self.posterior_kind != "diag_all"

    def body_size(self, body: str | None = None) -> int:
        """|R|, the number of body parameters of body spec ``body`` (default: the first)."""
        spec = self.context.bodies[0] if body is None else body
        return sum(p.numel() for p in self.template(spec).body.parameters())

    def subnet_count(self, body: str | None = None) -> int:
        """|S|: ``subnet_size``, or ``floor(subnet_fraction |R|)`` (at least 1)."""
        R = self.body_size(body)
        if self.subnet_size is not None:
            if self.subnet_size > R:
                raise ConfigError(f"{self.name} subnet_size {self.subnet_size} exceeds the body's "
                                  f"{R} parameters")
            return self.subnet_size
        return resolve_subnet_size(float(self.subnet_fraction), R)

    def build_model(self, body: nn.Module) -> nn.Module:
        return ClassifierNet(body, self.feature_dim, self.num_classes)

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        """``mean``: the body of the first spec's initial network (float32, (|R|,));
        ``variance``: alpha everywhere (float64).

        Raises:
            ConfigError: body specs whose bodies differ in parameter shapes.
        """
        specs = list(dict.fromkeys(self.context.bodies))
        models = [self.initial_model(ClientConfig(0, s, self.context.init_seed(s)))
                  for s in specs]
        shapes = [[tuple(p.shape) for p in m.body.parameters()] for m in models]
        if any(s != shapes[0] for s in shapes[1:]):
            raise ConfigError(f"{self.name} shares the whole body: every body spec must have the "
                              f"same parameter shapes, got {specs}")
        mean = body_vector(models[0]).to("cpu", torch.float32)  # server state lives on the CPU
        state = {"mean": mean,
                 "variance": torch.full(mean.shape, self.prior_var, dtype=torch.float64)}
        if self.evidence:
            state["alpha"] = torch.tensor([self.prior_var], dtype=torch.float64)
        return state

    def alpha(self, state: ServerState) -> float:
        """The base prior variance of a server state: ``prior_var``, or the one the federated
        evidence chose (``alpha_selection="evidence"``)."""
        return float(state["alpha"].item()) if "alpha" in state else self.prior_var

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        return {"mean": state["mean"].to(torch.float32),
                "variance": state["variance"].to(torch.float32)}

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        R = int(state["mean"].numel())
        schema = {"mean": TensorSpec((R,), torch.float32), "std": TensorSpec((R,), torch.float32),
                  "num_samples": NUM_SAMPLES_SPEC}
        if self.sends_subnet:
            schema["subnet"] = TensorSpec((self.subnet_count(),), torch.int32)
        if self.evidence:
            schema["log_evidence"] = TensorSpec((len(ALPHA_GRID),), torch.float64)
        return schema

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """The invariants of the module docstring, the first failing one named per upload."""
        prior_std = plan.state["variance"].to(torch.float64).sqrt()
        mu = plan.state["mean"].to(torch.float64)
        norms = torch.stack([(m.tensors["mean"].to(torch.float64) - mu).norm()
                             for m in messages])
        return first_reasons(
            count_problems(plan, messages, None),  # counts are not screened, norms are
            [self._std_problem(m, prior_std) for m in messages],
            [evidence_problem(m.tensors["log_evidence"]) if self.evidence else None
             for m in messages],
            screening_reasons(norms, self.screening_ratio, "distance of the mean to the "
                              "broadcast mean"),
        )

    def _std_problem(self, message: Message, prior_std: Tensor) -> str | None:
        std = message.tensors["std"].to(torch.float64)
        R = std.numel()
        if bool((std < 0).any()):
            return f"{int((std < 0).sum())} negative standard deviations"
        above = std > prior_std * (1 + STD_TOLERANCE)
        if bool(above.any()):
            return (f"{int(above.sum())} standard deviations above the broadcast prior std (a "
                    "Laplace posterior variance cannot exceed its prior variance)")
        if not self.sends_subnet:
            if bool((std == 0).any()):
                return (f"{int((std == 0).sum())} zero standard deviations: {self.name} sends "
                        "the positive std of every body parameter")
            return None
        idx = message.tensors["subnet"].to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= R):
            return f"declared subnet indices outside [0, {R})"
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            return "declared subnet indices are not sorted and unique"
        inside = torch.zeros(R, dtype=torch.bool)
        inside[idx] = True
        outside = (std != 0) & ~inside
        if bool(outside.any()):
            return (f"{int(outside.sum())} non-zero standard deviations outside the declared "
                    "subnet (deterministic parameters must send exactly 0)")
        if bool((std[inside] == 0).any()):
            return (f"{int((std[inside] == 0).sum())} zero standard deviations inside the "
                    "declared subnet (a positive-definite posterior has std > 0)")
        return None

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """The new Gaussian (`aggregate_gaussians` with ``aggregation``) and the ledger of
        declared sample counts."""
        if not uploads:
            return state
        counts = [int(m.tensors["num_samples"].item()) for m in uploads]
        if self.weights == "n_i":
            weights = torch.tensor(counts, dtype=torch.float64)
        else:
            weights = torch.ones(len(uploads), dtype=torch.float64)
        means = torch.stack([m.tensors["mean"].to(torch.float64) for m in uploads])
        stds = torch.stack([m.tensors["std"].to(torch.float64) for m in uploads])
        old_alpha = alpha = self.alpha(state)
        if self.evidence:  # the federated evidence's choice for the next round
            total = torch.stack([m.tensors["log_evidence"] for m in uploads]).sum(0)
            alpha = argmin_on_log_grid(-total, ALPHA_GRID)
        mean, variance = aggregate_gaussians(
            means, stds, weights / weights.sum(), state["variance"].to(torch.float64),
            rule=self.aggregation, alpha=old_alpha, floor=min(self.variance_floor, old_alpha))
        if alpha != old_alpha:  # the uploads' posteriors hold this round's base prior
            variance = rebase_prior(variance, old_alpha, alpha,
                                    floor=min(self.variance_floor, alpha))
        new = {"mean": mean.to(torch.float32), "variance": variance}
        if self.evidence:
            new["alpha"] = torch.tensor([alpha], dtype=torch.float64)
        new.update(declarations(state, [m.header.client_id for m in uploads], counts))
        return new

    def server_metrics(self, state: ServerState) -> dict[str, float]:
        """``fedsi_stochastic_fraction``: the share of body entries whose variance is below
        alpha (made stochastic by some client last round); ``fedsi_mean_std``: the mean of
        sqrt(g)."""
        variance = state["variance"].to(torch.float64)
        below = variance < self.alpha(state) * (1 - 1e-9)
        metrics = {"fedsi_stochastic_fraction": float(below.double().mean()),
                   "fedsi_mean_std": float(variance.sqrt().mean())}
        if self.evidence:
            metrics["fedsi_alpha"] = self.alpha(state)
        return metrics

    # ==== client half ======================================================================
    def init_client(self, config: ClientConfig) -> ClientState:
        """The initial network; with ``head_init="per_client"`` the head is redrawn from a
        seed derived from the run seed and the client id."""
        model = self.initial_model(config)
        if self.head_init == "per_client":
            with seeded_rng(derived_seed(self.context.seed, 23, config.client_id),
                            model.head.weight.device):
                model.head.reset_parameters()
        return model_state(model)

    def received(self, config: ClientConfig, broadcast: Message) -> tuple[Tensor, Tensor]:
        """The broadcast ``(mean, variance)`` (|R|,) each, checked against this client's body,
        on the context's device.

        Raises:
            MessageRejected: missing tensors, wrong shapes, non-finite values or variances that
                are not positive.
        """
        R = self.body_size(config.body)
        tensors = broadcast.tensors
        if set(tensors) != {"mean", "variance"}:
            raise MessageRejected(f"{self.name} broadcast must hold mean and variance, got "
                                  f"{sorted(tensors)}")
        mean, variance = tensors["mean"], tensors["variance"]
        if mean.shape != (R,) or variance.shape != (R,):
            raise MessageRejected(f"broadcast mean {tuple(mean.shape)} / variance "
                                  f"{tuple(variance.shape)} do not match this client's body of "
                                  f"{R} parameters")
        if not bool(torch.isfinite(mean).all() & torch.isfinite(variance).all()
                    & (variance > 0).all()):
            raise MessageRejected("broadcast mean must be finite and variances finite and > 0")
        device = self.context.device
        return (mean.to(device, torch.float32, copy=True),
                variance.to(device, torch.float32, copy=True))

    def model_at(self, config: ClientConfig, state: ClientState, mean: Tensor) -> nn.Module:
        """The client's network with its body set to ``mean`` and its head from ``state``."""
        model = self.client_model(config, state)
        offset = 0
        with torch.no_grad():  # copies: the parameters must not alias ``mean`` (the prior mean)
            for p in model.body.parameters():
                p.copy_(mean[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return model

    def map_objective(self, model: nn.Module, mean: Tensor, variance: Tensor, n: int):
        """Per-sample loss of the local MAP: ``CE + prior_penalty(body, mean, variance) / n``
        (its batch mean is the paper's local objective, section III-B); plain CE with
        ``prior_in_map=False``."""

        def objective(output: Tensor, labels: Tensor) -> Tensor:
            loss = cross_entropy_per_sample(output, labels)
            if not self.prior_in_map:
                return loss
            theta = torch.cat([p.reshape(-1) for p in model.body.parameters()])
            return loss + prior_penalty(theta, mean, variance) / n

        return objective

    def local_map(self, model: nn.Module, data: ClientData, mean: Tensor, variance: Tensor,
                  generator: torch.Generator) -> None:
        """Step 1: train the body in place under the broadcast prior, the head frozen.

        ``map_solver="proximal"`` takes Adam steps on the cross-entropy and applies the prior
        exactly after each (`bayesfl.training.GaussianProx`); ``"adam"`` puts the prior
        into Adam's gradient (`map_objective`), which does not converge when the prior
        std is at or below the learning rate (module docstring, "The local MAP")."""
        if not self.proximal_map:
            train_plain(model, data.train_x, data.train_y,
                        self.map_objective(model, mean, variance, data.num_train),
                        self.map_training(), generator=generator, trainable=_body)
            return
        train_plain(model, data.train_x, data.train_y, cross_entropy_per_sample,
                    self.map_training(), generator=generator, trainable=_body,
                    prox=self.prior_prox(model, mean, variance, data.num_train))

    def local_maps(self, models: Sequence[nn.Module], datas: Sequence[ClientData],
                   received: Sequence[tuple[Tensor, Tensor]],
                   generators: Sequence[torch.Generator]) -> None:
        """`local_map` of the clients of a group (one body spec), each on its own data with
        its own broadcast ``(mean, variance)`` and generator. The proximal MAP trains them
        together (`bayesfl.training.train_batched`: one vmapped gradient of all clients
        a step, each client's own prior applied after it; the same shuffles from each
        generator, the same parameters up to float rounding); the gradient route one by one."""
        if not self.proximal_map:
            for model, data, (mean, variance), generator in zip(models, datas, received,
                                                                generators, strict=True):
                self.local_map(model, data, mean, variance, generator)
            return
        proxes = [self.prior_prox(model, mean, variance, data.num_train)
                  for model, data, (mean, variance) in zip(models, datas, received,
                                                           strict=True)]
        train_batched(models, [d.train_x for d in datas], [d.train_y for d in datas],
                      cross_entropy_per_sample, self.map_training(), generators=generators,
                      trainable=_body, prox=proxes)

    @property
    def proximal_map(self) -> bool:
        """Whether the local MAP applies the prior as a proximal step (``map_solver=
        "proximal"`` with ``prior_in_map``), rather than through Adam's gradient or not at
        all."""
        return self.prior_in_map and self.map_solver == "proximal"

    def map_training(self) -> LocalTraining:
        """The local MAP's Adam: the run's training at ``local_lr``, one optimiser state for
        the whole round."""
        lr = self.context.training.lr if self.local_lr is None else self.local_lr
        return replace(self.context.training, lr=lr, reset_optimizer_each_epoch=False)

    @staticmethod
    def prior_prox(model: nn.Module, mean: Tensor, variance: Tensor, n: int) -> GaussianProx:
        """The broadcast Gaussian as a per-sample proximal term over ``body.*``: mean ``mean``
        and precision ``1 / (n variance)`` (|R|,) each, split by body parameter."""
        means, precisions, offset = {}, {}, 0
        for name, p in model.body.named_parameters():
            k = p.numel()
            means[f"body.{name}"] = mean[offset : offset + k].view_as(p)
            precisions[f"body.{name}"] = variance[offset : offset + k].view_as(p).reciprocal() / n
            offset += k
        return GaussianProx(means, precisions)

    def curvature_batches(self, data: ClientData) -> list[tuple[Tensor, Tensor]]:
        """The client's training set in chunks of ``curvature_batch`` rows (the GGN is summed
        over all of it)."""
        step = self.curvature_batch
        return [(data.train_x[i : i + step], data.train_y[i : i + step])
                for i in range(0, data.num_train, step)]

    def choose_subnet(self, model: nn.Module, batches: list, variance: Tensor,
                      rule: str = "diag_laplace", diag: Tensor | None = None) -> Tensor | None:
        """Step 2: the |S| body entries of largest diagonal-Laplace variance (``rule=
        "global_var"``: of largest ``g``); None for ``posterior="diag_all"``. ``diag``: the
        body's diagonal GGN when the caller has it already (else computed here)."""
        if not self.sends_subnet:
            return None
        model.head.requires_grad_(False)  # the index space is the body
        prior = variance.to(torch.float64).reciprocal()
        S = self.subnet_count()
        if rule == "global_var":
            return rank_by_variance(torch.zeros_like(prior), prior, S,
                                    filter_zero_curvature=False)
        if diag is not None:
            return rank_by_variance(diag, prior, S,
                                    filter_zero_curvature=self.filter_zero_curvature)
        return select_subnet(model, batches, S, prior,
                             filter_zero_curvature=self.filter_zero_curvature)

    def laplace(self, model: nn.Module, batches: list, variance: Tensor,
                subnet: Tensor | None, diag: Tensor | None = None) -> Posterior:
        """Step 3: the Laplace posterior at the model's current body (head frozen). ``diag``:
        the body's diagonal GGN when the caller has it already (the diagonal posterior then
        reuses it instead of computing it again)."""
        model.head.requires_grad_(False)
        prior = variance.to(torch.float64).reciprocal()
        if subnet is None:
            return fit_diagonal_laplace(model, batches, prior, ggn_diagonal=diag)
        structure = "diag" if self.posterior_kind == "subnet_diag" else "full"
        return fit_subnet_laplace(model, batches, subnet, prior, hessian_structure=structure)

    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """Warm start, local MAP, subnet selection, Laplace, upload (module docstring)."""
        mean, variance = self.received(config, broadcast)
        model = self.model_at(config, state, mean)
        self.local_map(model, data, mean, variance, generator)
        return self.fit_at_map(config, model, data, broadcast, mean, variance)

    def fit_group(
        self,
        configs: Sequence[ClientConfig],
        states: Sequence[ClientState],
        datas: Sequence[ClientData],
        broadcast: Message,
        generators: Sequence[torch.Generator],
    ) -> list[tuple[ClientState, Message]]:
        """`fit` of same-body clients, their local MAPs trained together (`local_maps`),
        then each client's subnet, Laplace and upload as in `fit`."""
        check_one_body(configs)
        received = [self.received(c, broadcast) for c in configs]
        models = [self.model_at(c, s, mean)
                  for c, s, (mean, _) in zip(configs, states, received, strict=True)]
        self.local_maps(models, datas, received, generators)
        return [self.fit_at_map(c, model, d, broadcast, mean, variance)
                for c, model, d, (mean, variance) in zip(configs, models, datas, received,
                                                         strict=True)]

    def fit_at_map(self, config: ClientConfig, model: nn.Module, data: ClientData,
                   broadcast: Message, mean: Tensor, variance: Tensor
                   ) -> tuple[ClientState, Message]:
        """`fit` after the local MAP: ``model`` at the MAP, ``(mean, variance)`` the
        broadcast prior; subnet selection, Laplace and the upload."""
        batches = self.curvature_batches(data)
        diag, log_evidence = None, None
        if self.evidence:
            model.head.requires_grad_(False)  # the index space is the body
            diag = diagonal_ggn(model, batches)
            log_evidence = alpha_log_evidence(body_vector(model), mean, diag)
        subnet = self.choose_subnet(model, batches, variance, diag=diag)
        std = self.subnet_std(model, batches, variance, subnet)
        if std is None:
            posterior = self.laplace(model, batches, variance, subnet, diag)
            std = posterior.marginal_std_full()
            if isinstance(posterior, SubnetLaplacePosterior):
                subnet = posterior.subnet_indices
        return model_state(model), self.upload(config, data, broadcast.header.round, model,
                                               std, subnet, log_evidence)

    def subnet_std(self, model: nn.Module, batches: list, variance: Tensor,
                   subnet: Tensor | None) -> Tensor | None:
        """The upload's ``std`` (|R|,) of the full-covariance subnet posterior, from its
        marginal variances alone (`inference.subnet.lowrank.subnet_marginal_variance`:
        Woodbury on the GGN's low-rank factor, no |S| x |S| matrix); None where that route
        does not apply (then `laplace` fits the dense posterior)."""
        if subnet is None or self.posterior_kind != "subnet_full":
            return None
        model.head.requires_grad_(False)
        prior = variance.to(torch.float64).reciprocal()
        subnet = subnet.to("cpu", torch.int64)
        marginal = subnet_marginal_variance(model, batches, subnet, prior[subnet.to(prior.device)])
        if marginal is None:
            return None
        mean = body_vector(model)
        std = torch.zeros_like(mean)
        std[subnet.to(mean.device)] = marginal.sqrt().to(std.dtype)
        return std

    def upload(self, config: ClientConfig, data: ClientData, round: int, model: nn.Module,
               std: Tensor, subnet: Tensor | None, log_evidence: Tensor | None = None) -> Message:
        """Step 4: the message (means, ``std`` (|R|,) zero outside ``subnet``, the subnet,
        sample count; the log evidence on `ALPHA_GRID` with
        ``alpha_selection="evidence"``)."""
        tensors = {"mean": body_vector(model).to(torch.float32),
                   "std": std.to(torch.float32),
                   "num_samples": num_samples_tensor(data.num_train)}
        if subnet is not None:
            tensors["subnet"] = subnet.to(torch.int32)
        if log_evidence is not None:
            tensors["log_evidence"] = log_evidence
        return self.up_message(round, config.client_id, tensors)

    def personalize(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> ClientState:
        """Body at the global mean, head fine-tuned, subnet selected and Laplace refitted."""
        mean, variance = self.received(config, broadcast)
        model = self.fine_tuned(config, state, data, mean, generator)
        batches = self.curvature_batches(data)
        subnet = self.choose_subnet(model, batches, variance, self.eval_selection)
        lowrank = self.lowrank_terms(model, batches, variance, subnet)
        if subnet is None:
            terms = self.laplace(model, batches, variance, subnet).state_dict()
        elif lowrank:  # the GGN is rebuilt from the factors on demand (personal_posterior)
            terms = self.subnet_prior_terms(subnet, variance, data.num_train)
        else:  # the posterior's tensors; predict() factorises them once (personal_posterior)
            model.head.requires_grad_(False)
            structure = "diag" if self.posterior_kind == "subnet_diag" else "full"
            terms = subnet_laplace_state(model, batches, subnet,
                                         variance.to(torch.float64).reciprocal(),
                                         hessian_structure=structure)
        # the terms are this call's own fresh tensors (the Laplace fit's, or the state's S x S
        # GGN: 123 MB at |S| = 3,925); kept as they are, not copied
        kept = {f"{POSTERIOR_PREFIX}{k}": v.detach()
                for k, v in terms.items() if k != "mean"}
        kept.update(lowrank)
        personalized = {**model_state(model), **kept,
                        PERSONALIZED: torch.ones(1, dtype=torch.bool)}
        if self.head is None:
            return personalized
        return with_head_posterior(self.head, personalized, model, data, self.num_classes,
                                   config.client_id)

    @staticmethod
    def subnet_prior_terms(subnet: Tensor, variance: Tensor, n_data: int) -> dict[str, Tensor]:
        """`subnet_laplace_state`'s tensors but its GGN (and mean): the subnet, its prior
        precision ``1 / variance`` and zero prior mean (float64, on variance's device), the
        sample count. Kept beside the low-rank factors (`lowrank_terms`), from which
        `personal_posterior` rebuilds the GGN when the dense posterior is asked for (issue 41:
        the 3,925 x 3,925 GGN was ~0.15 CPU-s and 123 MB a client, for a posterior that the
        GLM-probit predictive never factorises)."""
        # |R| is the broadcast's length (`received` checked it against the body): no body copy
        indices = check_subnet_indices(subnet.to("cpu", torch.int64), variance.numel())
        prior = variance.to(torch.float64).reciprocal()[indices.to(variance.device)]
        return {"subnet_indices": indices, "prior_precision": prior,
                "prior_mean": torch.zeros_like(prior),
                "n_data": torch.tensor(int(n_data), dtype=torch.int64)}

    def lowrank_terms(self, model: nn.Module, batches: list, variance: Tensor,
                      subnet: Tensor | None) -> dict[str, Tensor]:
        """The same subnet posterior in the truncated Woodbury form of the upload
        (`inference.subnet.lowrank.subnet_lowrank_posterior`, keys under
        `LOWRANK_PREFIX`), which `predict` uses for the GLM-probit predictive instead of
        factorising the dense |S| x |S| precision (each logit variance within ``1e-12 |z|^2``
        of the dense one, `inference.subnet.lowrank`), and from which `personal_posterior`
        rebuilds the dense posterior's GGN when it is asked for (the state keeps these ~20 MB
        instead of the 123 MB GGN on S1); empty where that route does not apply (another
        posterior, head or predictive; a subnet outside Linear layers)."""
        if (subnet is None or self.posterior_kind != "subnet_full" or self.head is not None
                or self.predictive != "glm_probit"):
            return {}
        prior = variance.to(torch.float64).reciprocal()
        subnet = subnet.to("cpu", torch.int64)
        factors = subnet_lowrank_posterior(model, batches, subnet,
                                           prior[subnet.to(prior.device)])
        if factors is None:
            return {}
        return {f"{LOWRANK_PREFIX}{k}": factors[k] for k in LOWRANK_KEYS}

    def fine_tuned(self, config: ClientConfig, state: ClientState, data: ClientData,
                   mean: Tensor, generator: torch.Generator) -> nn.Module:
        """The client's network with its body at ``mean`` and its head fine-tuned from
        phi^0 on the body's features of its training data (`
        head_tuning`: by held-out NLL unless ``finetune_stop="fixed"``)."""
        model, features = self.head_problem(config, state, data, mean)
        tune_head(model.head, features, data.train_y, self.head_tuning, generator)
        return model

    def head_problem(self, config: ClientConfig, state: ClientState, data: ClientData,
                     mean: Tensor) -> tuple[nn.Module, Tensor]:
        """The client's network with its body at ``mean``, and that body's features of the
        client's training rows (n, d): what `fine_tuned` tunes the head on."""
        model = self.model_at(config, state, mean)
        with torch.no_grad():
            features = batched_apply(model.body, data.train_x, self.curvature_batch)
        return model, features

    def round_state(self, config: ClientConfig, state: ClientState, data: ClientData,
                    broadcast: Message) -> ClientState:
        """Before personalisation (every round), the head the client would fine-tune now on
        the global mean (`fine_tuned`; the plug-in, no posterior yet), not its frozen
        phi^0, which is at chance: the round's figures show what the body has learnt
        (`round_view`)."""
        return self.round_state_group([config], [state], [data], broadcast)[0]

    def round_state_group(self, configs: Sequence[ClientConfig], states: Sequence[ClientState],
                          datas: Sequence[ClientData], broadcast: Message) -> list[ClientState]:
        """`round_state` of a group of clients, their heads tuned together
        (`bayesfl.strategies.head_tuning.tune_heads`: each client's own split, shuffles and
        epoch choice, as `fine_tuned` draws them)."""
        out = list(states)
        pending = [k for k, state in enumerate(states) if PERSONALIZED not in state]
        problems, generators = [], []
        for k in pending:
            mean, _ = self.received(configs[k], broadcast)
            problems.append(self.head_problem(configs[k], states[k], datas[k], mean))
            generators.append(torch.Generator().manual_seed(derived_seed(
                self.context.seed, 31, configs[k].client_id, broadcast.header.round)))
        tune_heads([model.head for model, _ in problems], [f for _, f in problems],
                   [datas[k].train_y for k in pending], self.head_tuning, generators)
        for k, (model, _) in zip(pending, problems, strict=True):
            out[k] = {**model_state(model), ROUND_VIEW: torch.ones(1, dtype=torch.bool)}
        return out

    def personal_posterior(self, config: ClientConfig, state: ClientState) -> Posterior:
        """The posterior a personalized state holds, bound to the client's network."""
        model = self.client_model(config, state)
        model.head.requires_grad_(False)
        entries = {k[len(POSTERIOR_PREFIX):]: v for k, v in state.items()
                   if k.startswith(POSTERIOR_PREFIX)}
        entries["mean"] = body_vector(model)
        if "ggn_diagonal" in entries:
            return DiagonalLaplacePosterior.from_state_dict(entries, model=model)
        if "ggn" not in entries:  # kept as the low-rank factors (personalize): H = W W^T
            factors = {k[len(LOWRANK_PREFIX):]: v for k, v in state.items()
                       if k.startswith(LOWRANK_PREFIX)}
            entries["ggn"] = lowrank_ggn(model, entries["mean"], factors)
        # the GGN is this client's own `subnet_laplace_state` output, exactly symmetric
        return SubnetLaplacePosterior.from_state_dict(entries, model=model,
                                                      assume_symmetric=True)

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        """GLM predictive and MAP plug-in of a personalized client; before personalisation,
        the softmax of the global mean with the client's head under both keys."""
        if ROUND_VIEW in state:  # evaluate_group's fine-tuned head on the global mean
            logits = batched_apply(self.client_model(config, state), x)
            probs = torch.softmax(logits.to(torch.float64), dim=-1).cpu()
            return {PREDICTIVE: probs, MAP_PLUGIN: probs}
        if PERSONALIZED not in state:
            mean, _ = self.received(config, broadcast)
            logits = batched_apply(self.model_at(config, state, mean), x)
            probs = torch.softmax(logits.to(torch.float64), dim=-1).cpu()
            return {PREDICTIVE: probs, MAP_PLUGIN: probs}
        if f"{LOWRANK_PREFIX}chol" in state:  # glm_probit, no head (`lowrank_terms`)
            model = self.client_model(config, state)
            model.head.requires_grad_(False)
            factors = {k: state[f"{LOWRANK_PREFIX}{k}"] for k in LOWRANK_KEYS}
            fast = lowrank_predict_proba(model, body_vector(model), factors, x,
                                         chunk_size=self.curvature_batch)
            if fast is not None:
                return {PREDICTIVE: fast[0].to("cpu", torch.float64),
                        MAP_PLUGIN: fast[1].to("cpu", torch.float64)}
        posterior = self.personal_posterior(config, state)
        head = None if self.head is None else head_posterior(self.head, state)
        if head is not None:  # head=KIND: its predictive, beside the network's plug-in
            features = head_features(self.client_model(config, state), x)
            plugin = posterior.predict_proba(x, "map", chunk_size=self.curvature_batch)
            return {PREDICTIVE: self.head.predict(head, features).cpu(),
                    MAP_PLUGIN: plugin.to("cpu", torch.float64)}
        generator = None
        if self.predictive == "glm_mc":
            device = posterior.mean.device
            generator = torch.Generator(device).manual_seed(
                derived_seed(self.context.seed, 29, config.client_id))
        predictive = posterior.predict_proba(x, self.predictive, n_samples=self.mc_samples,
                                             generator=generator,
                                             chunk_size=self.curvature_batch)
        plugin = posterior.predict_proba(x, "map", chunk_size=self.curvature_batch)
        return {PREDICTIVE: predictive.to("cpu", torch.float64),
                MAP_PLUGIN: plugin.to("cpu", torch.float64)}

    def posterior(self, config: ClientConfig, state: ClientState, broadcast: Message) -> Any:
        """Client ``config``'s posterior over the body (subnet Laplace, or diagonal for
        FedSI-Fac) at (global mean, fine-tuned head): ``sample(n)`` draws (n, |R|) body vectors,
        ``predict_proba(x, method)`` the predictives.

        Raises:
            ConfigError: the client has not personalized (it holds no posterior before).
        """
        if PERSONALIZED not in state:
            raise ConfigError(f"client {config.client_id} has not personalized: {self.name} "
                              "fits a client's posterior in personalize() after training")
        head = None if self.head is None else head_posterior(self.head, state)
        if head is not None:  # head=KIND: the head posterior behind the client's body
            return client_posterior(self.client_model(config, state).body, head,
                                    self.head.method,
                                    input_shape=self.context.input_shape or None)
        return self.personal_posterior(config, state)


@register_strategy("fedsi-fac",
                   broadcast="as FedSI",
                   upload="means, marginal stds, `num_samples`",
                   aggregate="as FedSI (factorised: no subnet indices)")
class FedSIFac(FedSI):
    """FedSI-Fac: FedSI with a diagonal GGN Laplace over every body parameter (all stds
    sent; a baseline of the paper's section IV)."""

    default_posterior: ClassVar[str] = "diag_all"
    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("posterior", str, None,
               '"subnet_full" (FedSI), "subnet_diag" (diagonal posterior on the subnet), '
               '"diag_all" (FedSI-Fac; its default) (open in the paper)',
               shown="diag_all"),
    )


