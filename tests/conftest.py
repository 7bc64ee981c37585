"""Shared fixtures: a real mosquitto on a free loopback port, a real RabbitMQ node (MQTT plugin)
shared by the session, and temp state folders.

``broker`` is mosquitto for every test; a test marked ``any_broker`` (it exercises only the wire
protocol, nothing mosquitto-specific) runs twice, on mosquitto and on RabbitMQ."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from cloud_aggregator.fleet.init import FleetLayout, init_fleet
from cloud_aggregator.local.broker import BrokerProcess, find_mosquitto, free_port, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet
from cloud_aggregator.local.rabbitmq import RabbitNode, find_rabbitmq, start_cluster
from tests import budget  # noqa: F401  (loads the hypothesis profile before any test module)

# pytest-xdist's workers each take their own slice of the ports (``free_port``): two workers starting
# brokers at once could otherwise be offered the same free port by the kernel.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault(
        "IOFT_PORT_SLICE",
        f"{os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw')}/{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}",
    )


def _missing(msg: str) -> None:
    """A broker the test needs is not installed: a failure on CI, a skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def _require_mosquitto() -> None:
    if find_mosquitto() is None:
        _missing("mosquitto is not installed (apt-get install mosquitto); .ci/run installs it")


def _require_rabbitmq() -> None:
    if find_rabbitmq() is None:
        _missing("rabbitmq-server is not installed (apt-get install rabbitmq-server); make test installs it")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "any_broker: wire-protocol test that runs on mosquitto and on RabbitMQ (fixture broker)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "broker" in metafunc.fixturenames and metafunc.definition.get_closest_marker("any_broker"):
        metafunc.parametrize("broker", ["mosquitto", "rabbitmq"], indirect=True)


@pytest.fixture(scope="session")
def rabbitmq_node(tmp_path_factory) -> Iterator[RabbitNode]:
    """One RabbitMQ node (MQTT plugin, anonymous, loopback) for the whole session (~10 s to start)."""
    _require_rabbitmq()
    cluster = start_cluster(tmp_path_factory.mktemp("rabbitmq"))
    try:
        yield cluster.nodes[0]
    finally:
        cluster.stop()


#: Deletes every queue: the persistent MQTT sessions (the aggregator's) a test leaves on the shared node.
_DELETE_QUEUES = '[rabbit_amqqueue:delete(Q, false, false, <<"tests">>) || Q <- rabbit_amqqueue:list()], ok.'


@pytest.fixture
def broker(request) -> Iterator[BrokerProcess | RabbitNode]:
    """The test's broker (``.url``): a fresh mosquitto, or, for ``any_broker`` tests' second run,
    the session's RabbitMQ node, left without queues (persistent sessions) afterwards."""
    if getattr(request, "param", "mosquitto") == "mosquitto":
        yield request.getfixturevalue("mosquitto")
        return
    node = request.getfixturevalue("rabbitmq_node")
    try:
        yield node
    finally:
        node.ctl("eval", _DELETE_QUEUES)


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
def fleet_procs(tmp_path, broker) -> Iterator[LocalFleet]:
    """A :class:`LocalFleet` on the test's broker: spawns aggregator and device processes, stopped afterwards."""
    procs = LocalFleet(tmp_path, broker.url)
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
    layout = init_fleet(root / "fleet", FLEET, tuple(devices), auth=auth, hosts=tuple(hosts), port=port,
                        bind=bind, operator_port=free_port())  # fmt: skip
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
