"""What the bayesfl ServerApp and ClientApp say to each other inside Flower messages.

A round is **one message per client** (`ROUND`): it carries the round's broadcast to fit
on (``fit``, sampled clients only) and the evaluation broadcast of the previous round's state
(``evaluate``, when that round is evaluated); the client evaluates first (its state is still
the one that state was evaluated with in the simulator), then fits, and its reply carries the
upload (``upload``) and its calibration accumulator states (``evaluation``). The last message
of a run carries only ``evaluate`` (and ``personalize`` for strategies that personalise: the
reply adds ``personalized``, the accumulators of the personalised state).
`INFO` asks a node which client it is; `CALIBRATE` carries the temperature-scaling
step's proposals and result (`bayesfl.calibrate`); `SHIFT` the shift evaluation's
request and each site's states (`bayesfl.shift_protocol`). A message's content is one
``ConfigRecord`` under `RECORD` holding bayesfl messages as **bytes**
(`bayesfl.messages.encode`: safetensors plus a JSON header, digest or HMAC; never a
pickle) beside a few scalars (the round, flags); replies add a ``MetricRecord`` of timings under
`TIMING`. The bytes counted for communication are those of the bayesfl messages, as in
the simulator; Flower's own framing is on top.

The run configuration is Flower's run config (``[tool.flwr.app.config]`` in the app's
``pyproject.toml``, overridden with ``flwr run --run-config``): the keys are the flags of
``bayesfl run`` (``strategy``, ``dataset``, ``clients``, ``partition``, ``rounds``, ``seed``,
``body``, ``lr``, ...), strategy and data set options as ``option.NAME`` and
``dataset-option.NAME`` (a TOML table ``[tool.flwr.app.config.option]``) or as one string of
``KEY=VALUE`` pairs (``option = "alpha=0.01 prior=2.0"``: Flower's ``--run-config`` overrides
only keys the app's ``pyproject.toml`` lists), and the keys of `FlowerOptions` for the
deployment. ``out = ""``, ``threads = 0`` and ``data-seed = ""`` mean "not set".
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from bayesfl.config import SimulationConfig, check_threads
from bayesfl.engine.preflight import check_run_config
from bayesfl.errors import ConfigError, MessageRejected
from bayesfl.evaluation import (  # noqa: F401 - public here too (the ClientApp, tests)
    MAX_EVALUATION_BYTES,
    evaluation_tensors,
    read_evaluation,
)
from bayesfl.flower.options import FLOWER_KEYS, FlowerOptions
from bayesfl.settings import RUN_KEYWORDS, settings_from_mapping

RECORD = "bayesfl"
"""Key of the ConfigRecord that carries a step's bytes and scalars."""
TIMING = "timing"
"""Key of the MetricRecord of a reply's timings (seconds)."""

INFO = "query.info"
ROUND = "train.round"
CALIBRATE = "query.calibrate"
SHIFT = "query.shift"


_OPTION_KEYS = ("option", "strategy-options", "dataset-option", "dataset-options")
_UNSET_WHEN_EMPTY = ("out", "threads", "calibrate", "conformal", "data-loader", "shift", "ood")


