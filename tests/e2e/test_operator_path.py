"""The README's "Running a real fleet" path, run as written on loopback.

One operator's walk, every step a real process: ``cloud-aggregator fleet init`` for two
printers (certificate auth, the default) → ``mosquitto -c <fleet>/broker/mosquitto.conf``
started as root, with a clean log → each ``devices/<id>/`` folder copied elsewhere (as onto
its Pi) and ``edge-trainer --device <id> --config <copy>/device.toml --simulate printer`` →
``[collect]`` and a ``[[task]]`` added to the aggregator TOML fleet init wrote (its own hint:
"add [[task]] tables") → ``cloud-aggregator serve --config`` that TOML runs its rounds over
mqtts → ``cloud-aggregator fleet status --config operator.toml`` shows both printers online.

Two deliberate departures, both flags the README documents: ``--state-dir`` for the devices
and the aggregator.  The README's ``state_dir`` values (``/var/lib/ioft/<id>`` in
``device.toml``, ``/var/lib/ioft-aggregator`` as ``serve``'s default) are writable here (we
run as root), but a test must not write into the host's ``/var/lib`` nor share state with
another run, so both go into the test's temp folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_aggregator.local.broker import free_port
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol.config import load_toml
from tests.e2e.test_fleet_init_broker import Broker, assert_clean_start, cli, init

pytestmark = [pytest.mark.broker, pytest.mark.slow]
DEVICES = ("printer1", "printer2")
ROUNDS = 2
#: Only guards against hanging the suite; nothing asserts on how long a step took.
WAIT_S = 240

#: Appended to the generated aggregator TOML, the way the README's "Aggregator:" example
#: writes them: both printers must answer, a short deadline, a small PFL-DA task.
TASKS = f"""
[collect]
deadline_s = 20
min_participants = {len(DEVICES)}

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = {ROUNDS}
hparams = {{ lr = 0.1, weight_decay = 0.0003, local_steps = 10, lam = 0.9 }}
server = {{ weighting = "uniform" }}
"""


def console_script(name: str, module: str) -> list[str]:
    """The console script the operator types (``.venv/bin/<name>``), or ``python -m`` without one."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


@pytest.fixture
def work(enterable_dir: Path) -> Path:
    return enterable_dir


def spawn(cmd: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def served_rounds(
    aggregator: subprocess.Popen, work: Path, task: str, rounds: int, devices: tuple[str, ...], *logs: Path
) -> dict[str, dict[str, int]]:
    """Wait for ``serve`` to exit 0, check that it closed rounds 1..``rounds`` of ``task`` with every
    device in each, and return the store's refusal counts by device and reason."""
    logs = (work / "aggregator.log", *logs)
    try:
        rc = aggregator.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail("serve still running:\n" + "\n".join(tail(log) for log in logs))
    assert rc == 0, tail(work / "aggregator.log")
    store = SqliteStore(work / "aggregator" / "aggregator.sqlite", readonly=True)
    try:
        records = store.rounds(task)
        refusals = store.rejection_counts_by_reason(task)
    finally:
        store.close()
    assert [r.round for r in records] == list(range(1, rounds + 1)), tail(work / "aggregator.log")
    for r in records:
        assert r.status == "completed" and sorted(r.participants) == sorted(devices), r
    return refusals


def test_the_readme_operator_path_from_fleet_init_to_a_completed_round_over_tls(work):
    port = free_port()
    fleet = init(work, port)  # fleet init --devices printer1,printer2 --host 127.0.0.1 --port PORT
    agg_toml = fleet / "aggregator" / "aggregator.toml"
    operator_toml = fleet / "operator" / "operator.toml"
    broker = Broker(fleet / "broker" / "mosquitto.conf", port, work / "mosquitto.log")
    procs: list[subprocess.Popen] = []
    try:
        assert_clean_start(broker)  # no "Warning"/"Error"; running as the mosquitto user

        for d in DEVICES:  # copy devices/<id>/ to "its Pi", run it from there
            pi = shutil.copytree(fleet / "devices" / d, work / "pi" / d / "etc-ioft")
            procs.append(
                spawn(
                    [*console_script("edge-trainer", "edge.cli"), "--device", d,
                     "--config", str(pi / "device.toml"), "--simulate", "printer",
                     "--state-dir", str(work / "state" / d)],
                    work / f"{d}.log",
                    cwd=work,
                )
            )  # fmt: skip

        assert "task" not in load_toml(agg_toml)  # fleet init leaves the tasks to the operator
        with agg_toml.open("a") as f:
            f.write(TASKS)
        cfg = load_toml(agg_toml)
        assert cfg["broker"] == f"mqtts://127.0.0.1:{port}" and "tls" in cfg  # TLS, as fleet init wrote it
        aggregator = spawn(
            [*console_script("cloud-aggregator", "cloud_aggregator.cli"), "serve", "--config", str(agg_toml),
             "--state-dir", str(work / "aggregator")],
            work / "aggregator.log",
            cwd=work,
        )  # fmt: skip
        procs.insert(0, aggregator)
        served_rounds(aggregator, work, "speed", ROUNDS, DEVICES)
        for d in DEVICES:
            log = tail(work / f"{d}.log")
            assert procs[1 + DEVICES.index(d)].poll() is None, log
            assert "refused" not in log and "Traceback" not in log, log
        # The broker has a single listener, TLS with client certificates: everyone above came in over it.
        log = broker.log()
        for who in ("aggregator", *DEVICES):
            assert f"as {who} " in log, log

        deadline = time.monotonic() + 60
        while True:
            out = cli("fleet", "status", "--config", str(operator_toml), "--json")
            assert "Traceback" not in out.stderr, out.stderr
            states = json.loads(out.stdout) if out.returncode == 0 else {}
            if all(states.get(d, {}).get("state") == "online" for d in DEVICES):
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.5)
        assert "Warning" not in broker.log(), broker.log()
    finally:
        for p in procs:
            stop(p)
        broker.stop()
