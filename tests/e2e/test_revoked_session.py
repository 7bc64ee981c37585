"""A revoked certificate loses its live session, and no round waits for it.

``fleet init``'s TLS fleet as written (mosquitto 2.0.11 on its generated config, ``serve`` on
its aggregator TOML, ``edge-trainer`` from copied device folders).  Before: after ``fleet
revoke-device`` and the broker's reload (SIGHUP), the device connected with the revoked
certificate kept its session (mosquitto checks the CRL only at the handshake) and kept
publishing, and every round waited its deadline for it with no line saying for whom.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_aggregator.local.broker import free_port
from cloud_aggregator.store.sqlite import SqliteStore
from tests.e2e.test_fleet_init_broker import Broker, cli, init

pytestmark = pytest.mark.broker
DEVICES = ("printer1", "printer2")
WAIT_S = 120  # guards against a hang only

TASKS = """
[collect]
deadline_s = 3
min_participants = 1
max_extensions = 0

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = 500
hparams = { lr = 0.1, weight_decay = 0.0003, local_steps = 10, lam = 0.9 }
server = { weighting = "uniform" }
"""


def _spawn(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=None)


def _wait(cond, what: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def _records(db: Path) -> list:
    if not db.exists():
        return []
    store = SqliteStore(db, readonly=True)
    try:
        return store.rounds("speed")
    finally:
        store.close()


def test_a_revoked_device_loses_its_live_session_and_no_round_waits_for_it(enterable_dir, tmp_path):
    port = free_port()
    root = init(enterable_dir, port)
    broker = Broker(root / "broker" / "mosquitto.conf", port, tmp_path / "mosquitto.log")
    procs: list[subprocess.Popen] = []
    agg_log, db = tmp_path / "aggregator.log", tmp_path / "aggregator" / "aggregator.sqlite"
    try:
        for d in DEVICES:
            pi = shutil.copytree(root / "devices" / d, tmp_path / "pi" / d)
            procs.append(_spawn(
                [sys.executable, "-m", "edge.cli", "--device", d, "--config", str(pi / "device.toml"),
                 "--simulate", "printer", "--state-dir", str(tmp_path / "state" / d)],
                tmp_path / f"{d}.log", tmp_path,
            ))  # fmt: skip
        agg_toml = root / "aggregator" / "aggregator.toml"
        with agg_toml.open("a") as f:
            f.write(TASKS)
        procs.append(_spawn(
            [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(agg_toml),
             "--state-dir", str(tmp_path / "aggregator")],
            agg_log, tmp_path,
        ))  # fmt: skip
        _wait(
            lambda: any(sorted(r.participants) == list(DEVICES) for r in _records(db)),
            "a round of both",
            agg_log,
        )

        out = cli("fleet", "revoke-device", "--dir", str(root), "--devices", "printer2")
        assert out.returncode == 0, out.stderr
        assert "fleet end-sessions" in out.stdout, out.stdout
        broker.reload()
        # The reload leaves the session: the device no longer reads the announcements, and the
        # round that waits its deadline for it says so.
        _wait(
            lambda: "deadline passed waiting for printer2" in agg_log.read_text(), "the waiting line", agg_log
        )
        assert "Client printer2 already connected" not in broker.log()

        out = cli("fleet", "end-sessions", "--dir", str(root), "--devices", "printer2")
        assert out.returncode == 0 and "ended the live sessions of printer2" in out.stdout, (
            out.stdout + out.stderr
        )
        assert "Client printer2 already connected, closing old connection" in broker.log()
        after = len(_records(db))
        # Its reconnection is refused at the handshake (the device's own line: counting the broker's
        # refusals raced the device, whose refusal could land before the count was taken) ...
        device_log = tmp_path / "printer2.log"
        _wait(
            lambda: "the broker refused our client certificate" in device_log.read_text(),
            "a refused reconnection",
            device_log,
        )
        # ... its retained status says revoked, and the rounds close on printer1's answer alone.
        _wait(lambda: len(_records(db)) >= after + 3, "three more rounds", agg_log)
        for r in _records(db)[after + 1 :]:
            assert r.participants == ["printer1"] and r.extra.get("closed") == "answered", r
        status = cli("fleet", "status", "--config", str(root / "operator" / "operator.toml"), "--json")
        assert json.loads(status.stdout)["printer2"]["state"] == "revoked", status.stdout

        # A device still enrolled is not taken over.
        out = cli("fleet", "end-sessions", "--dir", str(root), "--devices", "printer1")
        assert out.returncode == 2 and "revoke-device first" in out.stderr and "Traceback" not in out.stderr
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()
