"""A broker that is down or mistyped: daemons say why at INFO on every attempt and keep retrying;
one-shot commands fail in one line.  Real processes, a real mosquitto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cloud_aggregator.fleet.init import init_fleet
from cloud_aggregator.local.broker import free_port, start_mosquitto
from cloud_aggregator.local.fleet import aggregator_toml, pflda_task
from tests.conftest import _require_mosquitto
from tests.e2e.watched import Watched

pytestmark = pytest.mark.broker
#: Guards against a hung test only; nothing here is a timing assertion.
PATIENCE_S = 90.0
STATUS = (sys.executable, "-m", "cloud_aggregator.cli", "fleet", "status")
REFUSED = "connection refused: nothing listens on 127.0.0.1 port"


def _trainer(tmp_path: Path, broker: str) -> Watched:
    args = ["--device", "printer1", "--broker", broker, "--allow-plaintext", "--simulate", "printer"]
    return Watched("edge.cli", [*args, "--state-dir", str(tmp_path / "printer1")])


def test_a_device_says_why_on_every_attempt_and_connects_once_the_broker_is_up(tmp_path):
    _require_mosquitto()
    port = free_port()
    trainer = _trainer(tmp_path, f"mqtt://127.0.0.1:{port}")
    broker = None
    try:
        trainer.wait_until(lambda: len(trainer.matching("INFO", REFUSED)) >= 2, PATIENCE_S, "two refused")
        assert trainer.proc.poll() is None, trainer.text
        assert "Traceback" not in trainer.text
        first, second = trainer.matching("INFO", REFUSED)[:2]
        assert "attempt 1;" in first and "attempt 2;" in second
        broker = start_mosquitto(port)
        trainer.wait_until(lambda: trainer.matching("INFO", "connected to"), PATIENCE_S, "the connection")
    finally:
        trainer.stop()
        if broker is not None:
            broker.stop()


def test_a_device_names_an_unresolvable_broker_and_keeps_trying(tmp_path):
    trainer = _trainer(tmp_path, "mqtt://no-such-broker.invalid:1883")
    try:
        trainer.wait_until(
            lambda: (
                len(trainer.matching("INFO", "cannot resolve the host name 'no-such-broker.invalid'")) >= 2
            ),
            PATIENCE_S,
            "two unresolvable-name lines",
        )
        assert trainer.proc.poll() is None, trainer.text
    finally:
        trainer.stop()


def test_serve_keeps_retrying_a_closed_port_with_reasons(tmp_path):
    port = free_port()
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(aggregator_toml(f"mqtt://127.0.0.1:{port}", tmp_path / "agg", [pflda_task(rounds=1)]))
    serve = Watched("cloud_aggregator.cli", ["serve", "--config", str(cfg)])
    try:
        serve.wait_until(lambda: len(serve.matching("INFO", REFUSED)) >= 2, PATIENCE_S, "two refused")
        assert serve.proc.poll() is None, serve.text
        assert "Traceback" not in serve.text
    finally:
        serve.stop()


@pytest.mark.parametrize(
    ("broker", "reason"),
    [("mqtt://127.0.0.1:{port}", REFUSED), ("mqtt://no-such-broker.invalid:1883", "cannot resolve the host")],
)
def test_fleet_status_fails_in_one_line_when_the_broker_is_not_there(broker, reason):
    url = broker.format(port=free_port())
    out = subprocess.run(
        [*STATUS, "--broker", url, "--fleet", "plant", "--allow-plaintext"],
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
    )
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert reason in lines[0] and url in lines[0], lines[0]


def test_a_device_says_its_tls_handshake_failed_against_a_plaintext_port(tmp_path, enterable_dir):
    """The device folder as ``fleet init`` writes it, its broker URL pointed at a plaintext listener."""
    layout = init_fleet(enterable_dir / "fleet", "test", ("printer1",), port=free_port())
    plain = start_mosquitto(free_port())
    config = layout.root / "devices" / "printer1" / "device.toml"
    args = ["--device", "printer1", "--config", str(config), "--simulate", "printer"]
    trainer = Watched(
        "edge.cli",
        [*args, "--broker", f"mqtts://127.0.0.1:{plain.port}", "--state-dir", str(tmp_path / "p1")],
    )
    try:
        why = "TLS handshake failed"
        hint = f"is port {plain.port} the broker's TLS listener, not a plaintext one?"
        trainer.wait_until(lambda: len(trainer.matching("INFO", why, hint)) >= 2, PATIENCE_S, "two TLS lines")
        assert trainer.proc.poll() is None and "Traceback" not in trainer.text, trainer.text
    finally:
        trainer.stop()
        plain.stop()
