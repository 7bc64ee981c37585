"""Staged rollouts on a real fleet: mosquitto, `edge-trainer` processes, real ONNX files, and the
`cloud-aggregator push --canary` / `rollout status | resume` commands as an operator runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cloud_aggregator.local.fleet import FLEET
from cloud_aggregator.models.push import push_messages, push_model
from cloud_aggregator.store.sqlite import SqliteStore
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push, topics
from tests.e2e import test_model_push as push_tests
from tests.e2e.test_model_push import CHUNK, Watcher, operator

keys = push_tests.keys  # the same fixture: the fleet key pair and another
DEVICES = ["printer1", "printer2", "printer3"]


class History(Watcher):
    """A Watcher that also keeps every version each device reported active or fetching."""

    def __init__(self, url: str) -> None:
        self.seen: dict[str, set[int]] = {}
        super().__init__(url)

    def _on_message(self, client, userdata, msg) -> None:
        super()._on_message(client, userdata, msg)
        for device in DEVICES:
            enc = self.model(device)
            versions = {enc.get("active"), (enc.get("transfer") or {}).get("version")} - {None}
            self.seen.setdefault(device, set()).update(versions)


def cli(fleet_procs, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cloud_aggregator.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def aggregator_store(tmp_path) -> Path:
    """The aggregator's state folder with its store, as ``serve`` leaves it (push never creates one)."""
    SqliteStore(tmp_path / "aggregator" / "aggregator.sqlite").close()
    return tmp_path / "aggregator"


def canary_push(fleet_procs, package, pub, state_dir, *extra: str) -> subprocess.CompletedProcess:
    """``push --canary ...``, signed with the fleet's private key beside ``pub`` (the ``keys`` fixture's)."""
    return cli(
        fleet_procs, "push", str(package.manifest_path), "--fleet", FLEET, "--broker", fleet_procs.broker_url,
        "--allow-plaintext", "--chunk-size", str(CHUNK), "--public-key", str(pub), "--state-dir", str(state_dir),
        "--signing-key", str(pub.with_suffix(".key")), *extra,
    )  # fmt: skip


def rollout(fleet_procs, state_dir, *args: str) -> subprocess.CompletedProcess:
    session = ["--fleet", FLEET, "--broker", fleet_procs.broker_url, "--allow-plaintext"]
    return cli(
        fleet_procs,
        "rollout",
        *args,
        "--state-dir",
        str(state_dir),
        *(session if args[0] != "status" else []),
    )


