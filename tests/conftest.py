"""Shared fixtures: a real mosquitto on a free loopback port, and temp state folders."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cloud_aggregator.broker import BrokerProcess, find_mosquitto, start_mosquitto
from cloud_aggregator.local_fleet import LocalFleet
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
