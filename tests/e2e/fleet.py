"""Real processes for end-to-end tests: ``cloud-aggregator serve`` and ``edge-trainer``s."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as paho

from cloud_aggregator import faults
from cloud_aggregator.store import SqliteStore

FLEET = "test"


def aggregator_toml(
    broker: str,
    state_dir: Path,
    tasks: list[dict],
    *,
    deadline_s: float = 5.0,
    min_participants: int = 1,
    expected: list[str] | None = None,
    max_extensions: int = 0,
    startup_wait_s: float = 20.0,
    connection: list[str] | None = None,
) -> str:
    """An aggregator TOML; plaintext on loopback (the explicit opt-in) unless ``connection`` gives
    other top-level lines instead (e.g. ``client_id`` and an inline ``tls`` table for a TLS fleet)."""
    lines = [
        f'fleet = "{FLEET}"',
        f'broker = "{broker}"',
        f'state_dir = "{state_dir}"',
        *(["allow_plaintext = true"] if connection is None else connection),
        "",
        "[collect]",
        f"deadline_s = {deadline_s}",
        f"min_participants = {min_participants}",
        f"max_extensions = {max_extensions}",
        f"startup_wait_s = {startup_wait_s}",
        "expected = [" + ", ".join(f'"{d}"' for d in expected or []) + "]",
    ]
    for t in tasks:
        lines += ["", "[[task]]"]
        for k, v in t.items():
            if isinstance(v, dict):
                inner = ", ".join(f"{ik} = {_toml(iv)}" for ik, iv in v.items())
                lines.append(f"{k} = {{ {inner} }}")
            else:
                lines.append(f"{k} = {_toml(v)}")
    return "\n".join(lines) + "\n"


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml(x)}' for k, x in v.items()) + " }"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


PFLDA_TASK = {
    "name": "speed",
    "algorithm": "pflda",
    "model": "sigmoid_glm",
    "rounds": 6,
    "seed": 0,
    "hparams": {"lr": 0.1, "weight_decay": 3e-4, "local_steps": 10},
    "server": {"weighting": "uniform"},
}


@dataclass
class FleetProcs:
    """Spawned processes and where their logs and state are."""

    work: Path
    broker_url: str
    devices: dict[str, subprocess.Popen] = field(default_factory=dict)
    aggregator: subprocess.Popen | None = None
    #: Devices get ``--allow-plaintext`` (the loopback test broker speaks plain MQTT); a TLS fleet sets False.
    allow_plaintext: bool = True

    @property
    def db(self) -> Path:
        return self.work / "aggregator" / "aggregator.sqlite"

    def start_device(self, name: str, *extra: str, simulate: str | None = "printer") -> subprocess.Popen:
        """An ``edge-trainer`` process: a simulated printer unless ``extra`` says ``--simulate ...``,
        or, with ``simulate=None``, on the dataset already in its state directory."""
        log = (self.work / f"{name}.log").open("ab")
        simulate = [] if "--simulate" in extra or simulate is None else ["--simulate", simulate]
        plaintext = ["--allow-plaintext"] if self.allow_plaintext else []
        args = [
            "--device",
            name,
            "--fleet",
            FLEET,
            "--broker",
            self.broker_url,
            "--state-dir",
            str(self.work / name),
        ]
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge.cli", *args, *simulate, *plaintext, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.devices[name] = proc
        return proc

    def start_aggregator(self, toml: str, *, fault: str | None = None) -> subprocess.Popen:
        """``cloud-aggregator serve`` on ``toml``, with ``IOFT_FAULT=fault`` (devices never get it)."""
        cfg = self.work / "aggregator.toml"
        cfg.write_text(toml)
        log = (self.work / "aggregator.log").open("ab")
        self.aggregator = subprocess.Popen(
            [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=faults.child_env(fault),
        )
        return self.aggregator

    def log(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def rounds(self, task: str = "speed"):
        if not self.db.exists():
            return []
        store = SqliteStore(self.db, readonly=True)
        try:
            return store.rounds(task)
        finally:
            store.close()

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
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
        try:
            return self.aggregator.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"aggregator still running after {timeout} s:\n{self.log('aggregator')[-4000:]}"
            ) from exc

    def stop_all(self) -> None:
        procs = [*self.devices.values(), *([self.aggregator] if self.aggregator else [])]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Sniffer:
    """A client subscribed to ``#`` for the whole run, keeping every message."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311
        )
        self.client.on_connect = lambda c, *a: c.subscribe("#", qos=1)
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload)))

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
