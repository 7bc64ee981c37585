"""The operator guide (``docs/operator-guide.md``) runs as written.

Every fenced ``sh`` block of the page runs in order, in bash with ``set -euo pipefail``, on
loopback: fleet init with TLS → mosquitto from the written config → ``serve`` with the guide's
sample config → the devices from their folders → the console and ``fleet status`` beside them
→ the operator's ``mosquitto_sub`` over TLS → export → push, then a canary → add and revoke a
device.  The simulated devices record as they run, so the operator's own ``mosquitto_sub``
commands must receive a printer's answer with speed advice, a welder's answer and a worn-tool
alert.  Only what the guide itself reads
from the environment is set: ``IOFT_DIR`` / ``IOFT_STATE`` (a temp folder instead of
``/etc/ioft`` and ``/var/lib``) and the ports ``IOFT_PORT`` / ``IOFT_CONSOLE_PORT``.

The page marks blocks in HTML comments (invisible on the site):

- ``<!-- guide: service ready="TEXT" -->``: the block starts a long-running process; it runs
  in the background and the next block waits until its output holds ``TEXT``; it must still
  be running when the guide ends.
- ``<!-- guide: wait="TEXT" -->``: the block runs once some service's output holds ``TEXT``
  (the guide says "once serve logs ...").

Any other block must exit 0.  A command that stops working fails this test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cloud_aggregator.local.broker import find_mosquitto, free_port

pytestmark = [pytest.mark.broker, pytest.mark.slow]
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"
#: The watching page's commands run on the guide's fleet, after it (its intro says so).
WATCHING = GUIDE.with_name("watching.md")
#: Only guards against hanging the suite; nothing asserts on how long a step took.
WAIT_S = 240
BLOCK = re.compile(r'(?:<!-- guide: (service|wait)(?:=| ready=)"([^"]*)" -->\n)?```sh\n(.*?)```', re.S)


@dataclass(frozen=True)
class Step:
    """One ``sh`` block of the guide and its mark."""

    script: str
    service: bool = False
    ready: str | None = None  # a service's ready line
    wait: str | None = None  # a line some service must have printed before this block runs


def steps(text: str) -> list[Step]:
    """The page's ``sh`` blocks, in order, with their marks."""
    out = []
    for kind, arg, body in BLOCK.findall(text):
        if kind == "service":
            out.append(Step(body, service=True, ready=arg))
        else:
            out.append(Step(body, wait=arg or None))
    return out


def test_the_guide_marks_its_services_and_covers_the_operator_path():
    found = steps(GUIDE.read_text())
    text = "\n".join(s.script for s in found)
    for command in ("fleet init", "mosquitto -c", "serve", "edge-trainer", "console", "fleet status",
                    "mosquitto_sub", "--cafile", "--cert", "export", "push", "--canary", "add-device",
                    "revoke-device"):  # fmt: skip
        assert command in text, command
    services = [s.script.split()[0] for s in found if s.service]
    assert services == [
        "mosquitto",
        "cloud-aggregator",
        *["edge-trainer"] * 4,
        "cloud-aggregator",
        "edge-trainer",
    ]


