"""Shared fixtures: a real mosquitto on a free loopback port, and temp state folders."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cloud_aggregator.broker import BrokerProcess, find_mosquitto, free_port, start_mosquitto
from cloud_aggregator.fleet_init import FleetLayout, init_fleet
from cloud_aggregator.local_fleet import FLEET, LocalFleet
from tests import budget  # noqa: F401  (loads the hypothesis profile before any test module)


def _require_mosquitto() -> None:
    if find_mosquitto() is None:
        msg = "mosquitto is not installed (apt-get install mosquitto); .ci/run installs it"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def mosquitto(tmp_path) -> Iterator[BrokerProcess]:
    """A fresh mosquitto (anonymous, loopback only) for one test, stopped afterwards."""
    _require_mosquitto()
    broker = start_mosquitto(log_file=tmp_path / "mosquitto.log")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def fleet_procs(tmp_path, mosquitto) -> Iterator[LocalFleet]:
    """A :class:`LocalFleet` on the test's mosquitto: spawns aggregator and device processes, stopped afterwards."""
    procs = LocalFleet(tmp_path, mosquitto.url)
    try:
        yield procs
    finally:
        procs.stop_all()


def tls_fleet_broker(
    root: Path,
    devices: Sequence[str],
    *,
    auth: str = "certs",
    hosts: Sequence[str] = ("127.0.0.1",),
    bind: str | None = None,
) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    """``fleet init`` in ``root`` and its mosquitto on a free port (TLS), stopped afterwards."""
    _require_mosquitto()
    port = free_port()
    layout = init_fleet(
        root / "fleet", FLEET, tuple(devices), auth=auth, hosts=tuple(hosts), port=port, bind=bind
    )
    broker = start_mosquitto(
        port, config=layout.mosquitto_conf, log_file=root / "mosquitto.log", tls=True, as_invoker=True
    )
    try:
        yield layout, broker
    finally:
        broker.stop()


@pytest.fixture
def enterable_dir() -> Iterator[Path]:
    """A temp folder the ``mosquitto`` user can enter (pytest's are 0700; the README: ``chmod o+x``)."""
    _require_mosquitto()
    root = Path(tempfile.mkdtemp(prefix="ioft-fleet-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