def parse_run_config(run_config: Mapping[str, Any]) -> tuple[SimulationConfig, FlowerOptions]:
    """The experiment and the deployment options from Flower's (flat) run config.

    Keys: the flags of ``bayesfl run`` (``-`` or ``_``), ``option.NAME`` /
    ``dataset-option.NAME`` for options, and `FlowerOptions`'s fields.

    Raises:
        ConfigError: an unknown key (with the valid ones), a value of the wrong type, or
            ``authenticate`` (Flower has its own: TLS and SuperNode authentication).
    """
    raw: dict[str, Any] = {}
    flower: dict[str, Any] = {}
    for key, value in run_config.items():
        name = str(key).strip().replace("_", "-")
        head, dot, rest = name.partition(".")
        if dot:  # a flattened table: option.alpha -> {"option": {"alpha": ...}}
            table = raw.setdefault(head, {})
            if not isinstance(table, dict):
                raise ConfigError(f"run config: {head} is given both as a value and a table")
            table[rest] = value
        elif name in _UNSET_WHEN_EMPTY and value in ("", 0):
            continue  # the app's pyproject lists every key; "" / 0 means not set
        elif name == "data-seed" and isinstance(value, str) and not value.strip():
            continue  # "": the run's seed (0 is a seed, so only "" means not set)
        elif name in FLOWER_KEYS and name not in RUN_KEYWORDS:
            flower[FLOWER_KEYS[name]] = value
        elif name in _OPTION_KEYS and isinstance(value, str):
            # a string of KEY=VALUE pairs: what `flwr run --run-config` can override
            pairs = shlex.split(value)
            if pairs:
                raw[name] = pairs
        else:
            raw[name] = value
    settings = settings_from_mapping(raw, source="run config")
    for name in RUN_KEYWORDS:
        if name in settings and name != "progress":
            flower[name] = settings.pop(name)
        settings.pop("progress", None)
    if "out" in flower:
        flower["out"] = str(flower["out"])
    for name in ("shift", "ood"):
        if name in flower:
            flower[name] = tuple(flower[name])
    if flower.get("threads") is not None:
        flower["threads"] = check_threads(flower["threads"])
    config = SimulationConfig(**settings)
    check_run_config(config)  # the strategy, its option names, calibrate: before any data
    if config.authenticate:
        raise ConfigError("authenticate is not supported by the Flower adapter: use Flower's "
                          "TLS and SuperNode authentication (flower-superlink "
                          "--enable-supernode-auth) instead")
    options = FlowerOptions(**flower)
    if options.data_loader is not None and config.calibrate is not None:
        raise ConfigError("calibrate needs every client's held-out share of the run's data set; "
                          "with a per-site data-loader the server does not know the sites' "
                          "data: run calibrate without data-loader")
    if options.data_loader is not None and config.conformal is not None:
        raise ConfigError("conformal needs every client's held-out share of the run's data set; "
                          "with a per-site data-loader the server does not know the sites' "
                          "data: run conformal without data-loader")
    if options.data_loader is not None and options.ood:
        raise ConfigError("ood needs the run's data set on every site (the rows a client never "
                          "trained on are other sites' rows); with a per-site data-loader no "
                          "site holds them: drop ood (the input shifts work)")
    return config, options


# ---- records ------------------------------------------------------------------------------
def pack(data: bytes | None = None, *, timing: Mapping[str, float] | None = None,
         **scalars: int | float | str | bool | bytes) -> RecordDict:
    """A Flower RecordDict carrying bayesfl bytes ``data`` and ``scalars`` (named bytes
    included: a round's ``fit`` and ``evaluate`` parts) and timings."""
    values: dict[str, Any] = {k: v for k, v in scalars.items() if v is not None}
    if data is not None:
        values["message"] = bytes(data)
    content = RecordDict({RECORD: ConfigRecord(values)})
    if timing:
        content[TIMING] = MetricRecord({k: float(v) for k, v in timing.items()})
    return content


