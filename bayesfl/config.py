"""The run configuration: `SimulationConfig`, the checks on it, and the documented limits.

Every field is checked for its type and range when a config is built, before any data is
loaded or memory allocated, so a wrong keyword argument or TOML value is a
[`ConfigError`][bayesfl.errors.ConfigError] that names the setting, shows what it got and says what
is valid. Types are strict: a bool is not an integer (``clients = true`` is refused, not read as
1), a string is not a number (``rounds = "ten"``), a float is not an integer (``seed = 1e3``),
and a flag is ``true`` or ``false`` (``batched = "no"`` is refused, not read as true). Integers
are accepted where a float is expected (``lr = 1`` is 1.0), and NumPy scalars like Python ones.

Limits (each refused with the number that was too large):

========================  =====================================================================
``seed``                  0 <= seed < 2**63 (NumPy and torch seeds are non-negative)
``data_seed``             None (the run's ``seed``) or 0 <= data_seed < 2**63
``feature_dim``           1 .. `MAX_FEATURE_DIM` (16,384)
``n_bins``                1 .. `MAX_BINS` (10,000), and clients x n_bins at most
                          `MAX_BIN_CELLS` (2**24: the per-client calibration tables)
``batch_size``            >= 1; a batch larger than a client's training set is full-batch
``clients x parameters``  the bodies of all clients together at most `MAX_PARAMETERS`
                          (10**9 float32 weights, 4 GB), counted before any is built
``threads``               1 .. `MAX_THREADS` (1,024); default `default_threads`
``lr``                    0 < lr <= `MAX_LR` (1): the local Adam learning rate
========================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from bayesfl.checks import check_integer, check_number, describe
from bayesfl.conformal_spec import parse_conformal
from bayesfl.data.datasets import check_dataset_options, dataset_key
from bayesfl.errors import ConfigError
from inference.threads import (  # noqa: F401 - part of this module's API
    MAX_THREADS,
    available_cores,
    default_threads,
    torch_threads,
)

MAX_FEATURE_DIM = 16_384
"""Largest body output width d: heads and FedLog's statistics are C x (d + 1), its Laplace
covariance factors grow with d; 16,384 is four times the widest feature layer in common use."""

MAX_BINS = 10_000
"""Most calibration bins: far beyond any useful ECE resolution (15 is usual)."""

MAX_BIN_CELLS = 1 << 24
"""Most (client, bin) cells: every round builds one calibration accumulator per client."""

MAX_PARAMETERS = 10**9
"""Most body parameters over all clients together (each client holds its own copy)."""


MAX_LR = 1.0
"""Largest local learning rate. Adam moves every weight by about ``lr`` per step whatever the
gradient's scale, so above 1 a step outweighs the weights it updates (initialised at about
``1 / sqrt(fan_in)``) and training can only diverge: ``lr = 1e10`` gave chance-level models
with losses of 1e33 and not a word. 1e-3 is the default (FedAvg on digits, 4 clients, 2 rounds,
was already at chance level at 0.1)."""

_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that determines a run's numbers (its fingerprint guards resumption).

    ``body`` is one body spec for all clients, or several separated by commas, assigned to
    clients in turn (client k gets spec ``k % len(specs)``): ``"mlp:200,mlp:100-100"``.
    ``batched`` trains clients of one architecture together (same results up to float
    rounding). ``authenticate`` signs every message with HMAC-SHA256 under per-client keys
    drawn for the run (`bayesfl.messages.KeyRing`); an upload whose HMAC does not verify
    under its sender's key is rejected. ``fraction`` of the clients (at least one) is sampled
    each training round.

    ``calibrate`` ends the run with a calibration step (`bayesfl.calibrate`):
    ``"temperature"`` (or ``"temperature:FRACTION"``) holds out that share of each
    client's training data and fits one temperature over all clients' held-out data.

    ``conformal`` ends the run with federated conformal prediction sets
    (`bayesfl.conformal`): ``"SCORE:ALPHA[:METHOD]"``, e.g. ``"aps:0.1"``, calibrated on
    the same held-out share of each client's training data (``calibrate``'s, default 0.2).

    ``novel_fraction`` holds out that share of the clients (``round(fraction x clients)``, at
    least one when > 0, drawn from the seed) from training: they never fit, only personalise
    after the last round (strategies that do; the others evaluate the global model), and their
    metrics are reported apart (``summary["novel"]``; FedSI's §IV-E experiment).

    ``seed`` drives the model's randomness (initialisation, batch order, client sampling,
    posterior draws); ``data_seed`` drives the data's: the data set's own draws
    (``load_dataset``), the partition, the clients' train/test split, the ``calibrate``
    hold-out and the novel clients. None (the default) is ``seed``, so a run that does not set
    it is the run it always was; runs that differ only in ``seed`` with one ``data_seed`` hold
    the same clients and rows (the members of a deep ensemble, `bayesfl.ensemble`).
    [`data_rng_seed`][bayesfl.config.SimulationConfig.data_rng_seed] is the seed in force.

    Raises:
        ConfigError: a value of the wrong type or out of range (module docstring), or a body
            string without a spec. Whether the strategy, its option names and the
            ``calibrate`` spec exist is checked at run start
            (`bayesfl.engine.preflight.check_run_config`): the config knows no strategy
            or calibration module.
    """

    strategy: str = "fedlog"
    dataset: str = "digits"
    clients: int = 20
    partition: str = "shards"
    rounds: int = 30
    seed: int = 0
    body: str = "mlp:200"
    feature_dim: int = 50
    local_epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 10
    fraction: float = 1.0
    test_fraction: float = 0.25
    batched: bool = True
    n_bins: int = 15
    device: str = "cpu"
    authenticate: bool = False
    calibrate: str | None = None
    conformal: str | None = None
    novel_fraction: float = 0.0
    strategy_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)
    data_seed: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name)))
        if self.clients * self.n_bins > MAX_BIN_CELLS:
            raise ConfigError(f"clients x n_bins = {self.clients * self.n_bins:,} is more than "
                              f"the limit {MAX_BIN_CELLS:,} (one calibration table per client); "
                              "use fewer bins")
        if not self.body_specs:
            raise ConfigError(f"body must name at least one body spec, got {self.body!r}; "
                              "e.g. 'mlp:200' or 'mlp:200,mlp:100-100'")
        key = dataset_key(self.dataset)
        if key is not None:  # other names label data passed in (simulate(data=...))
            # checked here, before a run directory is prepared; kept as given (fingerprints)
            check_dataset_options(key, self.dataset_options)

    @property
    def data_rng_seed(self) -> int:
        """The seed of everything data-related: ``data_seed``, or ``seed`` when it is None."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def body_specs(self) -> list[str]:
        return [s.strip() for s in self.body.split(",") if s.strip()]

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; ``data_seed`` and ``conformal`` only when set, so a run
        without them has the manifest, fingerprint and run identity it had before the settings
        existed."""
        out = dataclasses.asdict(self)
        for optional in ("data_seed", "conformal"):
            if out[optional] is None:
                del out[optional]
        return out


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SimulationConfig))

