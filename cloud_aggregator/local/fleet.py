"""A whole fleet on this machine: a broker, ``cloud-aggregator serve`` and N ``edge-trainer``s.

The one launcher the demo, the end-to-end tests and the benchmarks share.  Everything
runs as a real process on loopback: mosquitto (or amqtt) on a free port, the
aggregator on a TOML written into the fleet's folder, and each device as
``python -m edge.cli`` (launched by command: this package never imports ``edge``).
Each process logs to ``<work>/<name>.log`` (``aggregator.log``, ``broker.log``).

::

    with LocalFleet.start(work) as fleet:          # starts a broker on a free port
        for name in ("printer1", "printer2"):
            fleet.start_device(name)
        fleet.start_aggregator(aggregator_toml(fleet.broker_url, fleet.work / "aggregator", [pflda_task()]))
        fleet.wait_aggregator(120)
        records = fleet.rounds("speed")
    # leaving the block stops the aggregator, the devices and the broker it started

Stopping: :meth:`LocalFleet.stop` sends SIGTERM to the aggregator, then to the
devices (both save their state and exit), kills what is still running after 10 s,
and stops the broker the fleet started.  A script that owns a fleet should call
:func:`cloud_aggregator.local.broker.interrupt_on_sigterm` first, so that a SIGTERM sent to
it unwinds through the ``with`` block (or its ``finally``) instead of leaving the
children behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import paho.mqtt.client as paho

from cloud_aggregator import faults
from cloud_aggregator.local.broker import BrokerProcess, start_embedded
from cloud_aggregator.rounds.types import RoundRecord
from cloud_aggregator.store.sqlite import SqliteStore

#: The fleet name of a local fleet unless the caller names another (the demo's is "demo").
FLEET = "test"
#: Seconds a process has to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10.0


def _toml(v: object) -> str:
    """A TOML value (inline tables and arrays included)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml(x)}' for k, x in v.items()) + " }"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def aggregator_toml(
    broker: str,
    state_dir: Path,
    tasks: Sequence[Mapping[str, object]],
    *,
    fleet: str = FLEET,
    deadline_s: float = 5.0,
    min_participants: int = 1,
    expected: Sequence[str] | None = None,
    max_extensions: int = 0,
    startup_wait_s: float = 20.0,
    connection: Sequence[str] | None = None,
    settings: Mapping[str, object] | None = None,
) -> str:
    """An aggregator TOML for a local fleet.

    Parameters
    ----------
    broker
        The broker's URL (``mqtt://127.0.0.1:PORT``).
    state_dir
        The aggregator's state folder (``aggregator.sqlite`` goes there).
    tasks
        One ``[[task]]`` table each; a dict value becomes an inline table.
    deadline_s, min_participants, expected, max_extensions, startup_wait_s
        The ``[collect]`` table.
    connection
        Top-level lines instead of ``allow_plaintext = true`` (plaintext on loopback, the
        explicit opt-in), e.g. ``client_id`` and an inline ``tls`` table for a TLS fleet.
    settings
        Further top-level keys, e.g. ``{"restart": True}`` or ``{"max_payload_bytes": 16 << 20}``.

    Returns
    -------
    str
        The TOML text.
    """
    lines = [
        f'fleet = "{fleet}"',
        f'broker = "{broker}"',
        f'state_dir = "{state_dir}"',
        *(["allow_plaintext = true"] if connection is None else connection),
        *(f"{k} = {_toml(v)}" for k, v in (settings or {}).items()),
        "",
        "[collect]",
        *_collect_lines(deadline_s, min_participants, max_extensions, startup_wait_s, expected or []),
    ]
    for t in tasks:
        lines += ["", "[[task]]", *_task_lines(t)]
    return "\n".join(lines) + "\n"


def _collect_lines(
    deadline_s: float,
    min_participants: int,
    max_extensions: int,
    startup_wait_s: float,
    expected: Sequence[str],
) -> list[str]:
    """The ``[collect]`` table's lines."""
    return [f"deadline_s = {deadline_s}", f"min_participants = {min_participants}",
            f"max_extensions = {max_extensions}", f"startup_wait_s = {startup_wait_s}",
            "expected = [" + ", ".join(f'"{d}"' for d in expected) + "]"]  # fmt: skip


