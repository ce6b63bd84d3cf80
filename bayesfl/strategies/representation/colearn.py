r"""CoLearn (Berdoz, Singh, Jaggi, Raskar 2022, "Scalable Collaborative Learning via
Representation Sharing"): clients share per-class features, never weights.

Paper: [Scalable Collaborative Learning via Representation
Sharing](https://arxiv.org/abs/2211.10943) (arXiv 2211.10943; the names below are the paragraphs
of its section 3, "Methods", and its Appendix A.3). Every client keeps a
personal network ``f_u = tau_u o phi_u`` (its body, d' = ``feature_dim`` features after the
body's final ReLU, then a linear classifier ``tau_u``); bodies may differ between clients as
long as d' and the classes agree. Nothing of a network ever leaves its client.

**Upload** (client -> server, per round; "Implementation" and Algorithms 1-2 of Appendix A.3;
the schema admits nothing else):

=================  ==================  ===================================================
``prototypes``     (C, d') float32     ``t_u^c``: mean feature of all class-c samples
``observations``   (M_up, C, d') f32   ``t_{u,m}^c``: mean feature of ``min(n_avg, n_u^c)``
                                       random class-c samples, M_up independent draws
``counts``         (C,) int64          ``n_u^c`` (0: class absent, zero rows, no term);
                                       ``share_counts=False``: 0 / 1 presence only
=================  ==================  ===================================================

So an upload is ``(1 + M_up) C d'`` floats plus C integers and the message header. Features
of the bodies here are non-negative (every body ends in a ReLU), which the server checks: a
classifier's weights ``W_u`` (C, d') have the prototypes' shape but not their sign.

**Server** (a relay and mean calculator; Algorithms 1-2): the global prototype of class c is
the count-weighted mean of the uploaded prototypes, $\sum_u n_u^c t_u^c / \sum_u n_u^c$
(``weighting="uniform"``: the plain mean over the clients holding c); a class nobody
uploaded keeps its previous prototype (or stays absent).

**Downlink** (server -> client, per round; "Communication"). The paper's client downloads the global
prototypes and ``M_down`` observation sets of *peers*: ``(M_down + 1) C d'`` floats.

- ``relay="sets"`` (default, the paper's downlink): the server draws ``M_down`` of the
  round's observation sets, from distinct senders where it can (``peer="one"``: each set
  one sender's, a class that sender lacks filled from another holder; ``"mix"``: every class
  row from its own random holder), and broadcasts them with each *row's* sender id: the
  prototypes, their presence, the sets (M_down, C, d'), their presence (M_down, C) and
  senders (M_down, C) -- ``(M_down + 1) C d'`` floats plus ``C + 2 M_down C`` masks and
  sender ids and the header (mnist-5k, N = 5, C = 10, d' = 84: 7,528 B per client per round
  against the paper's 6,720 B of floats). The transport sends every client of a round the
  same broadcast, so a client never gets a draw of its own: a row the client sent itself is
  replaced by that row of the set it used last round (which came from a peer: the client
  keeps it, the ``relay.kept*`` entries of its state); with no such row (its first round)
  that observation is left out of the disc term (the paper does not say). At N clients and M_down =
  1, one client in N per round uses a one-round-old set; and every client of a round sees the same
  M_down peer sets, where the paper's clients draw theirs independently (the round's
  clients are still contrasted against peers' features; the variety comes from round to
  round).
- ``relay="pool"``: the whole pool of the round's observation sets (shuffled; at most
  ``relay_pool`` of them) with each set's sender, and every client draws its ``M_down`` sets
  from it, peers only, independently: ``(S + 1) C d'`` floats for S relayed sets (all N M_up
  by default: 21 kB per client per round at N = 5 on mnist-5k, 3.1x the paper's).

**Privacy of the counts.** The uploaded ``counts`` are each client's label histogram ``n_u^c``,
which the paper does not send (its server "averages" the prototypes). They serve three things:
the count-weighted global prototype (the mean feature of class c over the federation's
samples, not over its clients), the presence of a class (count 0: nothing uploaded, no
term) and the screening of a client that inflates its weight (``screening_ratio``).
``share_counts=False`` uploads the presence alone (counts clamped to 0 / 1, the server
rejects larger ones): the label histogram stays on the client (which classes it holds is
still visible, as it is in the paper from the classes it sends), the global prototype becomes
the plain mean over the holders (``weighting="count"`` then equals ``"uniform"``: a client
with 3 samples of a class pulls its prototype as hard as one with 300), and the screening
becomes moot (no client weighs more than another). The default keeps the counts
(``share_counts=True``).

**Local objective** ("Contrastive Objective", "Final Objective"), per sample $(x, y)$ with
$s = \phi_u(x)$, $z = \tau_u(s)$:

$$\mathrm{CE}(z, y) + \lambda_{\mathrm{kd}} \frac{\lVert s - \bar t^{\,y}\rVert^2}{d'}
+ \lambda_{\mathrm{disc}} \Big[-\log h(s, t_m^y) - \sum_{c \ne y} \log\big(1 - h(s,
t_m^c)\big)\Big]$$

(``kd_reduction="mean"``; ``"sum"`` drops the $1/d'$), with
$h(s, t) = \langle \mathrm{softmax}(\tau_u(s) / T), \mathrm{softmax}(\tau_u(t) / T) \rangle$
($T$ = ``tau_disc``, 1 in the paper), ``m ~ U{1..M_down}`` per sample, and ``h`` clamped to ``[eps,
1 - eps]``. The downloaded ``t`` are constants: the disc term trains ``tau_u`` on peers' features
too. Terms whose target is absent (no global prototype of ``y``; no observation of a class in set m)
are skipped (the paper does not say). Each term is a batch mean.

**Options**: the points the paper leaves open, each with a recommended default,
declared with their meanings in ``CoLearn.OPTIONS`` (``bayesfl strategies colearn``; the docs'
family page lists them). ``kd_reduction="mean"`` is the measured choice: ``"sum"``, the
literal reading of the paper's objective, collapses every client's features at ``lam_kd = 10``.

**Logged**: each client state keeps its last round's mean CE, KD and disc terms
(``loss.*``, `bayesfl.strategies.representation.personal.loss_log`); the server reports
``prototype_drift`` (mean L2 change of the global prototypes in the last round, over the
classes uploaded) and ``prototype_spread`` (mean distance between the global prototypes of
two classes; near 0 means the shared feature space has collapsed) with every round's metrics.

**Calibration** (measured, mnist-5k / LeNet5, N = 10, seed 0, at commit ``c7a1ed3``; not
stored): early on the personal models are strongly *under*confident, because the KD term keeps
every class's features close to prototypes that are still close together (small
``prototype_spread``, reported every round) and the disc term penalises confident predictions
on peers' not-yet-aligned features: after 10 rounds the mean confidence sits far below the
accuracy. As the prototypes spread over the rounds this fades, and the ECE falls round after
round.

Heterogeneous d' is out of scope: the run's ``feature_dim`` is every body's width.
Prediction is the client's own network (softmax of its classifier).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor, nn

from bayesfl.data.clients import ClientData
from bayesfl.errors import ConfigError
from bayesfl.messages import Message, Schema, TensorSpec
from bayesfl.strategies.base import (
    PREDICTIVE,
    ClientConfig,
    ClientState,
    RoundPlan,
    ServerState,
    StrategyContext,
    derived_seed,
    model_state,
)
from bayesfl.strategies.networks import PrototypeNet, batched_apply, cross_entropy_per_sample
from bayesfl.strategies.options import option_integer, option_number
from bayesfl.strategies.registry import Option, register_strategy
from bayesfl.strategies.representation.personal import PersonalStrategy, class_means
from bayesfl.strategies.robust import first_reasons, screening_reasons

UPLOAD_NAMES = ("prototypes", "observations", "counts")
KEPT, KEPT_AVAILABLE = "relay.kept", "relay.kept_available"


def observation_sets(
    features: Tensor, labels: Tensor, num_classes: int, m_up: int, n_avg: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """``m_up`` observation sets: per class, the mean of ``min(n_avg, n_c)`` random class-c
    rows of ``features`` (n, d) (without replacement within a set).

    Returns:
        observations (m_up, C, d) float64 (zero rows for absent classes) and the number of
        rows each mean averages, (C,) int64 (the same for every set).
    """
    d = features.shape[1]
    out = torch.zeros(m_up, num_classes, d, dtype=torch.float64, device=features.device)
    sizes = torch.zeros(num_classes, dtype=torch.int64)
    for c in range(num_classes):
        members = torch.nonzero(labels == c).flatten().cpu()
        k = min(n_avg, len(members))
        sizes[c] = k
        for m in range(m_up):
            if k == 0:
                continue
            pick = members[torch.randperm(len(members), generator=generator)[:k]]
            out[m, c] = features[pick.to(features.device)].to(torch.float64).mean(0)
    return out, sizes


def contrastive_terms(
    logits: Tensor, observation_logits: Tensor, labels: Tensor, available: Tensor, *,
    tau: float = 1.0, eps: float = 1e-7, neg_reduction: str = "sum",
) -> Tensor:
    """CoLearn's per-sample "same class?" loss ("Contrastive Objective").

    Args:
        logits: (B, C) the client's logits of its samples, ``tau_u(s_b)``.
        observation_logits: (B, C, C): row ``[b, c]`` is ``tau_u(t_{m_b}^c)``, the client's
            logits of the observation of class c in the set drawn for sample b.
        labels: (B,) int64.
        available: (B, C) bool: whether the observation of class c exists in b's set.
        tau: temperature of both softmaxes; eps: clamp of ``h``.
        neg_reduction: ``"sum"`` over the available negatives, or ``"mean"``.

    Returns:
        (B,) ``-log h_b,y_b - sum_{c != y_b} log(1 - h_b,c)`` over available observations,
        with ``h_b,c = <softmax(logits_b / tau), softmax(observation_logits_b,c / tau)>``.
    """
    p_s = torch.softmax(logits / tau, dim=-1)
    p_t = torch.softmax(observation_logits / tau, dim=-1)
    h = torch.einsum("bk,bck->bc", p_s, p_t).clamp(eps, 1 - eps)
    positive = nn.functional.one_hot(labels, logits.shape[1]).bool()
    pos = -(h.log() * (positive & available)).sum(1)
    neg_mask = ~positive & available
    neg = -(torch.log1p(-h) * neg_mask).sum(1)
    if neg_reduction == "mean":
        neg = neg / neg_mask.sum(1).clamp_min(1)
    return pos + neg


def select_observations(
    pool: Tensor, present: Tensor, sources: Tensor, client_id: int, m_down: int,
    generator: torch.Generator, *, peer: str = "one",
) -> tuple[Tensor, Tensor]:
    """A client's ``m_down`` observation sets drawn from the relay pool, peers only.

    Args:
        pool: (S, C, d) relayed observation sets; present: (S, C) >0 where a set holds the
            class; sources: (S,) sender ids (-1: the random bootstrap's).
        client_id: the drawing client (its own sets are never drawn).
        peer: ``"one"`` (one random peer per set, a missing class filled from a random peer
            that has it) or ``"mix"`` (every class from its own random peer).

    Returns:
        observations (m_down, C, d) and available (m_down, C) bool (False: no peer has it).
    """
    _, c, d = pool.shape
    obs = torch.zeros(m_down, c, d, dtype=pool.dtype)
    available = torch.zeros(m_down, c, dtype=torch.bool)
    eligible = (sources != client_id).cpu()
    holds = (present.cpu() > 0) & eligible[:, None]
    peers = torch.nonzero(eligible).flatten()
    if len(peers) == 0:
        return obs, available
    for m in range(m_down):
        if peer == "one":
            j = int(peers[torch.randint(len(peers), (1,), generator=generator)])
            obs[m], available[m] = pool[j].cpu(), holds[j]
        for k in torch.nonzero(~available[m]).flatten().tolist():
            holders = torch.nonzero(holds[:, k]).flatten()
            if len(holders):
                j = int(holders[torch.randint(len(holders), (1,), generator=generator)])
                obs[m, k], available[m, k] = pool[j, k].cpu(), True
    return obs, available


def select_relay(
    pool: Tensor, present: Tensor, sources: Tensor, m_down: int, generator: torch.Generator,
    *, peer: str = "one",
) -> tuple[Tensor, Tensor, Tensor]:
    """The server's ``relay="sets"`` draw: ``m_down`` observation sets out of the round's
    pool, the same for every client of the round.

    Args:
        pool: (S, C, d) the round's observation sets; present: (S, C) >0 where a set holds
            the class; sources: (S,) sender ids.
        peer: ``"one"`` (each set is one sender's, senders distinct while there are enough;
            a class that sender lacks filled from a random other holder) or ``"mix"`` (every
            class row from its own random holder).

    Returns:
        sets (m_down, C, d), present (m_down, C) float32 and the sender of every row
        (m_down, C) int64 (-1 where no set holds the class; the random bootstrap's sets are
        also -1: nobody's own).
    """
    _, c, d = pool.shape
    sets = torch.zeros(m_down, c, d, dtype=pool.dtype)
    rows_present = torch.zeros(m_down, c)
    row_sources = torch.full((m_down, c), -1, dtype=torch.int64)
    holds = present.cpu() > 0
    if len(pool) == 0:
        return sets, rows_present, row_sources
    order = torch.randperm(len(pool), generator=generator).tolist()
    # distinct senders first, then the remaining sets (more draws than senders)
    first: dict[int, int] = {}  # sender -> its first set in the shuffled order
    for j in order:
        first.setdefault(int(sources[j]), j)
    distinct = list(first.values())
    picks = (distinct + [j for j in order if j not in distinct]) * m_down
    for m in range(m_down):
        if peer == "one":
            j = picks[m]
            sets[m], rows_present[m] = pool[j].cpu(), holds[j].float()
            row_sources[m] = torch.where(holds[j], sources[j], torch.tensor(-1))
        for k in torch.nonzero(rows_present[m] == 0).flatten().tolist():
            holders = torch.nonzero(holds[:, k]).flatten()
            if peer == "one":  # another sender than the set's own, where one holds it
                others = holders[sources[holders] != int(sources[picks[m]])]
                holders = others if len(others) else holders
            if len(holders):
                j = int(holders[torch.randint(len(holders), (1,), generator=generator)])
                sets[m, k], rows_present[m, k] = pool[j, k].cpu(), 1.0
                row_sources[m, k] = sources[j]
    return sets, rows_present, row_sources


def received_sets(
    sets: Tensor, present: Tensor, sources: Tensor, client_id: int, kept: Tensor,
    kept_available: Tensor,
) -> tuple[Tensor, Tensor]:
    """A client's ``relay="sets"`` observations: the relayed rows of peers, and where a row
    is its own, that row of the set it used last round (``kept``, ``kept_available``).

    Args:
        sets: (M, C, d) relayed sets; present: (M, C) >0 where relayed; sources: (M, C) the
            sender of each row.
        client_id: the receiving client.
        kept: (M, C, d) the client's last used sets; kept_available: (M, C) >0 where usable.

    Returns:
        observations (M, C, d) in ``sets``' dtype and available (M, C) bool; never a row the
        client sent itself.
    """
    own = (sources.cpu() == client_id) & (present.cpu() > 0)
    fill = own & (kept_available.cpu() > 0)
    obs = torch.where(fill[:, :, None], kept.cpu().to(sets.dtype), sets.cpu())
    available = ((present.cpu() > 0) & ~own) | fill
    obs = obs * available[:, :, None].to(obs.dtype)  # nothing of its own left in an unused row
    return obs, available


def peer_prototypes(pool: Tensor, present: Tensor, sources: Tensor,
                    client_id: int) -> tuple[Tensor, Tensor]:
    """The peer-to-peer KD target (the paper's "Relaxation to peer-to-peer"): per class, the
    mean of the relayed observation sets (S, C, d) of the other clients that hold the class
    (``sources`` (S,) per set, or (S, C) per row).

    Returns:
        prototypes (C, d) float32 (zero rows where no peer holds the class) and their
        presence (C,) float32.
    """
    if sources.dim() == 1:
        sources = sources[:, None].expand(present.shape)  # one sender per set
    weights = ((present > 0) & (sources != client_id)).to(torch.float64)  # (S, C)
    total = weights.sum(0)
    mean = (weights[:, :, None] * pool.to(torch.float64)).sum(0) / total.clamp_min(1)[:, None]
    return mean.to(torch.float32), (total > 0).to(torch.float32)


@register_strategy("colearn",
                   broadcast="global prototypes, relayed observation sets and their sources",
                   upload="per-class feature means, observation sets, class counts",
                   aggregate="count-weighted means, relay; screens total count")
class CoLearn(PersonalStrategy):
    """CoLearn: personal networks aligned through shared class prototypes and relayed
    observation sets (module docstring).

    Args:
        context: classes, d', local training (the paper: 1 epoch, Adam 1e-3, batch 16),
            rounds, device, seed, bodies.
        lam_kd, lam_disc, n_avg, m_up, m_down, tau_disc, statistics, bootstrap, synchronous,
            peer, weighting, neg_reduction, kd_reduction, eps, relay, relay_pool, share_counts,
            kd_target, max_norm, screening_ratio, independent_init, keep_optimizer: module
            docstring.
    """

    LOSS_TERMS: tuple[str, ...] = ("ce", "kd", "disc")
    STATISTICS: ClassVar[tuple[str, ...]] = ("final", "running")
    BOOTSTRAP: ClassVar[tuple[str, ...]] = ("upload", "skip", "random")
    PEER: ClassVar[tuple[str, ...]] = ("one", "mix")
    WEIGHTING: ClassVar[tuple[str, ...]] = ("count", "uniform")
    REDUCTION: ClassVar[tuple[str, ...]] = ("sum", "mean")
    KD_TARGET: ClassVar[tuple[str, ...]] = ("server", "peers")
    RELAY: ClassVar[tuple[str, ...]] = ("sets", "pool")

    OPTIONS: ClassVar[tuple[Option, ...]] = (
        Option("lam_kd", float, 10.0,
               "weight of the KD term, the squared distance of a feature to its class's target "
               "prototype (paper: 10).",
               minimum=0.0),
        Option("lam_disc", float, 1.0,
               "weight of the disc term, the contrast against peers' observation sets (paper: 1).",
               minimum=0.0),
        Option("n_avg", int, 10,
               "samples averaged per class into one observation (`min(n_avg, n_u^c)`; paper: 10).",
               minimum=1),
        Option("m_up", int, 1,
               "observation sets a client uploads per round (M_up; paper: 1).",
               minimum=1),
        Option("m_down", int, 1,
               "observation sets of peers a client trains against per round (M_down; paper: 1).",
               minimum=1),
        Option("tau_disc", float, 1.0,
               "temperature of the two softmaxes inside `h` only (open in the paper; 1).",
               minimum=1e-6),
        Option("statistics", str, "final",
               "`\"final\"`: prototypes and observations from an extra no-grad pass with the "
               "round's final weights (eval mode); `\"running\"`: from the features of the last "
               "local epoch's mini-batches, as computed during training (open in the paper)."),
        Option("bootstrap", str, "upload",
               "`\"upload\"`: a round 0 in which clients upload prototypes and observations of "
               "their initial networks; `\"skip\"`: no round 0 (round 1 trains on CE only); "
               "`\"random\"`: the paper's random initial prototypes and observations (uniform "
               "on [0, 1), seeded by the run) (open in the paper)."),
        Option("synchronous", bool, True,
               "every round's clients train against the same broadcast (open in the paper); "
               "`false`, the paper's sequential listing, is not expressible in a transport that "
               "broadcasts once per round and is refused."),
        Option("peer", str, "one",
               "`\"one\"`: each downloaded set from one random peer, a class it lacks filled "
               "from another holder; `\"mix\"`: every class of a set from its own random peer "
               "(open in the paper)."),
        Option("weighting", str, "count",
               "the global prototype: `\"count\"`, the count-weighted mean over the clients "
               "holding the class, or `\"uniform\"`, their plain mean (open in the paper)."),
        Option("neg_reduction", str, "sum",
               "`\"sum\"` (the paper) or `\"mean\"` over the available negatives of the disc "
               "term (open in the paper)."),
        Option("kd_reduction", str, "mean",
               "`\"mean\"`: the squared distance divided by d' (what `nn.MSELoss` computes); "
               "`\"sum\"`: the paper's literal reading, summed over d'. With `\"sum\"` "
               "and `lam_kd = 10` every client's features collapse onto one point (accuracy at "
               "chance, measured on mnist-5k / LeNet5 and digits / MLP), while `\"mean\"` beats "
               "independent learning (`bench/colearn.py`)."),
        Option("eps", float, 1e-07,
               "the clamp of `h` to `[eps, 1 - eps]` (open in the paper).",
               minimum=0.0),
        Option("relay", str, "sets",
               "`\"sets\"`: the server relays M_down of the round's observation sets, each row "
               "with its sender (the paper's downlink); `\"pool\"`: the whole pool (at most "
               "`relay_pool` sets), from which every client draws its M_down peer sets (module "
               "docstring, Downlink)."),
        Option("relay_pool", int, None,
               "with `relay=\"pool\"`: how many observation sets the relay forwards (None: all "
               "of the round's accepted ones); at least `m_down + 1`."),
        Option("share_counts", bool, True,
               "upload the class counts (`true`) or only the classes' presence, counts clamped "
               "to 0 / 1 (module docstring, Privacy of the counts)."),
        Option("kd_target", str, "server",
               "`\"server\"`: the KD target is the server's global prototype; `\"peers\"`: the "
               "paper's peer-to-peer proxy (its peer-to-peer relaxation), the per-class mean of "
               "the observation sets the client uses."),
        Option("max_norm", float, 10000.0,
               "uploads with a prototype or observation of larger L2 norm are rejected.",
               minimum=0.0),
        Option("screening_ratio", float, 10.0,
               "an upload whose total count exceeds this many times the round's median total "
               "is rejected (a client inflating its weight); None disables it.",
               minimum=1.0, nullable=True),
        Option("independent_init", bool, True,
               "draw each client's network from its own seed (the CoLearn paper's independent "
               "random w_u, Algorithm 1); `false`: one initialisation per body spec."),
        Option("keep_optimizer", bool, True,
               "keep Adam's moments and step count in the client state across rounds, so a "
               "personal model trains as one long run (open in the paper); `false`: a fresh Adam "
               "per round."),
    )

    def __init__(
        self,
        context: StrategyContext,
        *,
        lam_kd: float = 10.0,
        lam_disc: float = 1.0,
        n_avg: int = 10,
        m_up: int = 1,
        m_down: int = 1,
        tau_disc: float = 1.0,
        statistics: str = "final",
        bootstrap: str = "upload",
        synchronous: bool = True,
        peer: str = "one",
        weighting: str = "count",
        neg_reduction: str = "sum",
        kd_reduction: str = "mean",
        eps: float = 1e-7,
        relay: str = "sets",
        relay_pool: int | None = None,
        share_counts: bool = True,
        kd_target: str = "server",
        max_norm: float = 1e4,
        screening_ratio: float | None = 10.0,
        independent_init: bool = True,
        keep_optimizer: bool = True,
    ) -> None:
        super().__init__(context, independent_init=independent_init,
                         keep_optimizer=keep_optimizer)
        self.lam_kd = option_number(self.name, "lam_kd", lam_kd)
        self.lam_disc = option_number(self.name, "lam_disc", lam_disc)
        self.n_avg = option_integer(self.name, "n_avg", n_avg, 1)
        self.m_up = option_integer(self.name, "m_up", m_up, 1)
        self.m_down = option_integer(self.name, "m_down", m_down, 1)
        self.tau_disc = option_number(self.name, "tau_disc", tau_disc, 1e-6)
        self.eps = option_number(self.name, "eps", eps, 0.0)
        if not 0 < self.eps < 0.5:
            raise ConfigError(f"colearn eps must lie in (0, 0.5), got {eps!r}")
        self.max_norm = option_number(self.name, "max_norm", max_norm, 0.0)
        self.screening_ratio = None if screening_ratio is None else option_number(
            self.name, "screening_ratio", screening_ratio, 1.0)
        self.relay_pool = None if relay_pool is None else option_integer(
            self.name, "relay_pool", relay_pool, self.m_down + 1)
        for option, value, valid in (
                ("statistics", statistics, self.STATISTICS),
                ("bootstrap", bootstrap, self.BOOTSTRAP), ("peer", peer, self.PEER),
                ("weighting", weighting, self.WEIGHTING),
                ("neg_reduction", neg_reduction, self.REDUCTION),
                ("kd_reduction", kd_reduction, self.REDUCTION),
                ("kd_target", kd_target, self.KD_TARGET), ("relay", relay, self.RELAY)):
            if value not in valid:
                raise ConfigError(f"colearn {option} must be one of {', '.join(valid)}; "
                                  f"got {value!r}")
        if synchronous is not True:
            raise ConfigError("colearn synchronous must be true: the transport broadcasts once "
                              "per round, so the paper's sequential listing (later clients "
                              "see fresher prototypes) cannot be run; use fraction < 1 for "
                              "stale prototypes")
        self.statistics, self.bootstrap, self.peer = statistics, bootstrap, peer
        self.weighting, self.neg_reduction, self.kd_reduction = (weighting, neg_reduction,
                                                                 kd_reduction)
        self.synchronous, self.kd_target, self.relay = True, kd_target, relay
        if relay_pool is not None and relay != "pool":
            raise ConfigError(f"colearn relay_pool caps the relayed pool: it needs "
                              f"relay='pool', got relay={relay!r} (which sends m_down sets)")
        if not isinstance(share_counts, bool):
            raise ConfigError(f"colearn share_counts must be true or false, got "
                              f"{share_counts!r}")
        self.share_counts = share_counts
        # the bootstrap upload is a round 0 that the transport runs with every client
        self.init_round = bootstrap == "upload"  # type: ignore[misc]

    def init_client(self, config: ClientConfig) -> ClientState:
        """The personal state plus (``relay="sets"``) the last used observation sets, none
        yet: ``relay.kept`` (M_down, C, d') and ``relay.kept_available`` (M_down, C)."""
        state = super().init_client(config)
        if self.relay == "sets":
            state[KEPT] = torch.zeros(self.m_down, self.num_classes, self.feature_dim)
            state[KEPT_AVAILABLE] = torch.zeros(self.m_down, self.num_classes)
        return state

    def build_model(self, body: nn.Module) -> nn.Module:
        return PrototypeNet(body, self.feature_dim, self.num_classes)

    def loss_weights(self) -> dict[str, float]:
        return {"ce": 1.0, "kd": self.lam_kd, "disc": self.lam_disc}

    # ==== server half ======================================================================
    def init(self) -> ServerState:
        """Empty prototypes and pool, or (``bootstrap="random"``) random ones."""
        C, d = self.num_classes, self.feature_dim
        # the relay's senders: one per set ("pool", (S,)) or one per row ("sets", (M_down, C))
        per_row = (C,) if self.relay == "sets" else ()
        if self.bootstrap != "random":
            return {"prototypes": torch.zeros(C, d), "counts": torch.zeros(C, dtype=torch.float64),
                    "pool": torch.zeros(0, C, d), "pool_present": torch.zeros(0, C),
                    "pool_sources": torch.zeros(0, *per_row, dtype=torch.int64),
                    "drift": torch.zeros(1, dtype=torch.float64)}
        g = torch.Generator().manual_seed(derived_seed(self.context.seed, 31))
        sets = self.m_down if self.relay == "sets" else self.context.clients * self.m_up
        return {"prototypes": torch.rand(C, d, generator=g),
                "counts": torch.ones(C, dtype=torch.float64),
                "pool": torch.rand(sets, C, d, generator=g), "pool_present": torch.ones(sets, C),
                "pool_sources": torch.full((sets, *per_row), -1, dtype=torch.int64),
                "drift": torch.zeros(1, dtype=torch.float64)}

    def broadcast_tensors(self, state: ServerState, round: int) -> dict[str, Tensor]:
        return {"prototypes": state["prototypes"],
                "present": (state["counts"] > 0).to(torch.float32),
                "observations": state["pool"], "observations_present": state["pool_present"],
                "observation_sources": state["pool_sources"]}

    def configure_evaluation(self, state: ServerState, round: int) -> Message:
        """Nothing: a client predicts with its own network."""
        return self.down_message(round, {})

    def upload_schema(self, state: ServerState, round: int) -> Schema:
        C, d = self.num_classes, self.feature_dim
        return {"prototypes": TensorSpec((C, d), torch.float32),
                "observations": TensorSpec((self.m_up, C, d), torch.float32),
                "counts": TensorSpec((C,), torch.int64)}

    def upload_problems(self, plan: RoundPlan, messages: Sequence[Message]) -> list[str | None]:
        """Per upload, the first violated invariant: non-negative counts with at least one
        sample; zero prototype and observations for a class of count 0; non-negative
        features (every body ends in a ReLU) of L2 norm at most ``max_norm``; a total count at
        most ``screening_ratio`` times the round's median total."""
        totals = torch.tensor([float(m.tensors["counts"].sum()) for m in messages],
                              dtype=torch.float64)
        return first_reasons([self._problem(m) for m in messages],
                             screening_reasons(totals, self.screening_ratio, "total count"))

    def _problem(self, message: Message) -> str | None:
        counts = message.tensors["counts"]
        protos, obs = message.tensors["prototypes"], message.tensors["observations"]
        if (counts < 0).any():
            return "negative class counts"
        if not self.share_counts and (counts > 1).any():
            return ("class counts above 1 while share_counts is off: upload the classes' "
                    "presence (0 / 1) only")
        if int(counts.sum()) < 1:
            return "no samples: every class count is 0"
        absent = counts == 0
        if (protos[absent] != 0).any() or (obs[:, absent] != 0).any():
            return "non-zero prototype or observation for a class with count 0"
        if (protos < 0).any() or (obs < 0).any():
            return ("negative feature values: prototypes and observations are means of "
                    "non-negative (post-ReLU) features, not parameters")
        largest = max(float(protos.norm(dim=-1).max()), float(obs.norm(dim=-1).max()))
        if largest > self.max_norm:
            return f"feature norm {largest:.3g} exceeds max_norm {self.max_norm:g}"
        return None

    def aggregate(
        self,
        state: ServerState,
        uploads: Sequence[Message],
        round: int,
        generator: torch.Generator,
    ) -> ServerState:
        """Count-weighted (or uniform) prototypes; of the round's observation sets, the
        ``M_down`` relayed ones (``relay="sets"``, `select_relay`) or all of them,
        shuffled (``"pool"``, at most ``relay_pool``)."""
        if not uploads:
            return state
        counts = torch.stack([u.tensors["counts"].to(torch.float64) for u in uploads])
        protos = torch.stack([u.tensors["prototypes"].to(torch.float64) for u in uploads])
        weights = counts if self.weighting == "count" else (counts > 0).to(counts)
        total = weights.sum(0)
        mean = (weights[:, :, None] * protos).sum(0) / total.clamp_min(1.0)[:, None]
        held = total > 0  # a class nobody uploaded keeps its previous prototype
        prototypes = torch.where(held[:, None], mean.to(torch.float32), state["prototypes"])
        new_counts = torch.where(held, counts.sum(0), state["counts"])
        pool = torch.cat([u.tensors["observations"] for u in uploads])
        present = torch.cat([(u.tensors["counts"] > 0).to(torch.float32).expand(self.m_up, -1)
                             for u in uploads])
        sources = torch.tensor([u.header.client_id for u in uploads for _ in range(self.m_up)],
                               dtype=torch.int64)
        moved = (prototypes - state["prototypes"]).to(torch.float64).norm(dim=-1)[held]
        out = {"prototypes": prototypes, "counts": new_counts,
               "drift": moved.mean().reshape(1)}
        if self.relay == "sets":
            sets, sets_present, row_sources = select_relay(pool, present, sources, self.m_down,
                                                           generator, peer=self.peer)
            return {**out, "pool": sets, "pool_present": sets_present,
                    "pool_sources": row_sources}
        order = torch.randperm(len(pool), generator=generator)
        if self.relay_pool is not None:
            order = order[: self.relay_pool]
        return {**out, "pool": pool[order], "pool_present": present[order],
                "pool_sources": sources[order]}

    def server_metrics(self, state: ServerState) -> dict[str, float]:
        """``prototype_drift`` (last round's mean L2 move of the uploaded classes' global
        prototypes) and ``prototype_spread`` (mean pairwise L2 distance between the global
        prototypes of the classes held; 0 with fewer than two)."""
        held = state["prototypes"][state["counts"] > 0].to(torch.float64)
        k = len(held)
        spread = float(torch.pdist(held).mean()) if k > 1 else 0.0
        return {"prototype_drift": float(state["drift"].item()), "prototype_spread": spread}

    # ==== client half ======================================================================
    def fit(
        self,
        config: ClientConfig,
        state: ClientState,
        data: ClientData,
        broadcast: Message,
        generator: torch.Generator,
    ) -> tuple[ClientState, Message]:
        """Round 0 (bootstrap): upload statistics of the initial network. Otherwise train
        on the CoLearn objective, then upload."""
        model = self.client_model(config, state)
        round = broadcast.header.round
        if round == 0:
            features = batched_apply(model, data.train_x)[1]
            return state, self._upload(config, data, round, features, generator)
        targets = self._targets(config, broadcast, generator, state)
        running = torch.zeros(data.num_train, self.feature_dim, device=data.train_x.device)

        def collect(idx: Tensor, features: Tensor) -> None:
            running[idx] = features

        extra = self.train_personal(model, state, data, lambda *a: self._terms(targets, *a),
                                    generator, collect if self.statistics == "running" else None)
        if self.statistics == "final" or self.context.training.epochs == 0:
            features = batched_apply(model, data.train_x)[1]
        else:
            features = running
        new_state = {**model_state(model), **extra}
        if self.relay == "sets":  # what the client used: its fallback for a row of its own
            new_state[KEPT] = targets["observations"].detach().to("cpu", torch.float32)
            new_state[KEPT_AVAILABLE] = targets["available"].to("cpu", torch.float32)
        return new_state, self._upload(config, data, round, features, generator)

    def _targets(self, config: ClientConfig, broadcast: Message, generator: torch.Generator,
                 state: ClientState | None = None) -> dict[str, Tensor]:
        """KD prototypes and their presence, the observation sets used and their
        availability; ``state`` holds the last used sets (``relay="sets"``; None: none)."""
        device = self.context.device
        t = broadcast.tensors
        prototypes, present = t["prototypes"], t["present"]
        if self.relay == "sets":
            sets, sets_present, sources = (t["observations"], t["observations_present"],
                                           t["observation_sources"])
            if len(sets) == 0:  # nothing relayed yet (no bootstrap): no set to contrast with
                sets = torch.zeros(self.m_down, self.num_classes, self.feature_dim)
                sets_present = torch.zeros(self.m_down, self.num_classes)
                sources = torch.full((self.m_down, self.num_classes), -1)
            kept = (state or {}).get(KEPT, torch.zeros_like(sets))
            kept_available = (state or {}).get(KEPT_AVAILABLE, torch.zeros(sets.shape[:2]))
            obs, available = received_sets(sets, sets_present, sources, config.client_id,
                                           kept, kept_available)
            if self.kd_target == "peers":
                prototypes, present = peer_prototypes(
                    obs, available.float(), torch.full(available.shape, -1), config.client_id)
        else:
            obs, available = select_observations(
                t["observations"], t["observations_present"], t["observation_sources"],
                config.client_id, self.m_down, generator, peer=self.peer)
            if self.kd_target == "peers":
                prototypes, present = peer_prototypes(
                    t["observations"], t["observations_present"], t["observation_sources"],
                    config.client_id)
        # in the network's dtype whatever the broadcast's (a float64 relay from another server
        # is taken as pFedBayes takes its broadcast, not refused by the first matrix product)
        dtype = next(self.template(config.body).parameters()).dtype
        targets = {"prototypes": prototypes, "present": present, "observations": obs,
                   "available": available}
        return {key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
                for key, value in targets.items()}

    def _terms(self, targets: dict[str, Tensor], model: nn.Module, x: Tensor, y: Tensor,
               generator: torch.Generator) -> tuple[dict[str, Tensor], Tensor]:
        """Per-sample CE, KD and disc terms of a mini-batch (module docstring), features."""
        logits, features = model(x)
        ce = cross_entropy_per_sample(logits, y)
        gap = (features - targets["prototypes"][y]).pow(2)
        gap = gap.sum(1) if self.kd_reduction == "sum" else gap.mean(1)
        kd = targets["present"][y] * gap
        m = torch.randint(self.m_down, (len(y),), generator=generator).to(y.device)
        obs_logits = model.head(targets["observations"])  # (M_down, C, C): grads to the head
        disc = contrastive_terms(logits, obs_logits[m], y, targets["available"][m],
                                 tau=self.tau_disc, eps=self.eps,
                                 neg_reduction=self.neg_reduction)
        return {"ce": ce, "kd": kd, "disc": disc}, features

    def _upload(self, config: ClientConfig, data: ClientData, round: int, features: Tensor,
                generator: torch.Generator) -> Message:
        protos, counts = class_means(features, data.train_y, self.num_classes)
        if not self.share_counts:  # the classes held, not how many samples of each
            counts = counts.clamp(max=1)
        obs, _ = observation_sets(features, data.train_y, self.num_classes, self.m_up,
                                  self.n_avg, generator)
        return self.up_message(round, config.client_id, {
            "prototypes": protos.to(torch.float32), "observations": obs.to(torch.float32),
            "counts": counts})

    def predict(
        self, config: ClientConfig, state: ClientState, broadcast: Message, x: Tensor
    ) -> dict[str, Tensor]:
        """(n, C) float64 softmax of the client's own network on ``x`` (n, ...)."""
        logits, _ = batched_apply(self.client_model(config, state), x)
        return {PREDICTIVE: torch.softmax(logits.to(torch.float64), dim=-1).cpu()}


def upload_floats(num_classes: int, feature_dim: int, m_up: int = 1) -> int:
    """Feature floats of one CoLearn upload, ``(1 + m_up) C d'`` ("Communication")."""
    return (1 + m_up) * num_classes * feature_dim


def downlink_floats(num_classes: int, feature_dim: int, m_down: int = 1) -> int:
    """Feature floats of the paper's download per client and round, ``(M_down + 1) C d'``
    ("Communication"): the global prototypes and M_down observation sets."""
    return (m_down + 1) * num_classes * feature_dim


def model_floats(model: nn.Module) -> int:
    """Parameter count of a network (what FedAvg would send per client and round)."""
    return int(sum(p.numel() for p in model.parameters()))


__all__ = ["CoLearn", "contrastive_terms", "downlink_floats", "model_floats",
           "observation_sets", "peer_prototypes", "received_sets", "select_observations",
           "select_relay", "upload_floats"]