# field -> (lowest, highest) for integers; None: unbounded on that side
_INTEGERS: dict[str, tuple[int, int | None]] = {
    "clients": (1, None),
    "rounds": (0, None),
    "seed": (0, _SEED_LIMIT - 1),
    "data_seed": (0, _SEED_LIMIT - 1),
    "feature_dim": (1, MAX_FEATURE_DIM),
    "local_epochs": (0, None),
    "batch_size": (1, None),
    "n_bins": (1, MAX_BINS),
}
# field -> (test of the value, the valid range in words)
_FLOATS: dict[str, tuple[Any, str]] = {
    "lr": (lambda v: 0.0 < v < math.inf, "a finite number > 0"),
    "fraction": (lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
    "test_fraction": (lambda v: 0.0 < v < 1.0, "a number in (0, 1)"),
    "novel_fraction": (lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
}
_STRINGS = ("strategy", "dataset", "partition", "body", "device")
_BOOLS = ("batched", "authenticate")
_MAPPINGS = ("strategy_options", "dataset_options")


def check_setting(name: str, value: Any, *, label: str | None = None) -> Any:
    """Check one `SimulationConfig` field and return it normalised (NumPy scalars to
    Python numbers, integers to floats for float fields, mappings to plain dicts).

    Args:
        name: the field.
        value: its value.
        label: what the messages call the setting (e.g. the TOML key); default ``name``.

    Raises:
        ConfigError: ``value`` has the wrong type or lies out of range; the message names the
            setting, the value and what is valid.
    """
    label = label or name
    if name == "calibrate":  # None, "temperature" or "temperature:FRACTION"
        # the spec itself is parsed at run start (bayesfl.engine.preflight), by the calibrate
        # step's own parser: the config knows no calibration module
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"calibrate must be None or a method such as 'temperature' or "
                              f"'temperature:0.2', got {describe(value)}")
        return value if value is None else value.strip()
    if name == "conformal":  # None or "SCORE:ALPHA[:METHOD]"
        parse_conformal(value)
        return value if value is None else value.strip()
    if name == "data_seed" and value is None:  # None: the run's seed
        return None
    if name in _INTEGERS:
        low, high = _INTEGERS[name]
        return check_integer(label, value, low, high)
    if name in _FLOATS:
        test, valid = _FLOATS[name]
        number = check_number(label, value)
        if not test(number):
            raise ConfigError(f"{label} must be {valid}, got {number!r}")
        if name == "lr" and number > MAX_LR:
            raise ConfigError(f"{label} must be at most {MAX_LR:g}, got {number:g}: Adam moves "
                              "every weight by about lr per step, so a larger step outweighs "
                              "the weights and training diverges; the default is 1e-3")
        return number
    if name in _STRINGS:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{label} must be a non-empty string, got {describe(value)}")
        if name == "device":
            parse_device(value)
        return value
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{label} must be true or false, got {describe(value)}")
        return value
    if name in _MAPPINGS:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{label} must be a mapping of option names to values, e.g. "
                              f"{{'alpha': 0.01}}, got {describe(value)}")
        for key, option in value.items():
            if not _is_json_value(option):
                raise ConfigError(f"{label} {key}={option!r}: an option value must be a finite "
                                  "number, a string, a boolean or a list of them (a run's "
                                  "configuration is recorded as JSON)")
        return dict(value)
    raise ConfigError(f"unknown setting {name!r}; valid: {', '.join(CONFIG_FIELDS)}")


