"""A Flower deployment on one machine: a SuperLink and N SuperNodes on 127.0.0.1.

`LocalFederation` starts ``flower-superlink`` and one ``flower-supernode`` per client
(``partition-id=i num-partitions=N``), each in its own process group (own session), on free
loopback ports, with telemetry and update checks off and ``FLWR_HOME`` in a private
directory; `LocalFederation.run` submits an app with ``flwr run`` and reads the run's
final status with ``flwr ls`` (``flwr run`` can exit 0 although the run failed); every wait
is bounded. `LocalFederation.stop` stops each process it started by its own group id,
then any descendant that left the group (SuperNodes and the SuperLink spawn
``flower-superexec`` children), first with SIGTERM, then SIGKILL. An owner that dies without
``stop()`` (SIGKILL, a crash) takes them along on Linux: each gets SIGTERM from the kernel
(`with_parent_death_signal`).

Nothing listens beyond 127.0.0.1: the SuperLink binds ``--host 127.0.0.1`` and each
SuperNode's runtime API ``--host 127.0.0.1``. Connections are ``--insecure`` (plain HTTP),
which is fine on loopback and nowhere else (see the README's "Running on Flower").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bayesfl.errors import BayesFLError, ConfigError

EXAMPLE_APP = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
"""The example Flower app of this repository (``examples/flower_app``)."""

CONNECTION = "bayesfl-local"
"""Name of the SuperLink connection written to the private ``FLWR_HOME/config.toml``."""


class FlowerRunError(BayesFLError):
    """A Flower run that did not finish as completed, or a deployment that did not start."""


@dataclass
class RunStatus:
    """A Flower run's final state as ``flwr ls`` reports it.

    Attributes:
        run_id: Flower's run id.
        status: e.g. ``"finished:completed"``, ``"finished:failed"``, or the last status
            seen when the wait ran out.
        details: Flower's status details.
        seconds: wall time from submission to the final status.
        log: the output of ``flwr run``.
    """

    run_id: int
    status: str
    details: str
    seconds: float
    log: str = ""

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_environment(home: Path) -> dict[str, str]:
    """The environment of every Flower process: private FLWR_HOME, no telemetry, no update
    check, this interpreter's scripts first on PATH (so ``flwr-serverapp`` and
    ``flwr-clientapp`` run with this environment's bayesfl)."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env.update(FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               PATH=bin_dir + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1")
    # the SuperExecs poll for tasks every second by default: a step waits less at 0.2 s
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")
    return env


