"""Label-based partitions of a pooled data set over federated clients.

A partition maps each client to the sorted int64 indices of the samples it holds. Schemes are
short strings (the CLI flag ``--partition``), parsed by `PartitionScheme`:

``iid``
    Shuffle, then cut into ``num_clients`` nearly equal parts.
``dirichlet:ALPHA``
    For every class, client proportions ~ Dirichlet(ALPHA * 1). Proportions are drawn in log
    space (Gamma variates via ``log U / alpha``), so a tiny ALPHA never gives NaN; counts are
    rounded by largest remainder so every sample is assigned. A client left with fewer than
    ``min_samples`` samples is topped up from the largest client, one sample at a time (no
    resampling loop that may never end).
``shards:K``
    Pathological label skew (FedLog / LG-FedAvg): every client holds K *distinct* classes; the
    class slots are balanced (each class goes to ``floor`` or ``ceil`` of ``num_clients*K/C``
    clients), and a class's samples are cut into equal random shards, one per client holding it.
    LG-FedAvg lets a client draw the same class twice; here it cannot, so "K classes" holds
    exactly whenever each class has at least as many samples as clients holding it.
``shards`` (the default of a run)
    ``shards:2`` where the clients can cover every class with two each (``2 x clients >= C``),
    else as few as cover them all, ``ceil(C / clients)`` each (``shards:4`` for 10 classes on 3
    clients, all classes on one client), so the default works for any number of clients. An
    explicit ``shards:K`` that cannot cover every class is refused instead.
``per_class:N`` or ``per_class:N:K``
    Every client gets N samples of each of its classes (FedSI's small/large regimes); with K,
    each client holds K distinct classes chosen as in ``shards:K``, otherwise all classes.
    Samples beyond what the clients take are left unassigned (each sample is assigned at most
    once); the total N per class is the client's train + test pool (see ``make_clients``).

``labels:K`` with optional ``:train=N``, ``:test=M`` and ``:random``
    Label skew with FedSI's (pFedMe/pFedBayes') *sliding window*: client u holds the K labels
    ``{(u + j) mod C : j = 0..K-1}`` (so with 10 clients and K = 5 every label sits on exactly 5
    clients); ``:random`` draws balanced random K-subsets instead (as ``shards:K``). Without
    ``train=N`` a class's samples are cut into equal random shards, one per holder, and
    ``make_clients`` splits each client by ``test_fraction``. With ``train=N`` the split is
    fixed here, per class and per client, as FedSI's data-size regimes are: every holder gets N
    training samples of the class, and the class's remaining samples are shared equally among
    its holders as test samples (at most M each with ``test=M``). ``labels:5:train=50`` is
    FedSI's *small* regime (250 training images per client).

Every scheme is deterministic given ``seed`` (numpy PCG64) and uses only the classes present in
``labels``. For iid, dirichlet and shards every sample is assigned exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from bayesfl.errors import ConfigError, DataError

PARTITION_SCHEMES: dict[str, str] = {
    "iid": "iid (uniform shuffle, equal sizes)",
    "dirichlet": "dirichlet:ALPHA (label skew, ALPHA > 0; smaller is more skewed)",
    "shards": "shards:K (each client holds K distinct classes) or shards (2 classes each, "
              "more where fewer than C/2 clients must cover C classes)",
    "per_class": "per_class:N or per_class:N:K (N samples per class per client, K classes each)",
    "labels": "labels:K[:train=N][:test=M][:random] (K labels per client, sliding window; "
              "N training / M test samples per class per client)",
}


def _valid_forms() -> str:
    return "; ".join(PARTITION_SCHEMES.values())


@dataclass(frozen=True)
class PartitionScheme:
    """A parsed partition scheme; ``str(scheme)`` gives back its canonical string.

    ``kind`` is one of `PARTITION_SCHEMES`. ``alpha`` is set for ``dirichlet``,
    ``classes_per_client`` for ``shards`` and ``labels`` (and optionally ``per_class``),
    ``samples_per_class`` for ``per_class``; ``train_per_class``, ``test_per_class`` and
    ``random_labels`` only for ``labels``.
    """

    kind: str
    alpha: float | None = None
    classes_per_client: int | None = None
    samples_per_class: int | None = None
    train_per_class: int | None = None
    test_per_class: int | None = None
    random_labels: bool = False

    @property
    def fixes_split(self) -> bool:
        """Whether the scheme itself says which samples train and which test (``labels`` with
        ``train=N``); ``make_clients`` then ignores ``test_fraction``."""
        return self.train_per_class is not None

    @classmethod
    def parse(cls, text: str) -> PartitionScheme:
        """Parse ``"iid"``, ``"dirichlet:0.5"``, ``"shards:2"``, ``"per_class:50:5"``, ...

        Raises:
            ConfigError: naming the valid forms, for anything else.
        """
        if not isinstance(text, str):
            raise ConfigError(f"partition scheme must be a string, got {type(text).__name__}; "
                              f"valid forms: {_valid_forms()}")
        kind, *args = text.strip().split(":")
        kind = kind.strip().lower()
        if kind not in PARTITION_SCHEMES:
            raise ConfigError(f"unknown partition scheme {text!r}; valid forms: {_valid_forms()}")
        try:
            if kind == "iid" and not args:
                return cls("iid")
            if kind == "dirichlet" and len(args) == 1:
                alpha = float(args[0])
                if math.isfinite(alpha) and alpha > 0:
                    return cls("dirichlet", alpha=alpha)
            if kind == "shards" and not args:  # K = 2, or as many as cover every class
                return cls("shards")
            if kind == "shards" and len(args) == 1:
                k = _positive_int(args[0])
                return cls("shards", classes_per_client=k)
            if kind == "per_class" and len(args) in (1, 2):
                n = _positive_int(args[0])
                k = _positive_int(args[1]) if len(args) == 2 else None
                return cls("per_class", classes_per_client=k, samples_per_class=n)
            if kind == "labels" and args:
                return cls._parse_labels(args)
        except ValueError:
            pass
        raise ConfigError(f"malformed partition scheme {text!r}; valid forms: {_valid_forms()}")

    @classmethod
    def _parse_labels(cls, args: list[str]) -> PartitionScheme:
        k = _positive_int(args[0])
        fields: dict[str, int] = {}
        random_labels = False
        for token in (a.strip().lower() for a in args[1:]):
            key, eq, value = token.partition("=")
            if token == "random" and not random_labels:
                random_labels = True
            elif eq and key in ("train", "test") and key not in fields:
                fields[key] = _positive_int(value)
            else:
                raise ValueError(token)
        if "test" in fields and "train" not in fields:
            raise ValueError("test= needs train=")
        return cls("labels", classes_per_client=k, train_per_class=fields.get("train"),
                   test_per_class=fields.get("test"), random_labels=random_labels)

    def __str__(self) -> str:
        if self.kind == "labels":
            text = f"labels:{self.classes_per_client}"
            if self.train_per_class is not None:
                text += f":train={self.train_per_class}"
            if self.test_per_class is not None:
                text += f":test={self.test_per_class}"
            return text + (":random" if self.random_labels else "")
        if self.kind == "dirichlet":
            return f"dirichlet:{self.alpha:g}"
        if self.kind == "shards":
            k = self.classes_per_client
            return "shards" if k is None else f"shards:{k}"
        if self.kind == "per_class":
            suffix = f":{self.classes_per_client}" if self.classes_per_client else ""
            return f"per_class:{self.samples_per_class}{suffix}"
        return self.kind


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def partition(
    labels: np.ndarray | torch.Tensor,
    num_clients: int,
    scheme: str | PartitionScheme,
    *,
    seed: int,
    min_samples: int = 1,
) -> list[np.ndarray]:
    """Split sample indices over clients according to ``scheme``.

    Args:
        labels: (N,) integer class labels of the pooled data set.
        num_clients: number of clients M >= 1.
        scheme: a scheme string (see the module docstring) or a parsed `PartitionScheme`.
        seed: seed of the numpy generator; the same inputs and seed give the same partition.
        min_samples: the fewest samples a client may hold (``make_clients`` asks for 2: one to
            train, one to test). Dirichlet tops small clients up from the largest one; the other
            schemes raise DataError when a client falls short.

    Returns:
        M arrays of sorted int64 sample indices, pairwise disjoint, each of at least
        ``min_samples`` samples.

    Raises:
        ConfigError: a malformed scheme or ``num_clients < 1``.
        DataError: more clients than samples, or a scheme the labels cannot satisfy (a client
            would be empty, too few samples of a class for ``per_class``, ...).
    """
    parsed = scheme if isinstance(scheme, PartitionScheme) else PartitionScheme.parse(scheme)
    y = _as_label_array(labels)
    if not isinstance(num_clients, int | np.integer) or num_clients < 1:
        raise ConfigError(f"num_clients must be a positive integer, got {num_clients!r}")
    if min_samples < 1:
        raise ConfigError(f"min_samples must be >= 1, got {min_samples}")
    if num_clients * min_samples > len(y):
        raise DataError(f"{num_clients} clients but only {len(y)} samples: every client needs "
                        f"at least {min_samples} sample(s); use fewer clients")
    rng = np.random.default_rng(seed)
    if parsed.kind == "iid":
        parts = _iid(len(y), num_clients, rng)
    elif parsed.kind == "dirichlet":
        parts = _dirichlet(y, num_clients, parsed.alpha, min_samples, rng)
    elif parsed.kind == "shards":
        parts = _shards(y, num_clients, parsed.classes_per_client, rng)
    elif parsed.kind == "labels":
        parts = [np.concatenate(pair) for pair in _labels(y, num_clients, parsed, rng)]
    else:
        parts = _per_class(y, num_clients, parsed.samples_per_class,
                           parsed.classes_per_client, rng)
    result = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    small = [i for i, p in enumerate(result) if len(p) < min_samples]
    if small:
        raise DataError(f"partition {parsed} leaves clients {small[:10]} with fewer than "
                        f"{min_samples} sample(s) ({len(y)} samples, {num_clients} clients); "
                        "use fewer clients or another scheme")
    return result


def fixed_split(
    labels: np.ndarray | torch.Tensor, num_clients: int, scheme: str | PartitionScheme, *,
    seed: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per client, the (train, test) sample indices of a scheme that fixes the split itself
    (``labels:K:train=N``); their union is what `partition` gives that client.

    Raises:
        ConfigError: a scheme that does not fix the split (see
            [`PartitionScheme.fixes_split`][bayesfl.data.partition.PartitionScheme.fixes_split]).
        DataError: as [`partition`][bayesfl.data.partition.partition].
    """
    parsed = scheme if isinstance(scheme, PartitionScheme) else PartitionScheme.parse(scheme)
    if not parsed.fixes_split:
        raise ConfigError(f"partition {parsed} does not fix a train/test split; only "
                          "labels:K:train=N does (others are split by test_fraction)")
    partition(labels, num_clients, parsed, seed=seed)  # the same checks, the same draws
    pairs = _labels(_as_label_array(labels), num_clients, parsed, np.random.default_rng(seed))
    return [(np.sort(train.astype(np.int64)), np.sort(test.astype(np.int64)))
            for train, test in pairs]