def _is_json_value(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, bool | str | numbers.Integral):
        return True
    if isinstance(value, numbers.Real):
        return math.isfinite(value)
    if isinstance(value, list | tuple) and depth < 4:
        return all(_is_json_value(v, depth + 1) for v in value)
    if isinstance(value, Mapping) and depth < 4:
        return all(isinstance(k, str) and _is_json_value(v, depth + 1) for k, v in value.items())
    return False


# ---- devices -------------------------------------------------------------------------------
def parse_device(text: str) -> torch.device:
    """The torch device named by ``text`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``), without
    checking that it exists here (`resolve_device` does).

    Raises:
        ConfigError: not a device name, or a kind of device runs do not support.
    """
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError, TypeError) as err:
        raise ConfigError(f"unknown device {text!r}; use cpu, cuda, cuda:N or mps") from err
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {text!r} is not supported for runs; use cpu, cuda, cuda:N "
                          "or mps")
    return device


def resolve_device(text: str) -> torch.device:
    """`parse_device`, then check that the device exists on this machine.

    Raises:
        ConfigError: e.g. ``cuda`` where torch finds no GPU, or ``cuda:3`` with two GPUs.
    """
    device = parse_device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {text!r}: CUDA is not available here (no GPU or driver "
                              f"found, or torch {torch.__version__} was built without CUDA); "
                              "use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {text!r}: this machine has {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {text!r}: MPS is not available here; use --device cpu")
    return device


# ---- model size ----------------------------------------------------------------------------
def check_model_size(config: SimulationConfig, input_shape: tuple[int, ...]) -> int:
    """Count the parameters of every client's body (built on the meta device: nothing is
    allocated) and refuse a run whose bodies together exceed `MAX_PARAMETERS`.

    Returns:
        the total number of body parameters over all clients.

    Raises:
        ConfigError: too many parameters (the message gives the count), or a bad body spec.
    """
    from bayesfl.bodies import build_body

    specs = config.body_specs
    sizes = {}
    for spec in set(specs):
        with torch.device("meta"):
            body = build_body(spec, input_shape, config.feature_dim)
        sizes[spec] = sum(p.numel() for p in body.parameters())
    total = sum(sizes[specs[k % len(specs)]] for k in range(config.clients))
    if total > MAX_PARAMETERS:
        largest = max(sizes, key=sizes.__getitem__)
        raise ConfigError(
            f"the clients' bodies would hold {total:,} parameters together ({config.clients} "
            f"clients; {largest!r} with feature_dim {config.feature_dim} has "
            f"{sizes[largest]:,}), more than the limit {MAX_PARAMETERS:,}; use narrower bodies, "
            "a smaller feature_dim or fewer clients")
    return total


# ---- threads -------------------------------------------------------------------------------
def check_threads(value: Any) -> int:
    """``value`` as a thread count in ``[1, MAX_THREADS]``; None means `default_threads`.

    Raises:
        ConfigError: not an integer, or out of range.
    """
    if value is None:
        return default_threads()
    return check_integer("threads", value, 1, MAX_THREADS)


__all__ = [
    "CONFIG_FIELDS",
    "MAX_BINS",
    "MAX_BIN_CELLS",
    "MAX_FEATURE_DIM",
    "MAX_LR",
    "MAX_PARAMETERS",
    "MAX_THREADS",
    "SimulationConfig",
    "check_integer",
    "check_model_size",
    "check_number",
    "check_setting",
    "check_threads",
    "default_threads",
    "describe",
    "parse_device",
    "resolve_device",
    "torch_threads",
]
