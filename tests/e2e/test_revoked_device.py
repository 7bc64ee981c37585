"""A revoked device, on the ``fleet init`` TLS broker: ``fleet status`` shows it
``revoked`` (not ``offline``), and when it restarts it says its certificate was revoked and how
to enrol it again, not "it must be signed by the fleet CA"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from cloud_aggregator.local.broker import free_port
from tests.e2e.test_fleet_init_broker import Broker, cli, init

pytestmark = pytest.mark.broker


def _status(root, *extra: str) -> subprocess.CompletedProcess:
    return cli("fleet", "status", "--config", str(root / "operator" / "operator.toml"), *extra)


def test_a_revoked_device_shows_revoked_and_is_told_to_enrol_again(enterable_dir, tmp_path):
    port = free_port()
    root = init(enterable_dir, port)
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    pi = shutil.copytree(root / "devices" / "printer2", tmp_path / "pi")
    log = tmp_path / "printer2.log"

    def start() -> subprocess.Popen:
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "edge.cli", "--device", "printer2", "--config", str(pi / "device.toml"),
                 "--state-dir", str(tmp_path / "state"), "--simulate", "printer"],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            )  # fmt: skip

    device = start()
    try:
        # Prepare: printer2 online, then revoked (the broker reloaded, as the CLI's hint says).
        deadline = time.monotonic() + 60
        while True:
            out = _status(root, "--json")
            if out.returncode == 0 and json.loads(out.stdout).get("printer2", {}).get("state") == "online":
                break
            assert device.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.5)
        out = cli("fleet", "revoke-device", "--dir", str(root), "--devices", "printer2")
        assert out.returncode == 0, out.stderr
        broker.reload()
        # Execute: the device restarts with the files it still holds.
        device.terminate()
        device.wait(20)
        device = start()
        rc = device.wait(60)
    finally:
        if device.poll() is None:
            device.terminate()
            device.wait(20)
        try:
            table = _status(root)
        finally:
            broker.stop()
    # Assert: the device gives up, saying why and what to do.
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert "revoked" in text and "fleet add-device" in text and "--devices printer2" in text, text[-3000:]
    assert "must be signed by the fleet CA" not in text
    # And the operator sees it revoked, not offline.
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("printer2"))
    assert row.split()[1] == "revoked", table.stdout
