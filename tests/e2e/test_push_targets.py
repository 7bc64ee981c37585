"""Whom a plain push offers a model to, and ``push --devices`` naming a device that is not there.
Real mosquitto, real ``edge-trainer`` processes, the ``push`` command.

A plain push offered a raw-window encoder to every device; the ones whose data follow another
schema refused it and ``push --wait`` exited 1.  ``push --devices welder9`` (never enrolled) was
accepted, waited out its timeout and replaced the retained offer with one for welder9 alone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cloud_aggregator.local.fleet import FLEET
from cloud_aggregator.models.push_targets import replaced_offer
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from tests.e2e.test_model_push import Watcher, operator

pytestmark = pytest.mark.broker


def push(fleet_procs, manifest, pub, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", "push", "--fleet", FLEET, "--broker",
         fleet_procs.broker_url, "--allow-plaintext", "--public-key", str(pub), *extra, str(manifest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_push_offers_to_the_devices_that_can_take_it_and_refuses_unknown_ids(fleet_procs, tmp_path):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    key = load_private_key(priv)
    watcher = Watcher(fleet_procs.broker_url)
    session = operator(fleet_procs.broker_url)
    try:
        # printer1 records raw windows (the encoder's schema); printer2's rows have no schema.
        fleet_procs.start_device("printer1", "--model-key", str(pub), simulate="printer-raw")
        fleet_procs.start_device("printer2", "--model-key", str(pub), simulate="printer")
        watcher.wait(lambda: all(watcher.status.get(d, {}).get("state") == "online"
                                 for d in ("printer1", "printer2")), 30, "online")  # fmt: skip
        v1 = signed(window_encoder(tmp_path / "v1.onnx"), tmp_path / "v1", key, version=1)
        out = push(fleet_procs, v1.manifest_path, pub, "--wait", "--wait-timeout", "60")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "not offered to printer2: a printer with no feature schema" in out.stdout
        assert "for devices printer1" in out.stdout and "1 installed, 0 refused, 0 pending" in out.stdout
        assert replaced_offer(session, FLEET, "enc").devices == ("printer1",)
        assert "rejected" not in watcher.model("printer2")  # never offered, so never refused

        # A device id nobody answers to: refused at once, and the retained offer is left as it was.
        before = replaced_offer(session, FLEET, "enc")
        v2 = signed(window_encoder(tmp_path / "v2.onnx", seed=1), tmp_path / "v2", key, version=2)
        out = push(fleet_procs, v2.manifest_path, pub, "--devices", "welder9", "--wait")
        assert out.returncode == 2 and out.stdout == "", out.stdout
        assert "cannot push: no device welder9 in fleet" in out.stderr and "Traceback" not in out.stderr
        assert replaced_offer(session, FLEET, "enc") == before
    finally:
        session.stop()
        watcher.stop()