class LocalFederation:
    """A SuperLink and ``nodes`` SuperNodes on 127.0.0.1 (module docstring).

    Use as a context manager (``with LocalFederation(3) as fed: fed.run(...)``): the
    processes are stopped on exit, whatever happened.

    Args:
        nodes: number of SuperNodes; node i gets ``partition-id=i num-partitions=nodes``.
        workdir: where FLWR_HOME and the logs go (default: a new temporary directory).
        start_timeout: seconds to wait for the SuperLink to listen.
        node_config: more node-config keys for every SuperNode (each site's own settings,
            e.g. ``{"data-loaders": "site.data:load"}``, the loaders it allows:
            `bayesfl.flower.client_app.NODE_LOADERS`); values bool, number or string.
        node_configs: node i's keys over ``node_config`` (a site set up otherwise).
    """

    def __init__(self, nodes: int, *, workdir: str | Path | None = None,
                 start_timeout: float = 120.0, node_config: Mapping[str, Any] | None = None,
                 node_configs: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"nodes must be an integer >= 1, got {nodes!r}")
        self.num_nodes = nodes
        self.node_config = dict(node_config or {})
        self.node_configs = {int(i): dict(c) for i, c in (node_configs or {}).items()}
        for extra in (self.node_config, *self.node_configs.values()):
            node_config_text(extra)  # a value Flower cannot read is refused here
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(
            prefix="bayesfl-flower-")
        self.workdir = Path(workdir if workdir is not None else self._tmp.name).resolve()
        self.home = self.workdir / "flwr-home"
        self.env = flower_environment(self.home)
        self.start_timeout = start_timeout
        self.port = 0
        self.superlink: subprocess.Popen[bytes] | None = None
        self.supernodes: list[subprocess.Popen[bytes] | None] = []
        self._descendants: set[tuple[int, str]] = set()  # (pid, start time)

    # ---- processes ----------------------------------------------------------------------
    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / log_name, "ab")  # noqa: SIM115 - owned by the child
        try:
            return subprocess.Popen(with_parent_death_signal(args), stdout=log,
                                    stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env, cwd=self.workdir,
                                    start_new_session=True)
        finally:
            log.close()

    def _script(self, name: str) -> str:
        return str(Path(sys.executable).parent / name)

    def start(self) -> None:
        """Start the SuperLink, wait until it listens, then start the SuperNodes.

        Raises:
            FlowerRunError: the SuperLink exited or did not listen within ``start_timeout``.
        """
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        self.superlink = self._spawn(
            [self._script("flower-superlink"), "--insecure",
             "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
             "--port", str(self.port)],
            "superlink.log")
        self._wait_listening(self.superlink, self.port, "superlink.log")
        for i in range(self.num_nodes):
            self.supernodes.append(self.start_node(i))

    def start_node(self, i: int) -> subprocess.Popen[bytes]:
        """Start SuperNode ``i`` (``partition-id=i``) on a free loopback port; its
        ``state-dir`` (where it keeps its client state for exact resumes) is
        ``workdir/node-i-state``, which outlives a restart of the node; then the keys of
        ``node_config`` and ``node_configs[i]``."""
        config = {"partition-id": i, "num-partitions": self.num_nodes,
                  "state-dir": str(self.workdir / f"node-{i}-state"),
                  **self.node_config, **self.node_configs.get(i, {})}
        return self._spawn(
            [self._script("flower-supernode"), "--insecure", "--superlink",
             f"127.0.0.1:{self.port}", "--host", "127.0.0.1", "--port", str(free_port()),
             "--node-config", node_config_text(config), "--max-wait-time", "120"],
            f"supernode-{i}.log")

    def _wait_listening(self, process: subprocess.Popen[bytes], port: int, log: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise FlowerRunError(f"{log.split('.')[0]} exited with code "
                                     f"{process.returncode}: {self._tail(log)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                          timeout=1.0):
                return
            time.sleep(0.2)
        raise FlowerRunError(f"the SuperLink did not listen on 127.0.0.1:{port} within "
                             f"{self.start_timeout:g} s: {self._tail(log)}")

    def _tail(self, log: str, chars: int = 2000) -> str:
        path = self.workdir / log
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to SuperNode ``i``'s process group (a node that dies)."""
        process = self.supernodes[i]
        if process is not None and process.poll() is None:
            self._remember_descendants(process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)

    def stop(self) -> None:
        """Stop every process this federation started (SuperNodes first), by group id, and
        their descendants that left the group; SIGTERM, then SIGKILL after 10 s."""
        processes = [p for p in [*self.supernodes, self.superlink] if p is not None]
        for p in processes:
            self._remember_descendants(p.pid)
        for p in processes:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for p in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the group, whatever is left of it
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        killed = []
        for pid, started in sorted(self._descendants):
            if _start_time(pid) == started:  # still that process, not a reused pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                killed.append((pid, started))
        # SIGKILL is delivered asynchronously: on a loaded machine a killed process can stay
        # listed for a moment after os.kill returns. Wait (bounded) until each is gone, so that
        # nothing this federation started is alive once stop() returns.
        deadline = time.monotonic() + 10.0
        while any(_start_time(pid) == started for pid, started in killed) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        self.superlink = None
        self.supernodes = []
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None

    def _remember_descendants(self, pid: int) -> None:
        for child in _descendants(pid):
            started = _start_time(child)
            if started is not None:
                self._descendants.add((child, started))

    # ---- runs ---------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120.0, cwd: Path | None = None
             ) -> subprocess.CompletedProcess[str]:
        """Run the ``flwr`` CLI against this federation (bounded by ``timeout``)."""
        return subprocess.run([self._script("flwr"), *args], capture_output=True, text=True,
                              env=self.env, cwd=cwd or self.workdir, timeout=timeout,
                              check=False)

    def run(self, run_config: Mapping[str, Any], *, app: str | Path = EXAMPLE_APP,
            timeout: float = 900.0, poll: float = 2.0,
            done_marker: str | Path | None = None) -> RunStatus:
        """Submit ``app`` with ``run_config`` overrides and wait for its final status.

        Each ``flwr ls`` costs ~1.5 s of CPU (a fresh Flower CLI process), taken from the nodes
        doing the run. With ``done_marker`` (a file the ServerApp writes as it ends, such as the
        run directory's ``summary.json``) the wait watches, every 0.2 s, that file and the run's
        ``flwr-serverapp`` process (a descendant of the SuperLink, read from ``/proc``), and
        asks ``flwr ls`` only once the file is written anew or the process has ended (a failed
        run), else every ``max(poll, 60)`` s; without it, ``flwr ls`` every ``poll`` seconds.

        Raises:
            FlowerRunError: ``flwr run`` did not return a run id.
        """
        self._remember_all()
        overrides = self.workdir / f"run-config-{time.time_ns()}.toml"
        overrides.write_text(_toml(run_config))
        t0 = time.monotonic()
        submitted_at = time.time()
        submitted = self.flwr("run", str(Path(app).resolve()), CONNECTION, "--run-config",
                              str(overrides), "--format", "json", timeout=300)
        run_id = _run_id(submitted.stdout)
        if run_id is None:
            raise FlowerRunError(f"flwr run did not start a run (exit {submitted.returncode}): "
                                 f"{(submitted.stdout + submitted.stderr)[-2000:]}")
        status, details = "unknown", ""
        deadline = t0 + timeout
        interval = poll if done_marker is None else max(poll, 60.0)
        next_ask = next_remember = time.monotonic()
        serverapp_running, soon_until = False, 0.0
        while time.monotonic() < deadline:
            if done_marker is not None and interval > 1.0:
                running = self._serverapp_running()
                if _written_since(done_marker, submitted_at):
                    interval, next_ask = 1.0, time.monotonic()  # ending: ask now, then every 1 s
                elif serverapp_running and not running:
                    # a ServerApp ended (this run's, failed, or the previous run's finishing
                    # late): ask now, then every 2 s for 10 s, then at the usual interval
                    next_ask, soon_until = time.monotonic(), time.monotonic() + 10.0
                serverapp_running = running
            if time.monotonic() >= next_ask:
                status, details = self.status(run_id)
                if status.startswith("finished"):
                    break
                next_ask = time.monotonic() + (2.0 if time.monotonic() < soon_until and
                                               interval > 2.0 else interval)
            if time.monotonic() >= next_remember:  # the processes to stop at close
                self._remember_all()
                next_remember = time.monotonic() + min(poll, 2.0)
            time.sleep(0.2 if done_marker is not None else poll)
        else:
            self.flwr("stop", str(run_id), CONNECTION, timeout=60)
        return RunStatus(run_id, status, details, time.monotonic() - t0,
                         submitted.stdout + submitted.stderr)

    def _serverapp_running(self) -> bool:
        """Whether a ``flwr-serverapp`` process runs under the SuperLink (Linux ``/proc``)."""
        if self.superlink is None:
            return False
        for pid in _descendants(self.superlink.pid):
            with contextlib.suppress(OSError):
                if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
        return False

    def status(self, run_id: int) -> tuple[str, str]:
        """(status, details) of run ``run_id`` from ``flwr ls --format json``."""
        listed = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json",
                           timeout=60)
        try:
            runs = json.loads(listed.stdout).get("runs") or [{}]
        except (json.JSONDecodeError, AttributeError):
            return "unknown", listed.stdout[-500:] + listed.stderr[-500:]
        return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))

    def _remember_all(self) -> None:
        for p in [*self.supernodes, self.superlink]:
            if p is not None:
                self._remember_descendants(p.pid)

    def log(self, name: str) -> str:
        """A process's log: ``superlink`` or ``supernode-I``."""
        return self._tail(f"{name}.log", chars=10**7)


