"""``push`` checks what it sends, and ``push --wait`` reports what the devices did with it.

Real mosquitto, real ``edge-trainer`` processes and the ``cloud-aggregator push``
console command.  A manifest edited after signing (or an ONNX file that is not the one
signed) used to go out anyway, replacing the retained offer and clearing the stored
chunks of the version the fleet had, so a device installed later could fetch nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cloud_aggregator.local.fleet import FLEET
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from sensors.features.schema import schema_hash
from tests.e2e.test_model_push import CHUNK, Watcher, start_devices

pytestmark = pytest.mark.broker


@pytest.fixture
def keys(tmp_path):
    """The fleet key (private, public path) and another fleet's private key."""
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    other, _ = generate_keypair(tmp_path / "keys" / "other.key")
    return load_private_key(priv), pub, load_private_key(other)


def push(fleet_procs, manifest: Path, pub: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", "push", "--fleet", FLEET, "--broker",
         fleet_procs.broker_url, "--allow-plaintext", "--chunk-size", str(CHUNK), "--public-key", str(pub),
         *extra, str(manifest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def per_device(stdout: str) -> dict[str, str]:
    """``  printer1: installed`` lines as ``{"printer1": "installed"}``."""
    rows = [line.strip().split(": ", 1) for line in stdout.splitlines() if line.startswith("  ")]
    return {device: answer for device, answer in rows}


def test_push_verifies_before_publishing_and_wait_reports_each_device(fleet_procs, keys, tmp_path):
    key, pub, other = keys
    watcher = Watcher(fleet_procs.broker_url)
    try:
        start_devices(fleet_procs, pub, ["printer1"])
        watcher.wait(lambda: watcher.status.get("printer1", {}).get("state") == "online", 30, "online")
        v1 = signed(window_encoder(tmp_path / "v1.onnx", pad_bytes=70_000), tmp_path / "v1", key, version=1)
        out = push(fleet_procs, v1.manifest_path, pub, "--wait", "--wait-timeout", "60")
        assert out.returncode == 0, out.stderr
        assert per_device(out.stdout) == {"printer1": "installed"}

        # The manifest's version edited after signing: refused before anything is published.
        v2 = signed(window_encoder(tmp_path / "v2.onnx", pad_bytes=70_000), tmp_path / "v2", key, version=2)
        body = json.loads(v2.manifest_path.read_text())
        body["manifest"] = body["manifest"].replace('"version":2', '"version":7')
        assert '"version":7' in body["manifest"]
        v2.manifest_path.write_text(json.dumps(body))
        out = push(fleet_procs, v2.manifest_path, pub)
        assert out.returncode == 2 and out.stdout == ""
        assert "signature does not verify" in out.stderr and "Traceback" not in out.stderr

        # A file that is not the one signed, and a package signed with another key: refused too.
        v3 = signed(window_encoder(tmp_path / "v3.onnx", pad_bytes=70_000), tmp_path / "v3", key, version=3)
        data = bytearray(v3.onnx_path.read_bytes())
        data[-1] ^= 0xFF
        v3.onnx_path.write_bytes(bytes(data))
        out = push(fleet_procs, v3.manifest_path, pub)
        assert out.returncode == 2 and "is not the file its manifest signed" in out.stderr
        foreign = signed(window_encoder(tmp_path / "f.onnx"), tmp_path / "f", other, version=4)
        out = push(fleet_procs, foreign.manifest_path, pub)
        assert out.returncode == 2 and "signature does not verify" in out.stderr

        # v1's retained offer and chunks are intact: a device installed now fetches it.
        start_devices(fleet_procs, pub, ["printer2"])
        watcher.wait(lambda: watcher.model("printer2").get("active") == 1, 30, "v1 on printer2", fleet_procs)

        # A model for another feature schema, or a device id nobody answers to: refused at once, before
        # anything is published (they used to go out, be refused by every device and
        # wait out --wait-timeout for printer9).  The refused/pending answers: test_push_devices.
        dwt = signed(
            window_encoder(tmp_path / "s.onnx", schema_hash=schema_hash()), tmp_path / "s", key, version=5
        )
        out = push(
            fleet_procs, dwt.manifest_path, pub, "--devices", "printer1,printer2,printer9",
            "--wait", "--wait-timeout", "20",
        )  # fmt: skip
        assert out.returncode == 2 and "no device printer9 in fleet" in out.stderr, out.stderr
        out = push(fleet_procs, dwt.manifest_path, pub, "--devices", "printer1,printer2", "--wait")
        assert out.returncode == 2 and "printer1, printer2 cannot take enc v5" in out.stderr, out.stderr
        out = push(fleet_procs, dwt.manifest_path, pub, "--wait")
        assert out.returncode == 2 and "no device of fleet" in out.stderr, out.stderr
        assert all(watcher.model(d)["active"] == 1 for d in ("printer1", "printer2"))
        assert all("rejected" not in watcher.model(d) for d in ("printer1", "printer2"))
    finally:
        watcher.stop()
