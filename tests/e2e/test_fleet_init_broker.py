"""``fleet init``'s output used as written: ``mosquitto -c broker/mosquitto.conf`` started as root
(the way Debian's service starts it), a device folder copied elsewhere running a real
``edge-trainer``, and ``fleet add-device`` / ``renew-device`` / ``revoke-device`` against
the running broker (reloaded with SIGHUP, as ``systemctl reload mosquitto`` does).

Before: mosquitto dropped to its own user and could not read the 0600 root key (it did
not start), its ACL patterns printed three warnings at every start, and the device
folder named files by absolute path into the fleet folder, without the CA certificate,
``fleet.pub`` or a ``state_dir``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_aggregator.fleet.layout import open_fleet
from cloud_aggregator.local.broker import find_mosquitto, free_port
from ioft_protocol.config import load_toml
from tests.e2e.test_access import Client
from tests.e2e.watched import Watched

pytestmark = pytest.mark.broker
FLEET = "plant"


class Broker:
    """``mosquitto -c CONF`` as this process's user (root here, like Debian's service), log captured."""

    def __init__(self, conf: Path, port: int, log: Path) -> None:
        self.log_path = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [find_mosquitto(), "-c", str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Waits for the log's "running" line, not with a TCP probe: a probe that closes
        # without a TLS handshake makes mosquitto log an OpenSSL "Error", which raced
        # ``assert_clean_start``.
        deadline = time.monotonic() + 10
        while f"listen socket on port {port}" not in self.log() or " running" not in self.log():
            assert self.proc.poll() is None, f"mosquitto exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"mosquitto did not start:\n{self.log()}"
            time.sleep(0.02)

    def log(self) -> str:
        return self.log_path.read_text()

    def reload(self) -> None:
        """SIGHUP (``systemctl reload mosquitto``), then wait until the log says it reloaded."""
        before = self.log().count("Reloading config")
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self.log().count("Reloading config") == before:
            assert time.monotonic() < deadline, f"mosquitto did not reload:\n{self.log()}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def fleet_dir(enterable_dir: Path) -> Path:
    return enterable_dir


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", *args], capture_output=True, text=True, timeout=60
    )


def init(fleet_dir: Path, port: int, *extra: str) -> Path:
    out = cli("fleet", "init", "--fleet", FLEET, "--devices", "printer1,printer2", "--out",
              str(fleet_dir / "fleet"), "--host", "127.0.0.1", "--port", str(port), "--bind", "127.0.0.1",
              "--operator-port", str(free_port()), *extra)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "edge-trainer --device printer1 --config" in out.stdout
    return fleet_dir / "fleet"


def device_client(folder: Path, name: str, port: int) -> Client:
    """A client logging in with what a copied device folder holds (certificate or password)."""
    raw = load_toml(folder / "device.toml")
    tls = raw["tls"]
    cert = (folder / tls["cert_file"], folder / tls["key_file"]) if "cert_file" in tls else None
    return Client(
        port,
        ca=folder / tls["ca_file"],
        cert=cert,
        username=raw.get("username"),
        password=raw.get("password"),
    )


def connects(folder: Path, name: str, port: int) -> bool:
    client = device_client(folder, name, port)
    try:
        return client.connect()
    finally:
        client.close()


def assert_clean_start(broker: Broker) -> None:
    log = broker.log()
    assert "Warning" not in log and "Error" not in log, log
    if os.geteuid() == 0:  # started as root, it dropped to `mosquitto` and still read its key
        uid = next(line.split()[2] for line in Path(f"/proc/{broker.proc.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))  # fmt: skip
        assert int(uid) == pwd.getpwnam("mosquitto").pw_uid


def test_the_generated_broker_starts_and_a_copied_device_folder_runs(fleet_dir, tmp_path):
    port = free_port()
    root = init(fleet_dir, port)
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    device = None
    try:
        assert_clean_start(broker)
        pi = tmp_path / "pi" / "etc-ioft"  # the folder as copied onto the device
        shutil.copytree(root / "devices" / "printer1", pi)
        assert sorted(p.name for p in pi.iterdir()) == [
            "ca.crt", "device.toml", "fleet.pub", "install.sh", "printer1.crt", "printer1.key", "systemd"
        ]  # fmt: skip
        assert load_toml(pi / "device.toml")["state_dir"] == "/var/lib/ioft/printer1"
        with (tmp_path / "printer1.log").open("wb") as log:
            device = subprocess.Popen(
                [sys.executable, "-m", "edge.cli", "--device", "printer1", "--config", str(pi / "device.toml"),
                 "--state-dir", str(tmp_path / "state"), "--simulate", "printer"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            out = cli("fleet", "status", "--config", str(root / "operator" / "operator.toml"), "--json")
            if out.returncode == 0 and json.loads(out.stdout).get("printer1", {}).get("state") == "online":
                break
            assert device.poll() is None, (tmp_path / "printer1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.5)
    finally:
        if device is not None:
            device.terminate()
            device.wait(20)
        broker.stop()


def test_add_renew_and_revoke_devices_on_a_running_broker(fleet_dir, tmp_path):
    port = free_port()
    root = init(fleet_dir, port)
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    try:
        on_pi = {
            d: shutil.copytree(root / "devices" / d, tmp_path / "pi" / d) for d in ("printer1", "printer2")
        }
        assert all(connects(on_pi[d], d, port) for d in on_pi)

        out = cli("fleet", "add-device", "--dir", str(root), "--devices", "printer3")
        assert out.returncode == 0, out.stderr
        assert "edge-trainer --device printer3" in out.stdout
        broker.reload()
        assert connects(root / "devices" / "printer3", "printer3", port)
        assert open_fleet(root).devices == ("printer1", "printer2", "printer3")

        out = cli("fleet", "revoke-device", "--dir", str(root), "--devices", "printer2")
        assert out.returncode == 0, out.stderr
        broker.reload()
        assert not connects(on_pi["printer2"], "printer2", port)  # the device still holds its files
        assert connects(on_pi["printer1"], "printer1", port)
        assert not (root / "devices" / "printer2").exists()

        old_cert = (root / "devices" / "printer1" / "printer1.crt").read_bytes()
        out = cli("fleet", "renew-device", "--dir", str(root), "--devices", "printer1", "--days", "30")
        assert out.returncode == 0, out.stderr
        assert (root / "devices" / "printer1" / "printer1.crt").read_bytes() != old_cert
        broker.reload()
        assert connects(root / "devices" / "printer1", "printer1", port)
        assert connects(on_pi["printer1"], "printer1", port)  # the old one until its files are replaced

        # A leaked key: --revoke-old ends the certificate the Pi still holds, the new one connects.
        out = cli("fleet", "renew-device", "--dir", str(root), "--devices", "printer1", "--revoke-old")
        assert out.returncode == 0 and "old certificate is revoked" in out.stdout, out.stderr
        broker.reload()
        assert not connects(on_pi["printer1"], "printer1", port)
        assert connects(root / "devices" / "printer1", "printer1", port)

        out = cli("fleet", "revoke-device", "--dir", str(root), "--devices", "printer9")
        assert (
            out.returncode == 2 and "printer9 is not enrolled" in out.stderr and "Traceback" not in out.stderr
        )
        assert "Warning" not in broker.log()  # after the reloads either (the refusal logs an Error)
    finally:
        broker.stop()


def test_password_fleet_revocation(fleet_dir, tmp_path):
    port = free_port()
    root = init(fleet_dir, port, "--auth", "passwords")
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    try:
        assert_clean_start(broker)
        pi = shutil.copytree(root / "devices" / "printer2", tmp_path / "pi")
        assert connects(pi, "printer2", port)
        out = cli("fleet", "revoke-device", "--dir", str(root), "--devices", "printer2")
        assert out.returncode == 0, out.stderr
        broker.reload()
        assert not connects(pi, "printer2", port)
        assert connects(root / "devices" / "printer1", "printer1", port)
    finally:
        broker.stop()


def test_the_operators_console_shows_the_brokers_byte_counters(fleet_dir, tmp_path):
    """``/metrics``' broker byte counters come from ``$SYS``, which the generated ACL must let the
    operator read (the console logs in as the operator: the aggregator's login is refused)."""
    port = free_port()
    root = init(fleet_dir, port)
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    seen: dict[str, float | None] = {}
    try:
        for who in ("operator",):
            console = Watched(
                "cloud_aggregator.cli",
                ["console", "--config", str(root / who / f"{who}.toml"), "--state-dir", str(tmp_path / who),
                 "--port", "0", "--refresh", "0.2"],
            )  # fmt: skip
            try:
                console.wait_until(lambda c=console: c.matching("console: http://"), 30, "the console's URL")
                url = console.matching("console: http://")[0].split()[-1]
                # mosquitto keeps its $SYS counters retained: they arrive as soon as the ACL lets them.
                console.wait_until(
                    lambda w=who, u=url: seen.update({w: _broker_bytes(u)}) or seen[w] is not None,
                    30,
                    f"broker byte counters in {who}'s /metrics",
                )
            finally:
                console.stop()
    finally:
        broker.stop()
    assert sorted(seen) == ["operator"] and None not in seen.values(), seen


def _broker_bytes(url: str) -> float | None:
    """``ioft_broker_bytes_sent_total`` from the console's ``/metrics``, ``None`` while it has no sample."""
    text = urllib.request.urlopen(url + "metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ioft_broker_bytes_sent_total":
                return sample.value
    return None