_PARENT_DEATH_LAUNCHER = """\
import ctypes, os, signal, sys
# PR_SET_PDEATHSIG (1): the kernel sends SIGTERM when the process that started this one dies
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:
    sys.exit("bayesfl: prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):  # the parent died before the request: too late for it
    sys.exit("bayesfl: the process that started this one has exited")
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Run by a fresh Python (``-I -S``: ~20 ms, no site) in front of each Flower process: it asks
Linux to SIGTERM the process when its parent dies, then becomes the Flower process (the death
signal survives ``execve``, and the process keeps its pid and session)."""


def with_parent_death_signal(args: list[str]) -> list[str]:
    """``args`` started so that the process gets SIGTERM when the process that started it
    exits, however it exits (Linux): a federation whose owner is killed with SIGKILL (no
    ``stop()``, no ``atexit``) does not leave its SuperLink and SuperNodes running, holding
    their ports and memory, as it did before. Elsewhere ``args`` unchanged (``stop()`` only).

    Signals go to the thread that started the process when it exits, so a federation is to be
    started from a thread that outlives it (the main thread, or the one that stops it)."""
    if not sys.platform.startswith("linux"):
        return list(args)
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH_LAUNCHER, str(os.getpid()),
            *args]


def _run_id(stdout: str) -> int | None:
    start = stdout.find("{")
    try:
        value = json.loads(stdout[start:]).get("run-id") if start >= 0 else None
    except json.JSONDecodeError:
        return None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _toml(values: Mapping[str, Any]) -> str:
    """Flat run-config overrides as TOML (keys quoted; values TOML literals)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        elif isinstance(value, str):
            text = json.dumps(value)
        elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            text = json.dumps(" ".join(value))  # shift, ood: words in one string
        else:
            raise ConfigError(f"run config {key!r} must be a bool, number or string, got "
                              f"{type(value).__name__}")
        lines.append(f"{json.dumps(str(key))} = {text}")
    return "\n".join(lines) + "\n"


def node_config_text(config: Mapping[str, Any]) -> str:
    """``config`` as ``flower-supernode --node-config`` reads it: space-separated ``key=value``
    pairs, each value a TOML literal (strings double-quoted).

    Raises:
        ConfigError: a value that is not a bool, number or string, or a string with a double
            quote (Flower's parser ends a quoted value at the first one).
    """
    pairs = []
    for key, value in config.items():
        if isinstance(value, str) and '"' in value:
            raise ConfigError(f"node config {key!r}: a value with a double quote cannot be "
                              f"passed to flower-supernode, got {value!r}")
        if isinstance(value, list | tuple) or " " in str(key) or "=" in str(key):
            raise ConfigError(f"node config {key!r} = {value!r}: keys are words, values a "
                              "bool, number or string")
        pairs.append(_toml({key: value}).strip().replace('" = ', "=", 1)[1:])
    return " ".join(pairs)


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    seen: set[int] = set()
    stack = [pid]
    while stack:
        for child in _children(stack.pop()):
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def _start_time(pid: int) -> str | None:
    """The start time of live process ``pid`` (/proc stat field 22), None if it is gone or
    a zombie: with the pid it names one process, even after the pid is reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


__all__ = ["CONNECTION", "EXAMPLE_APP", "FlowerRunError", "LocalFederation", "RunStatus",
           "flower_environment", "free_port", "node_config_text"]


def _written_since(path: str | Path | None, since: float) -> bool:
    """Whether ``path`` exists and was modified at or after ``since`` (seconds since the epoch);
    False for None."""
    if path is None:
        return False
    try:
        return Path(path).stat().st_mtime >= since
    except OSError:
        return False