def unpack(content: RecordDict, *, max_bytes: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """The bayesfl bytes and scalars of a RecordDict built by `pack`.

    Raises:
        MessageRejected: no bayesfl record, no bytes, or more bytes than ``max_bytes``
            (checked before anything is parsed).
    """
    try:
        record = content.config_records[RECORD]
    except (KeyError, AttributeError) as err:
        raise MessageRejected(f"not a bayesfl reply: no {RECORD!r} config record") from err
    values = dict(record)
    data = values.pop("message", None)
    if not isinstance(data, bytes):
        raise MessageRejected(f"the {RECORD!r} record carries no message bytes "
                              f"(got {type(data).__name__})")
    if max_bytes is not None and len(data) > max_bytes:
        raise MessageRejected(f"oversized message: {len(data)} bytes > limit {max_bytes}")
    return data, values


def record_values(content: RecordDict) -> dict[str, Any]:
    """The scalars and byte parts of a RecordDict built by `pack`.

    Raises:
        MessageRejected: no bayesfl record.
    """
    try:
        return dict(content.config_records[RECORD])
    except (KeyError, AttributeError) as err:
        raise MessageRejected(f"not a bayesfl reply: no {RECORD!r} config record") from err


def part(values: Mapping[str, Any], name: str, *, max_bytes: int) -> bytes | None:
    """The byte part ``name`` of a record's values (None when absent).

    Raises:
        MessageRejected: not bytes, or more than ``max_bytes`` (checked before parsing).
    """
    data = values.get(name)
    if data is None:
        return None
    if not isinstance(data, bytes):
        raise MessageRejected(f"part {name!r} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise MessageRejected(f"oversized message: {len(data)} bytes > limit {max_bytes}")
    return data


def timings(content: RecordDict) -> dict[str, float]:
    """The timing metrics of a reply (empty when it has none)."""
    record = content.metric_records.get(TIMING)
    return {} if record is None else {k: float(v) for k, v in record.items()
                                      if isinstance(v, int | float)}


MESSAGE_STAMPS = (("at.pushed", ""), ("at.delivered", "pull_wait"), ("at.process", "spawn"),
                  ("at.loaded", "flower_start"), ("at.start", "app_call"),
                  ("at.end", "handler"), ("at.received", "reply"))
"""A round message's way, stamp by stamp (seconds since the epoch), and the segment that ends at
each stamp:

* ``pull_wait`` (``at.pushed``, the ServerApp pushed it -> ``at.delivered``, the SuperLink gave
  it to the SuperNode's pull): the SuperNode's wait for its next pull, at most its 3 s sleep
  after an empty pull;
* ``spawn`` (-> ``at.process``, the ``flwr-clientapp`` process started): the SuperNode stores
  the message and the SuperExec's task poll starts the process;
* ``flower_start`` (-> ``at.loaded``, the ClientApp module imported): Python starting, Flower's
  command imported, the task and FAB pulled, the FAB installed, the app imported;
* ``app_call`` (-> ``at.start``, the handler started): Flower calling the ClientApp;
* ``handler`` (-> ``at.end``): bayesfl's own step (its parts are the reply's other timings);
* ``reply`` (-> ``at.received``, the ServerApp's poll got the reply): the ClientApp pushing the
  reply to its SuperNode, the SuperNode's 0.5 s wait for it, its push to the SuperLink and the
  ServerApp's next poll.

The node's stamps are on the node's clock, the others on the server's: on one machine (as under
`bayesfl.flower.local.LocalFederation`) the segments add up to the message's wall time."""

HANDLER_PARTS = ("import", "setup", "evaluate", "fit", "save", "encode")
"""The parts of a round message's handler its reply times (`bayesfl.flower.client_app`)."""


def message_segments(stamps: Mapping[str, float]) -> dict[str, float]:
    """The segments of `MESSAGE_STAMPS` between the stamps ``stamps`` holds (seconds); a
    missing stamp joins its two segments into one named ``a+b``."""
    out: dict[str, float] = {}
    previous: float | None = None
    names: list[str] = []
    for key, name in MESSAGE_STAMPS:
        if name:
            names.append(name)
        value = stamps.get(key)
        if value is None:
            continue
        if previous is not None:
            out["+".join(names)] = value - previous
        previous, names = value, []
    return out


def round_timeline(started_at: float, ended_at: float,
                   client_stamps: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """Where a Flower round's wall time went, along its critical path: the client whose reply
    came last (``client``). ``before_push`` (round start to the push: sampling, configure,
    encode), that client's `message_segments`, ``after_last_reply`` (decoding, validation,
    aggregation, the evaluation broadcast); they add up to ``ended_at - started_at``. Beside them
    ``handler_parts`` (`HANDLER_PARTS` of its handler) and ``cpu`` (its process's CPU
    seconds, Flower's start included). Empty when no reply carries the stamps."""
    timed = {c: t for c, t in client_stamps.items() if "at.received" in t and "at.pushed" in t}
    if not timed:
        return {}
    cid = max(timed, key=lambda c: timed[c]["at.received"])
    stamps = timed[cid]
    timeline: dict[str, Any] = {"client": int(cid),
                                "before_push": stamps["at.pushed"] - started_at}
    timeline.update(message_segments(stamps))
    timeline["after_last_reply"] = ended_at - stamps["at.received"]
    timeline["handler_parts"] = {k: stamps[k] for k in HANDLER_PARTS if k in stamps}
    if "cpu" in stamps:
        timeline["cpu"] = stamps["cpu"]
    return timeline


def scalar(values: Mapping[str, Any], name: str, kind: type) -> Any:
    """``values[name]`` checked to be of ``kind`` (bool is not an int here).

    Raises:
        MessageRejected: missing or of another type.
    """
    value = values.get(name)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise MessageRejected(f"field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def describe_error(error: Any) -> str:
    """A Flower ``Error`` as one line (its code and reason)."""
    reason = " ".join(str(getattr(error, "reason", "") or "").split())
    return f"Flower error {getattr(error, 'code', '?')}: {reason[:500]}"