@pytest.mark.broker
def test_a_canary_that_scores_the_new_model_worse_stops_the_rollout(fleet_procs, keys, tmp_path):
    key, pub, _, _ = keys
    state_dir = aggregator_store(tmp_path)
    # The devices' own guard lets any score through: the rollout's margin is the judge here.
    device_toml = tmp_path / "device.toml"
    device_toml.write_text("[model]\nrollback_margin = 1.0\n")
    watcher = History(fleet_procs.broker_url)
    session = operator(fleet_procs.broker_url)
    try:
        for d in DEVICES:
            fleet_procs.start_device(
                d, "--simulate", "printer-raw", "--model-key", str(pub), "--config", str(device_toml)
            )
        watcher.wait(
            lambda: all(watcher.status.get(d, {}).get("state") == "online" for d in DEVICES), 30, "online"
        )
        out = canary_push(
            fleet_procs,
            signed(window_encoder(tmp_path / "v0.onnx"), tmp_path / "p0", key),
            pub,
            state_dir,
            "--canary",
            "1",
        )
        assert out.returncode == 2 and "push the first version without --canary" in out.stderr
        v1 = signed(window_encoder(tmp_path / "v1.onnx"), tmp_path / "p1", key)
        push_model(session, FLEET, v1, chunk_size=CHUNK)
        watcher.wait(
            lambda: all(watcher.model(d).get("active") == 1 for d in DEVICES), 30, "v1 active", fleet_procs
        )
        v1_scores = {d: watcher.model(d)["metric"] for d in DEVICES}

        # v2 holds almost nothing of the signal: a canary scores it far below v1 -> stop, roll back.
        worse = signed(
            window_encoder(tmp_path / "v2.onnx", kind="mean", pad_bytes=70_000),
            tmp_path / "p2",
            key,
            version=2,
        )
        out = canary_push(fleet_procs, worse, pub, state_dir, "--canary", "2", "--wait-timeout", "40")
        assert out.returncode == 1, out.stdout + out.stderr
        assert "canaries printer1, printer2" in out.stdout and ": stopped" in out.stdout
        assert "is below v1's" in out.stdout
        print(out.stdout)
        watcher.wait(
            lambda: all(watcher.model(d).get("active") == 1 for d in DEVICES[:2]), 20, "canaries rolled back"
        )
        for d in DEVICES[:2]:
            enc = watcher.model(d)
            assert 2 in watcher.seen[d] and enc["metric"] == v1_scores[d]
            assert "withdrawn" in enc["rejected"][-1]["reason"]
        assert watcher.seen["printer3"] == {1}  # the rest never fetched v2
        status = json.loads(rollout(fleet_procs, state_dir, "status", "--json").stdout)
        assert [(r["version"], r["state"]) for r in status] == [(2, "stopped")]
        assert "below v1's" in status[0]["reason"] and status[0]["canaries"] == DEVICES[:2]

        # v3 is as good as v1: a canary phase left undecided (no time to answer) survives in the
        # store, `rollout resume` (a new process) promotes it, and the rest install it.
        better = signed(window_encoder(tmp_path / "v3.onnx", pad_bytes=8), tmp_path / "p3", key, version=3)
        out = canary_push(fleet_procs, better, pub, state_dir, "--canary", "50%", "--wait-timeout", "0")
        assert out.returncode == 1 and "rollout resume enc" in out.stdout, out.stdout + out.stderr
        assert ": canary" in rollout(fleet_procs, state_dir, "status").stdout
        again = canary_push(fleet_procs, better, pub, state_dir, "--canary", "1")
        assert again.returncode == 2 and "still in its canary phase" in again.stderr
        out = rollout(fleet_procs, state_dir, "resume", "enc", "--wait-timeout", "40")
        assert out.returncode == 0 and ": promoted" in out.stdout, out.stdout + out.stderr
        watcher.wait(lambda: all(watcher.model(d).get("active") == 3 for d in DEVICES), 30, "v3 everywhere")
        assert all(watcher.model(d)["previous"] == 1 for d in DEVICES)
        assert rollout(fleet_procs, state_dir, "abort", "enc").returncode == 2  # promoted: nothing to abort

        # The operator aborts an undecided rollout: its canary goes back to v3, the rest never see v4.
        v4 = signed(window_encoder(tmp_path / "v4.onnx", pad_bytes=16), tmp_path / "p4", key, version=4)
        out = canary_push(fleet_procs, v4, pub, state_dir, "--canary", "1", "--wait-timeout", "0")
        assert out.returncode == 1, out.stdout + out.stderr
        watcher.wait(lambda: watcher.model("printer1").get("active") == 4, 20, "v4 on the canary")
        out = rollout(fleet_procs, state_dir, "abort", "enc", "--wait-timeout", "20")
        assert out.returncode == 0 and ": aborted" in out.stdout and "rolled back" in out.stdout, out.stdout
        watcher.wait(lambda: watcher.model("printer1").get("active") == 3, 20, "canary back on v3")
        assert 4 not in watcher.seen["printer2"] | watcher.seen["printer3"]

        # Rollback without the signing key: v1's genuine offer with an unsigned withdrawn = [3]
        # (the broker's credential suffices to publish it).  Every device refuses it and keeps v3.
        forged = replace(
            model_push.ModelOffer.decode(push_messages(FLEET, v1, chunk_size=CHUNK)[0][1]), withdrawn=(3,)
        )
        session.publish(topics.topic_model_offer(FLEET, "enc"), forged.encode(), retain=True, timeout=10)
        watcher.wait(
            lambda: all("carries no signature" in str(watcher.model(d).get("rejected")) for d in DEVICES),
            20,
            "forged withdrawal refused",
        )
        assert all(watcher.model(d)["active"] == 3 for d in DEVICES)
        for d in DEVICES:
            assert "withdrawal of enc v[3] carries no signature" in fleet_procs.log(d)
    finally:
        session.stop()
        watcher.stop()