def window_classes(classes: np.ndarray, num_clients: int, k: int) -> list[np.ndarray]:
    """The sliding-window label sets: client u holds ``classes[(u + j) mod C]``, j < k."""
    if k > len(classes):
        raise DataError(f"{k} labels per client requested but the labels hold only "
                        f"{len(classes)} classes; use at most {len(classes)}")
    c = len(classes)
    return [np.sort(classes[[(u + j) % c for j in range(k)]]) for u in range(num_clients)]


def _labels(
    y: np.ndarray, num_clients: int, scheme: PartitionScheme, rng: np.random.Generator
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) index pairs of ``labels:K...``; without ``train=N`` every sample is the
    client's "train" part (``make_clients`` splits it by ``test_fraction``)."""
    classes = np.unique(y)
    k = scheme.classes_per_client
    class_sets = (assign_classes(classes, num_clients, k, rng) if scheme.random_labels
                  else window_classes(classes, num_clients, k))
    holders_of = _holders_by_class(class_sets)
    uncovered = sorted(set(classes.tolist()) - set(holders_of))
    if uncovered and scheme.train_per_class is None:
        raise DataError(f"partition {scheme} with {num_clients} clients leaves classes "
                        f"{uncovered[:10]} on no client; use more clients or more labels each")
    train: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    test: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in holders_of.items():
        members = rng.permutation(np.flatnonzero(y == c))
        n = scheme.train_per_class
        if n is None:
            for client, shard in zip(holders, np.array_split(members, len(holders)),
                                     strict=True):
                train[client].append(shard)
            continue
        if n * len(holders) >= len(members):
            raise DataError(f"partition {scheme}: class {c} has {len(members)} samples but its "
                            f"{len(holders)} clients need {n} training samples each and at "
                            "least one test sample; lower train=N or the labels per client")
        for j, client in enumerate(holders):
            train[client].append(members[j * n:(j + 1) * n])
        for client, rest in zip(holders, np.array_split(members[n * len(holders):],
                                                        len(holders)), strict=True):
            if len(rest) == 0:
                raise DataError(f"partition {scheme}: class {c} leaves client {client} no test "
                                "sample; lower train=N")
            test[client].append(rest[:scheme.test_per_class])
    empty = np.empty(0, np.int64)
    return [(np.concatenate(tr) if tr else empty, np.concatenate(te) if te else empty)
            for tr, te in zip(train, test, strict=True)]


