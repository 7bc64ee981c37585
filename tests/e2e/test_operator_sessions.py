"""Any number of operator sessions beside ``serve``, on the broker ``fleet init`` writes.

The devices' listener makes every login's name its client id (no device can take another's),
so two sessions of one login knock each other off.  README's ``console --config aggregator.toml``
did that to ``serve`` (which then died at its next announcement), and every operator command
(``console``, ``fleet status``, ``push``) shared the ``operator`` id.  Now the operator has a
listener of its own where each session keeps its own client id, and the aggregator's login is
refused for an operator command.  Real mosquitto from the generated TLS config, real processes:
``serve`` + two devices + two consoles + ``fleet status`` + a ``push``, all at once.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from cloud_aggregator.local.broker import free_port
from export.keys import load_private_key
from export.synthetic import signed, window_encoder
from tests.e2e.test_fleet_init_broker import Broker, cli, init
from tests.e2e.test_operator_path import TASKS, console_script, served_rounds, spawn, stop, tail

pytestmark = [pytest.mark.broker, pytest.mark.slow]
DEVICES = ("printer1", "printer2")
WAIT_S = 120  # guards against a hang only


def start_console(work: Path, operator_toml: Path, name: str) -> tuple[subprocess.Popen, str]:
    """``console --config operator.toml`` on a free port; its URL once it serves."""
    log = work / f"{name}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*console_script("cloud-aggregator", "cloud_aggregator.cli"), "console", "--config",
             str(operator_toml), "--state-dir", str(work / "aggregator"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=work,
        )  # fmt: skip
    first = proc.stdout.readline() if proc.stdout else ""
    assert first.startswith("console: "), tail(log)
    return proc, first.split()[-1]


def online_in_console(url: str) -> set[str]:
    """The devices a console's metrics call online (its own MQTT session read their statuses)."""
    with urllib.request.urlopen(url + "metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        line.split('device="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("ioft_device_online{") and float(line.rsplit(" ", 1)[1]) == 1
    }


def test_serve_two_consoles_fleet_status_and_a_push_share_the_broker(enterable_dir: Path):
    work = enterable_dir
    port = free_port()
    fleet = init(work, port)
    agg_toml, operator_toml = fleet / "aggregator" / "aggregator.toml", fleet / "operator" / "operator.toml"
    broker = Broker(fleet / "broker" / "mosquitto.conf", port, work / "mosquitto.log")
    procs: list[subprocess.Popen] = []
    try:
        for d in DEVICES:
            procs.append(spawn(
                [*console_script("edge-trainer", "edge.cli"), "--device", d, "--config",
                 str(fleet / "devices" / d / "device.toml"), "--simulate", "printer",
                 "--state-dir", str(work / "state" / d)],
                work / f"{d}.log", cwd=work,
            ))  # fmt: skip
        with agg_toml.open("a") as f:
            f.write(TASKS.replace("rounds = 2", "rounds = 3"))
        aggregator = spawn(
            [*console_script("cloud-aggregator", "cloud_aggregator.cli"), "serve", "--config", str(agg_toml),
             "--state-dir", str(work / "aggregator")],
            work / "aggregator.log", cwd=work,
        )  # fmt: skip
        procs.insert(0, aggregator)

        # The aggregator's own login for a console: one line, before anything connects.
        out = cli(
            "console", "--config", str(agg_toml), "--state-dir", str(work / "aggregator"), "--port", "0"
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "aggregator's login" in out.stderr and "operator.toml" in out.stderr, out.stderr

        consoles = [start_console(work, operator_toml, f"console{i}") for i in (1, 2)]
        procs += [p for p, _ in consoles]
        deadline = time.monotonic() + WAIT_S
        while not all(online_in_console(url) >= set(DEVICES) for _, url in consoles):
            assert aggregator.poll() is None, tail(work / "aggregator.log")
            assert time.monotonic() < deadline, [tail(work / f"console{i}.log") for i in (1, 2)]
            time.sleep(0.5)

        # fleet status and a push beside them.  The simulated printers' rows carry no feature
        # schema, so the push connects, reads their statuses and offers to nobody (a push targets devices by schema).
        package = signed(
            window_encoder(work / "enc.onnx"), work / "pkg",
            load_private_key(fleet / "model" / "fleet.key"), version=1,
        )  # fmt: skip
        pusher = subprocess.Popen(
            [*console_script("cloud-aggregator", "cloud_aggregator.cli"), "push", "--config", str(operator_toml),
             "--wait", "--wait-timeout", "60", str(package.manifest_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work,
        )  # fmt: skip
        status = cli("fleet", "status", "--config", str(operator_toml), "--json")
        assert status.returncode == 0, status.stderr
        assert {d: json.loads(status.stdout)[d]["state"] for d in DEVICES} == dict.fromkeys(DEVICES, "online")
        pushed, _ = pusher.communicate(timeout=WAIT_S)
        assert pusher.returncode == 2 and "no device of fleet plant can take enc v1" in pushed, pushed
        # Each operator session logged in as a login of its own (operator.<k>), its client id too:
        # the two consoles, fleet status and the push, four at once at most.
        logins = set(re.findall(r" as (operator\.\d+) ", broker.log()))
        assert len(logins) >= 3, broker.log()

        served_rounds(aggregator, work, "speed", 3, DEVICES, *(work / f"console{i}.log" for i in (1, 2)))
        # Every session kept its connection: nobody was closed for another taking its client id.
        log = broker.log()
        assert "already connected, closing old connection" not in log, log
        assert all(p.poll() is None for p, _ in consoles)
        assert all(online_in_console(url) >= set(DEVICES) for _, url in consoles)
        assert "Traceback" not in tail(work / "aggregator.log")
    finally:
        for p in procs:
            stop(p)
        broker.stop()