class Services:
    """The guide's long-running processes, their output in ``work/logs``."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.procs: list[tuple[subprocess.Popen, Path, str]] = []
        (work / "logs").mkdir()

    def start(self, step: Step, n: int) -> None:
        log = self.work / "logs" / f"{n:02d}-{step.script.split()[0]}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", "exec " + step.script.strip()],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.work,
                start_new_session=True,
            )
        self.procs.append((proc, log, step.script))
        self.wait_for(step.ready, only=log)

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log, _ in self.procs
        )

    def wait_for(self, text: str, only: Path | None = None) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            for proc, log, script in self.procs:
                if only is not None and log != only:
                    continue
                if text in log.read_text(errors="replace"):
                    return
                if proc.poll() is not None:
                    pytest.fail(f"service exited {proc.returncode}: {script}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no service printed {text!r}:\n{self.logs()}")
            time.sleep(0.1)

    def check_running(self) -> None:
        for proc, _, script in self.procs:
            if proc.poll() is not None:
                pytest.fail(f"service exited {proc.returncode}: {script}\n{self.logs()}")

    def stop(self) -> None:
        for proc, _, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def test_every_block_of_the_operator_guide_runs_as_written(enterable_dir):
    # Prepare: the guide's variables, and the console scripts and mosquitto on PATH.
    work = enterable_dir  # mosquitto is there (the fixture requires it)
    mosquitto = Path(find_mosquitto() or "/usr/sbin/mosquitto")
    path = [str(Path(sys.executable).parent), str(mosquitto.parent), os.environ.get("PATH", "")]
    env = {
        **os.environ,
        "PATH": os.pathsep.join(path),
        "PYTHONUNBUFFERED": "1",
        "IOFT_DIR": str(work / "etc-ioft"),
        "IOFT_STATE": str(work / "var-lib"),
        "IOFT_PORT": str(free_port()),
        "IOFT_CONSOLE_PORT": str(free_port()),
    }
    services = Services(work, env)
    said_by: dict[str, str] = {}  # each block's script -> its stdout
    logged_by: dict[str, str] = {}  # ... -> its stderr
    try:
        # Execute: each block in order, as written.
        for n, step in enumerate(steps(GUIDE.read_text()) + steps(WATCHING.read_text())):
            if step.service:
                services.start(step, n)
                continue
            if step.wait:
                services.wait_for(step.wait)
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", step.script],
                capture_output=True,
                text=True,
                env=env,
                cwd=work,
                timeout=WAIT_S,
            )
            # Assert: the command worked, said nothing like a crash, and the services live on.
            said = out.stdout + out.stderr
            said_by[step.script], logged_by[step.script] = out.stdout, out.stderr
            assert out.returncode == 0 and "Traceback" not in said, (
                f"guide block {n} exited {out.returncode}:\n{step.script}\n{said}\n{services.logs()}"
            )
            services.check_running()
        logs = services.logs()
        assert "Traceback" not in logs, logs
        assert "abandoned" not in logs and "extending the deadline" not in logs, logs
        # The console and the operator's commands ran beside serve and each other: nobody's
        # connection was taken over by another holding the same identity.
        broker_log = next(log for _, log, script in services.procs if script.startswith("mosquitto"))
        assert "already connected" not in broker_log.read_text(), broker_log.read_text()[-4000:]
        # The simulated machines were answered, and the operator's mosquitto_sub (TLS) saw it.
        watched = watched_messages(next(out for script, out in said_by.items() if "mosquitto_sub" in script))
        layer = watched["ioft/v1/plant-a/answer/printer1/speed"]
        assert layer["kind"] == "layer" and isinstance(layer["expected_speed"], float), layer
        assert "advice" in layer, json.dumps(layer)
        assert isinstance(layer["advice"]["speed"], float) and layer["advice"]["vibration_budget"] == 1.2, (
            layer
        )
        weld = watched["ioft/v1/plant-a/answer/welder1/tool"]
        assert weld["kind"] == "weld" and weld["classes"] == ["TC1", "TC2", "TC3", "TC4"], weld
        # Each probability is published rounded to 6 places (edge/serving/model.py): the sum may miss 1 by
        # half a millionth per class, and by a float's rounding beyond that.
        probs = weld["probabilities"]
        assert abs(sum(probs) - 1.0) <= len(probs) * 5e-7 + 1e-12, weld
        alert = watched["ioft/v1/plant-a/alert/welder1/worn_tool"]
        assert alert["state"] == "raised" and alert["task"] == "tool", alert
        # watching.md: the operator's subscription as written, and a recorder its trainer reads.
        (seen,) = [out for script, out in said_by.items() if "alert/welder1/+" in script]
        assert "ioft/v1/plant-a/answer/welder1/tool {" in seen, seen
        (recorded,) = [err for script, err in logged_by.items() if script.startswith("edge-recorder")]
        appended = re.search(r"stopped: (\d+) rows appended", recorded)
        assert appended and int(appended[1]) > 0, recorded
        assert any((work / "var-lib" / "ioft" / "welder3" / "dataset.segments").iterdir()), recorded
    finally:
        services.stop()


def watched_messages(stdout: str) -> dict[str, dict]:
    """``mosquitto_sub -v``'s lines (``topic payload``) as topic -> the payload's JSON."""
    out = {}
    for line in stdout.splitlines():
        topic, _, payload = line.partition(" ")
        out[topic] = json.loads(payload)
    return out