def _as_label_array(labels: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1:
        raise DataError(f"labels must be a 1-D array of class indices, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise DataError(f"labels must be non-negative class indices, got min {y.min()}")
    return y.astype(np.int64)


def _iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(n), num_clients)


def _dirichlet(
    y: np.ndarray, num_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        counts = _largest_remainder(_log_dirichlet(alpha, num_clients, rng), len(members))
        for client, chunk in enumerate(np.split(members, np.cumsum(counts)[:-1])):
            parts[client].append(chunk)
    merged = [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]
    return _top_up_small_clients(merged, y, min_samples)


def _log_dirichlet(alpha: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Dirichlet(alpha * 1_size) draw computed in log space (never NaN, even for alpha=1e-6).

    Gamma(alpha) = Gamma(alpha + 1) * U^(1/alpha), so log G = log Gamma(alpha+1) + log(U)/alpha;
    normalising the Gammas is a softmax of their logs.
    """
    uniform = 1.0 - rng.uniform(size=size)  # in (0, 1], so its log is finite
    log_gamma = np.log(rng.gamma(alpha + 1.0, size=size)) + np.log(uniform) / alpha
    log_gamma -= log_gamma.max()
    weights = np.exp(log_gamma)
    return weights / weights.sum()


def _largest_remainder(proportions: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` closest to ``proportions * total``."""
    quota = proportions * total
    counts = np.floor(quota).astype(np.int64)
    shortfall = total - int(counts.sum())
    order = np.argsort(-(quota - counts), kind="stable")
    counts[order[:shortfall]] += 1
    return counts


def _top_up_small_clients(
    parts: list[np.ndarray], y: np.ndarray, min_samples: int
) -> list[np.ndarray]:
    """Move samples, one at a time, from the largest client to each client below ``min_samples``.

    The moved sample is of the donor's most frequent class. Every sample stays assigned exactly
    once; this always ends because the caller checked ``num_clients * min_samples <= N``.
    """
    parts = list(parts)
    for client in range(len(parts)):
        while len(parts[client]) < min_samples:
            donor = int(np.argmax([len(p) for p in parts]))
            donor_labels = y[parts[donor]]
            classes, counts = np.unique(donor_labels, return_counts=True)
            position = int(np.flatnonzero(donor_labels == classes[np.argmax(counts)])[-1])
            parts[client] = np.append(parts[client], parts[donor][position])
            parts[donor] = np.delete(parts[donor], position)
    return parts


def assign_classes(
    classes: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Balanced random class sets: each client gets ``classes_per_client`` distinct classes.

    Clients are visited in random order and each takes the least-used classes (ties broken at
    random), so every class is held by ``floor`` or ``ceil`` of ``num_clients*K/len(classes)``
    clients and the class pairs vary from client to client.

    Returns:
        ``num_clients`` sorted arrays of class labels.
    """
    if classes_per_client > len(classes):
        raise DataError(f"{classes_per_client} classes per client requested but the labels hold "
                        f"only {len(classes)} classes; use at most {len(classes)}")
    usage = np.zeros(len(classes), dtype=np.int64)
    assigned: list[np.ndarray] = [np.empty(0, np.int64)] * num_clients
    for client in rng.permutation(num_clients):
        tie_break = rng.permutation(len(classes))
        order = np.lexsort((tie_break, usage))  # least used first, random among equals
        chosen = order[:classes_per_client]
        usage[chosen] += 1
        assigned[client] = np.sort(classes[chosen])
    return assigned


def _holders_by_class(class_sets: list[np.ndarray]) -> dict[int, list[int]]:
    holders: dict[int, list[int]] = {}
    for client, class_set in enumerate(class_sets):
        for c in class_set:
            holders.setdefault(int(c), []).append(client)
    return holders


def _shards(
    y: np.ndarray, num_clients: int, classes_per_client: int | None, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = np.unique(y)
    if classes_per_client is None:  # plain "shards": 2 each, or as many as cover every class
        classes_per_client = min(len(classes), max(2, math.ceil(len(classes) / num_clients)))
    if num_clients * classes_per_client < len(classes):
        raise DataError(f"shards:{classes_per_client} with {num_clients} clients covers only "
                        f"{num_clients * classes_per_client} class slots but the labels hold "
                        f"{len(classes)} classes, so some samples could not be assigned; use "
                        "more clients or more classes per client")
    class_sets = assign_classes(classes, num_clients, classes_per_client, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in _holders_by_class(class_sets).items():
        members = rng.permutation(np.flatnonzero(y == c))
        for client, shard in zip(holders, np.array_split(members, len(holders)), strict=True):
            parts[client].append(shard)
    return [np.concatenate(p) for p in parts]


def _per_class(
    y: np.ndarray,
    num_clients: int,
    samples_per_class: int,
    classes_per_client: int | None,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    classes = np.unique(y)
    k = len(classes) if classes_per_client is None else classes_per_client
    class_sets = assign_classes(classes, num_clients, k, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in _holders_by_class(class_sets).items():
        members = rng.permutation(np.flatnonzero(y == c))
        needed = samples_per_class * len(holders)
        if needed > len(members):
            raise DataError(f"per_class:{samples_per_class} needs {needed} samples of class {c} "
                            f"({len(holders)} clients hold it) but only {len(members)} exist; "
                            "lower N, the number of clients or the classes per client")
        for j, client in enumerate(holders):
            parts[client].append(members[j * samples_per_class : (j + 1) * samples_per_class])
    return [np.concatenate(p) for p in parts]


def partition_summary(
    labels: np.ndarray | torch.Tensor, parts: list[np.ndarray], num_classes: int
) -> np.ndarray:
    """Counts of each class on each client.

    Returns:
        (num_clients, num_classes) int64 array; entry [i, c] is the number of samples of class c
        held by client i.
    """
    y = _as_label_array(labels)
    if y.size and y.max() >= num_classes:
        raise DataError(f"label {y.max()} out of range for num_classes={num_classes}")
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, indices in enumerate(parts):
        counts[client] = np.bincount(y[np.asarray(indices, dtype=np.int64)],
                                     minlength=num_classes)
    return counts


def format_partition_summary(
    labels: np.ndarray | torch.Tensor,
    parts: list[np.ndarray],
    num_classes: int,
    *,
    max_clients: int = 50,
) -> str:
    """A plain-text clients x classes table of `partition_summary`, with totals.

    Shows at most ``max_clients`` client rows (the rest are summarised in one line).
    """
    counts = partition_summary(labels, parts, num_classes)
    width = max(5, len(str(int(counts.max(initial=0)))) + 1, len(str(num_classes - 1)) + 2)
    header = "client".rjust(7) + "".join(f"c{c}".rjust(width) for c in range(num_classes))
    header += "total".rjust(width + 2) + "classes".rjust(8)
    rows = [header]
    for client, row in enumerate(counts[:max_clients]):
        rows.append(f"{client:>7d}" + "".join(f"{v:>{width}d}" for v in row)
                    + f"{int(row.sum()):>{width + 2}d}" + f"{int((row > 0).sum()):>8d}")
    if len(counts) > max_clients:
        rows.append(f"... {len(counts) - max_clients} more clients")
    totals = counts.sum(axis=0)
    rows.append("total".rjust(7) + "".join(f"{v:>{width}d}" for v in totals)
                + f"{int(totals.sum()):>{width + 2}d}")
    return "\n".join(rows)