def _task_lines(task: Mapping[str, object]) -> list[str]:
    """A ``[[task]]`` table's lines; a dict value becomes an inline table."""
    lines = []
    for k, v in task.items():
        if isinstance(v, dict):
            inner = ", ".join(f"{ik} = {_toml(iv)}" for ik, iv in v.items())
            lines.append(f"{k} = {{ {inner} }}")
        else:
            lines.append(f"{k} = {_toml(v)}")
    return lines


def pflda_task(name: str = "speed", seed: int = 0, rounds: int = 6) -> dict[str, object]:
    """A PFL-DA task with the sigmoid GLM on simulated printers: the fleet's smoke task."""
    return {
        "name": name,
        "algorithm": "pflda",
        "model": "sigmoid_glm",
        "rounds": rounds,
        "seed": seed,
        "hparams": {"lr": 0.1, "weight_decay": 3e-4, "local_steps": 10},
        "server": {"weighting": "uniform"},
    }


def _stop_processes(procs: Sequence[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each running process (in order), then wait; kill what outlives ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class LocalFleet:
    """A broker, an aggregator and devices as processes on this machine, and where their
    logs and state are (``work``).

    Build one with :meth:`start` (which also starts a broker unless given one's URL), or
    directly on a broker someone else runs (a test's ``mosquitto`` fixture).  Only the
    broker in ``broker`` is stopped by :meth:`stop`.
    """

    work: Path
    broker_url: str
    #: The broker this fleet started (``None``: an external one, left running).
    broker: BrokerProcess | None = None
    fleet: str = FLEET
    #: Devices get ``--allow-plaintext`` (a loopback broker speaks plain MQTT); a TLS fleet sets False.
    allow_plaintext: bool = True
    devices: dict[str, subprocess.Popen] = field(default_factory=dict)
    aggregator: subprocess.Popen | None = None

    @classmethod
    def start(
        cls,
        work: Path,
        *,
        broker: str | BrokerProcess | None = None,
        prefer: str = "mosquitto",
        fleet: str = FLEET,
        broker_log: bool = True,
    ) -> LocalFleet:
        """A fleet with its processes' state and logs in ``work``.

        Parameters
        ----------
        broker
            ``None``: start a loopback broker on a free port (mosquitto when installed and
            ``prefer``-red, else amqtt; see :func:`cloud_aggregator.local.broker.start_embedded`),
            logging to ``work/broker.log`` unless ``broker_log`` is false.  A URL: use that
            broker and leave it running.  A :class:`BrokerProcess` (e.g. from
            ``start_mosquitto`` when only mosquitto will do): use it and stop it with the fleet.
        fleet
            The fleet name in every topic (devices get ``--fleet``).
        """
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        if isinstance(broker, str):
            return cls(work, broker, None, fleet)
        if broker is None:
            broker = start_embedded(prefer=prefer, log_file=work / "broker.log" if broker_log else None)
        return cls(work, broker.url, broker, fleet)

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def db(self) -> Path:
        """The aggregator's store, when it writes into ``work/aggregator`` (as the TOMLs here do)."""
        return self.work / "aggregator" / "aggregator.sqlite"

    def _env(self) -> dict[str, str]:
        # Unbuffered children: their logs are readable while they run. Never IOFT_FAULT.
        return {**faults.child_env(None), "PYTHONUNBUFFERED": "1"}

    def start_device(self, name: str, *extra: str, simulate: str | None = "printer") -> subprocess.Popen:
        """An ``edge-trainer`` process with its state in ``work/<name>``: a simulated printer unless
        ``extra`` says ``--simulate ...``, or, with ``simulate=None``, on the dataset already there.

        ``extra`` is appended to the command line (e.g. ``"--log-level", "WARNING"``)."""
        log = (self.work / f"{name}.log").open("ab")
        simulate_args = [] if "--simulate" in extra or simulate is None else ["--simulate", simulate]
        if simulate_args or "--simulate" in extra:
            # The seeded history only: a live simulated machine's rows would change the dataset
            # mid-run, and tests and benchmarks compare against fixed ones.
            simulate_args.append("--no-live")
        plaintext = ["--allow-plaintext"] if self.allow_plaintext else []
        args = [
            "--device",
            name,
            "--fleet",
            self.fleet,
            "--broker",
            self.broker_url,
            "--state-dir",
            str(self.work / name),
        ]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "edge.cli", *args, *simulate_args, *plaintext, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
            )
        finally:
            log.close()  # the child holds its own copy
        self.devices[name] = proc
        return proc

    def start_devices(self, names: Sequence[str], *extra: str, simulate: str | None = "printer") -> None:
        """:meth:`start_device` for each of ``names``."""
        for name in names:
            self.start_device(name, *extra, simulate=simulate)

    def start_aggregator(
        self,
        toml: str,
        *,
        fault: str | None = None,
        log_level: str | None = None,
        name: str = "aggregator",
    ) -> subprocess.Popen:
        """``cloud-aggregator serve`` on ``toml``, with ``IOFT_FAULT=fault`` (devices never get it)
        and ``--log-level`` when given.

        The TOML is written to ``work/<name>.toml`` and the output appended to
        ``work/<name>.log`` (``name`` may hold a subfolder, e.g. one per trial); the process
        becomes :attr:`aggregator` (a restart replaces the one before).
        """
        cfg = self.work / f"{name}.toml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(toml)
        level = ["--log-level", log_level] if log_level else []
        with (self.work / f"{name}.log").open("ab") as log:
            self.aggregator = subprocess.Popen(
                [sys.executable, "-m", "cloud_aggregator.cli", *level, "serve", "--config", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**faults.child_env(fault), "PYTHONUNBUFFERED": "1"},
            )
        return self.aggregator

    def log(self, name: str) -> str:
        """The log of ``name`` (a device, ``aggregator`` or ``broker``) so far; ``""`` when none."""
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def rounds(self, task: str = "speed") -> list[RoundRecord]:
        """The aggregator's round records of ``task`` so far (read-only; ``[]`` before its store exists)."""
        if not self.db.exists():
            return []
        store = SqliteStore(self.db, readonly=True)
        try:
            return store.rounds(task)
        finally:
            store.close()

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll ``cond`` until it holds; raise ``AssertionError`` (with the aggregator's log) on
        ``timeout`` or when the aggregator dies first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if self.aggregator is not None and self.aggregator.poll() not in (None, 0):
                raise AssertionError(
                    f"aggregator died while waiting for {what}:\n{self.log('aggregator')[-4000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(
            f"timed out after {timeout} s waiting for {what}:\n{self.log('aggregator')[-4000:]}"
        )

    def wait_aggregator(self, timeout: float) -> int:
        """The aggregator's exit code; ``AssertionError`` (with its log) if it runs past ``timeout``."""
        if self.aggregator is None:
            raise RuntimeError("no aggregator started; call start_aggregator first")
        try:
            return self.aggregator.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"aggregator still running after {timeout} s:\n{self.log('aggregator')[-4000:]}"
            ) from exc

    def stop_all(self) -> None:
        """Stop the aggregator, then the devices (SIGTERM; killed after 10 s); the broker stays."""
        _stop_processes([*([self.aggregator] if self.aggregator else []), *self.devices.values()])

    def stop(self) -> None:
        """:meth:`stop_all`, then stop the broker this fleet started."""
        try:
            self.stop_all()
        finally:
            if self.broker is not None:
                self.broker.stop()


class Sniffer:
    """A client subscribed to ``#`` for the whole run, keeping every message (topic, payload)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        #: Set by each SUBACK: clear it before a broker restart, wait on it before traffic resumes.
        self.subscribed = threading.Event()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe("#", qos=1)
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def stop(self) -> None:
        """Disconnect and stop the network thread."""
        self.client.disconnect()
        self.client.loop_stop()
