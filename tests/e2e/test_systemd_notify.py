"""The daemons speak systemd's notify protocol (``Type=notify``, ``WatchdogSec=``) for real.

A real ``edge-trainer`` process, started with ``$NOTIFY_SOCKET`` naming a datagram socket
the test binds (systemd's end) and ``$WATCHDOG_USEC``, against a real mosquitto: while
there is no broker its loop only extends the start timeout; ``READY=1`` comes once it is
connected; ``WATCHDOG=1`` pings keep coming from the main loop; ``SIGTERM`` gives
``STOPPING=1`` and exit 0.  The same for ``edge-recorder --simulate printer`` and
``cloud-aggregator serve --service``.
"""

from __future__ import annotations

import subprocess
import sys
from typing import BinaryIO

import pytest

from cloud_aggregator.local.broker import BrokerProcess, free_port, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml, pflda_task
from tests.conftest import _require_mosquitto
from tests.e2e.notify import NotifyListener
from tests.e2e.retained import retained_status

WATCHDOG_S = 0.6  # pings every 0.2 s


def stop_service(
    proc: subprocess.Popen, log: BinaryIO, listener: NotifyListener, broker: BrokerProcess | None = None
) -> None:
    """A notify test's teardown: kill the service if it still runs, close its log and the listener,
    stop the broker if one was started."""
    if proc.poll() is None:
        proc.kill()
    log.close()
    listener.close()
    if broker is not None:
        broker.stop()


@pytest.mark.broker
def test_edge_trainer_is_ready_once_connected_pings_from_its_loop_and_says_stopping(tmp_path):
    # Prepare: systemd's socket, and a port where no broker listens yet
    _require_mosquitto()
    listener = NotifyListener()
    port = free_port()
    log = (tmp_path / "printer1.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.cli", "--device", "printer1", "--fleet", FLEET, "--broker",
         f"mqtt://127.0.0.1:{port}", "--allow-plaintext", "--simulate", "printer",
         "--state-dir", str(tmp_path / "printer1")],
        stdout=log, stderr=subprocess.STDOUT, env=listener.env(WATCHDOG_S),
    )  # fmt: skip
    broker = None
    try:
        # Execute / Assert: no broker: the loop turns (start timeout extended), no READY
        first = listener.wait_for(f"EXTEND_TIMEOUT_USEC={int(2 * WATCHDOG_S * 1e6)}", 30)
        listener.wait_for("EXTEND_TIMEOUT_USEC=1200000", 5, after=first + 1)
        assert listener.count("READY=1") == 0

        broker = start_mosquitto(port, log_file=tmp_path / "mosquitto.log")
        ready = listener.wait_for("READY=1", 30)
        assert any(
            line.startswith("STATUS=connected to mqtt://127.0.0.1") for line in listener.messages[ready]
        )
        assert retained_status(broker.url, "printer1")["state"] == "online"

        # The watchdog: pings keep coming from the main loop (every third of WATCHDOG_USEC)
        listener.pings_then_stops(proc, ready)
    finally:
        stop_service(proc, log, listener, broker)
    assert "Traceback" not in (tmp_path / "printer1.log").read_text()


def test_edge_recorder_is_ready_once_recording_pings_from_its_loop_and_says_stopping(tmp_path):
    # Prepare: a simulated print long enough to outlive the test
    listener = NotifyListener()
    log = (tmp_path / "recorder.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.recording.cli", "--simulate", "printer", "--layers", "400",
         "--layer-s", "0.25", "--state-dir", str(tmp_path / "sim")],
        stdout=log, stderr=subprocess.STDOUT, env=listener.env(WATCHDOG_S),
    )  # fmt: skip
    try:
        # Execute / Assert
        ready = listener.wait_for("READY=1", 30)
        listener.pings_then_stops(proc, ready)
    finally:
        stop_service(proc, log, listener)
    assert "Traceback" not in (tmp_path / "recorder.log").read_text()


@pytest.mark.broker
def test_serve_is_ready_once_connected_pings_through_rounds_and_idle_and_says_stopping(tmp_path):
    # Prepare: serve --service started before its broker, one printer, a 3-round task
    _require_mosquitto()
    listener = NotifyListener()
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    config = tmp_path / "aggregator.toml"
    config.write_text(
        aggregator_toml(url, tmp_path / "aggregator", [pflda_task(rounds=3)], expected=["printer1"])
    )
    log = (tmp_path / "aggregator.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--service", "--config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env=listener.env(WATCHDOG_S),
    )  # fmt: skip
    broker = fleet = None
    try:
        # Execute / Assert: nothing before the broker is there; READY once connected
        listener.drain(1.0)
        assert listener.count("READY=1") == 0 and serve.poll() is None
        broker = start_mosquitto(port, log_file=tmp_path / "mosquitto.log")
        ready = listener.wait_for("READY=1", 30)
        fleet = LocalFleet(tmp_path, url)
        fleet.start_device("printer1", "--log-level", "WARNING")
        fleet.wait_for(lambda: len(fleet.rounds()) == 3, 60, "3 rounds")
        during = listener.count("WATCHDOG=1", ready)
        assert during >= 1  # from the loops that read the session (start-up wait, rounds), not a timer

        listener.pings_then_stops(serve, ready, during)  # tasks done: serve --service waits, pinging
    finally:
        if serve.poll() is None:
            serve.kill()
        if fleet is not None:
            fleet.stop_all()
        log.close()
        listener.close()
        if broker is not None:
            broker.stop()
    assert "Traceback" not in (tmp_path / "aggregator.log").read_text()
