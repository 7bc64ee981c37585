"""The systemd units under a real systemd: a Debian bookworm root booted with ``systemd-nspawn``.

What the README's *Installing a Pi* and broker-host steps do, as written, in one x86_64
Debian bookworm root (``debootstrap``, reused from ``/var/tmp/ioft-svc-root``) booted
with systemd 252 as its PID 1, sharing the host's network:

* the broker host: ``useradd ioft-aggregator``, ``fleet init``, ``cp -r …/systemd/*
  /etc/systemd/system/``, ``systemctl restart mosquitto`` (Debian's unit with the
  drop-in), ``systemctl enable --now ioft-aggregator``;
* a device: ``python3 -m venv /opt/ioft``, ``pip install ioft-….whl[device]``, ``sh
  printer1/install.sh``, ``systemctl enable --now ioft-edge-trainer@printer1`` (its data
  simulated), then rounds;
* the watchdog: with ``WatchdogSec=6`` (a drop-in), a SIGSTOPped trainer and serve are
  killed and restarted, while an idle ``serve --service`` is not.

As root on the host, not part of ``make test``: ``python -m deploy.services_check``
(``apt-get install debootstrap systemd-container`` first).  Writes
``deploy/results/services_check.md``.  Serve needs the cloud extra less torch here
(onnx, starlette, uvicorn, prometheus-client, dp-accounting, tqdm), from PyPI.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path("/var/tmp/ioft-svc-root")
RESULTS = Path(__file__).resolve().parent / "results" / "services_check.md"
DEBS = "systemd,systemd-sysv,dbus,python3,python3-venv,ca-certificates,passwd,procps,mosquitto"
SERVE_DEPS = ("onnx", "starlette", "uvicorn", "prometheus-client", "dp-accounting", "tqdm")
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
TASK = """
[collect]
deadline_s = 30
startup_wait_s = 5

[[task]]
name = "speed"
algorithm = "pflda"
model = "sigmoid_glm"
rounds = 3
hparams = { lr = 0.1, weight_decay = 0.0003, local_steps = 10 }
"""


def sh(cmd: str, *, check: bool = True, timeout: float = 900) -> str:
    """``cmd`` on the host, its stdout+stderr (``RuntimeError`` with them on failure when ``check``)."""
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, env=ENV)
    if check and out.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return out.stdout + out.stderr


def build_root(log: list[str]) -> None:
    if (ROOT / "opt/ioft/bin/python3").exists():
        log.append(f"root reused: {ROOT}")
        return
    started = time.monotonic()
    sh(
        f"debootstrap --variant=minbase --include={DEBS} bookworm {ROOT} http://deb.debian.org/debian",
        timeout=1800,
    )
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):  # a proxy's CA, where there is one
        shutil.copy(crt, ROOT / "usr/local/share/ca-certificates" / crt.name)
    sh(f"chroot {ROOT} update-ca-certificates")
    (ROOT / "etc/hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    log.append(
        f"debootstrap + packages: {time.monotonic() - started:.0f} s, {sh(f'du -sh {ROOT}').split()[0]}"
    )


def in_root(cmd: str, **kw) -> str:
    """``cmd`` in the root before it boots (chroot)."""
    return sh(f"chroot {ROOT} sh -c {shlex_quote(cmd)}", **kw)


def shlex_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def install(wheel: Path, log: list[str]) -> None:
    """The README's commands, as root in the root (no sudo there)."""
    home = ROOT / "home/pi"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    shutil.copy(wheel, home / wheel.name)
    started = time.monotonic()
    in_root(
        f'cd /home/pi && python3 -m venv /opt/ioft && /opt/ioft/bin/pip install -q "./{wheel.name}[device]"'
    )
    log.append(
        f"`python3 -m venv /opt/ioft && pip install {wheel.name}[device]`: {time.monotonic() - started:.0f} s"
    )
    in_root(f"/opt/ioft/bin/pip install -q {' '.join(SERVE_DEPS)}")
    # The broker host (here the same machine): the aggregator's user before fleet init, then its units.
    # A rerun starts from no units and no state (the store would refuse a task edited since).
    in_root(
        "rm -rf /etc/systemd/system/multi-user.target.wants/ioft-* /etc/systemd/system/ioft-*.service.d "
        "/var/lib/ioft /var/lib/ioft-aggregator"
    )
    in_root("getent passwd ioft-aggregator >/dev/null || useradd --system --user-group ioft-aggregator")
    in_root("rm -rf /etc/ioft/fleet /etc/ioft/printer1 && /opt/ioft/bin/cloud-aggregator fleet init "
            "--fleet plant-a --devices printer1 --out /etc/ioft/fleet --port 18893")  # fmt: skip
    with (ROOT / "etc/ioft/fleet/aggregator/aggregator.toml").open("a") as fh:
        fh.write(TASK)
    in_root("cp -r /etc/ioft/fleet/systemd/* /etc/systemd/system/ && systemctl enable ioft-aggregator")
    # The device: its folder as copied, install.sh, simulated data (no accelerometer here).
    in_root("cp -r /etc/ioft/fleet/devices/printer1 /home/pi/ && cd /home/pi && sh printer1/install.sh")
    with (ROOT / "etc/ioft/printer1/device.toml").open("a") as fh:
        fh.write('\n[data]\nsource = "simulate-printer"\n')
    in_root("systemctl enable ioft-edge-trainer@printer1")
    log.append("installed: fleet init, ioft-aggregator + mosquitto drop-in, printer1 by its install.sh")


class Booted:
    """The root booted by systemd-nspawn; :meth:`run` runs a command inside it (nsenter)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "-D", str(ROOT), "-b", "-M", "ioftsvc", "--register=no", "--keep-unit",
             "--console=passive"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.pid = self._init_pid()

    def _init_pid(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = sh(f"pgrep -P {self.proc.pid} -x systemd", check=False).split()
            if out:
                return int(out[0])
            time.sleep(0.5)
        raise RuntimeError("the container's systemd did not start")

    def run(self, cmd: str, check: bool = False) -> str:
        return sh(f"nsenter -t {self.pid} -a sh -c {shlex_quote(cmd)}", check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, unit: str, prop: str, want: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.show(unit, prop, "ActiveState", "NRestarts", "StatusText")
            have = got.get(prop, "")
            if (have == want if prop == "ActiveState" else want in have) or time.monotonic() > deadline:
                return got
            time.sleep(1)

    def stop(self) -> None:
        self.run("systemctl poweroff")
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def hang_test(box: Booted, unit: str) -> str:
    """SIGSTOP the unit's main process with ``WatchdogSec=6``: systemd's watchdog must restart it."""
    dropin = ROOT / f"etc/systemd/system/{unit.split('@')[0]}{'@' if '@' in unit else ''}.service.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "short.conf").write_text("[Service]\nWatchdogSec=6\n")
    box.run(f"systemctl daemon-reload && systemctl restart {unit}")
    box.wait(unit, "ActiveState", "active", 60)
    time.sleep(20)  # idle or training: the loop's pings keep it alive
    calm = box.show(unit, "NRestarts")["NRestarts"]
    main_pid = box.show(unit, "MainPID").get("MainPID", "0")
    if not main_pid.isdigit() or main_pid == "0":  # `kill -STOP 0` would stop this very process group
        shutil.rmtree(dropin)
        return f"- `{unit}`: not running, no hang test ({box.show(unit, 'ActiveState', 'Result')})\n"
    box.run(f"kill -STOP {main_pid}")
    after = box.wait(unit, "NRestarts", "1", 30)
    journal = box.run(
        f"journalctl -u {unit} --no-pager | grep -E 'Watchdog timeout|Scheduled restart' | tail -2"
    )
    shutil.rmtree(dropin)
    box.run("systemctl daemon-reload")
    return (f"- `{unit}` with WatchdogSec=6: restarts after 20 s of normal running: {calm}; "
            f"after SIGSTOP of its main process: {after.get('NRestarts')}\n"
            + "".join(f"  - `{line.split(': ', 1)[-1]}`\n" for line in journal.strip().splitlines()))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", type=Path, help="the project's wheel (default: built from this checkout)")
    args = p.parse_args(argv)
    if shutil.which("systemd-nspawn") is None or shutil.which("debootstrap") is None:
        print("needs: apt-get install debootstrap systemd-container (as root)", file=sys.stderr)
        return 2
    log: list[str] = []
    wheel = args.wheel
    if wheel is None:
        dist = Path("/var/tmp/ioft-svc-dist")
        shutil.rmtree(dist, ignore_errors=True)
        sh(f"{sys.executable} -m pip wheel -q --no-deps -w {dist} {Path(__file__).resolve().parents[1]}")
        wheel = next(dist.glob("ioft-*.whl"))
    build_root(log)
    install(wheel, log)
    box = Booted()
    try:
        mosquitto = box.wait("mosquitto", "ActiveState", "active", 60)
        agg = box.wait("ioft-aggregator", "StatusText", "waiting for new or extended tasks", 120)
        dev = box.wait("ioft-edge-trainer@printer1", "StatusText", "answered round 3", 60)
        props = ("User", "WatchdogUSec", "ActiveState", "NRestarts", "StatusText")
        rows = [(u, box.show(u, *props)) for u in ("ioft-aggregator", "ioft-edge-trainer@printer1")]
        status = box.run("systemctl status mosquitto --no-pager")
        dropin = "its drop-in ioft.conf loaded" if "ioft.conf" in status else "drop-in NOT loaded"
        hung = hang_test(box, "ioft-edge-trainer@printer1") + hang_test(box, "ioft-aggregator")
    finally:
        box.stop()
    version = sh(f"chroot {ROOT} systemctl --version").splitlines()[0]
    table = "".join(
        f"| `{u}` | {s.get('User')} | {s.get('WatchdogUSec')} | {s.get('ActiveState')} | {s.get('NRestarts')} "
        f"| {s.get('StatusText')} |\n"
        for u, s in rows
    )
    RESULTS.write_text(f"""# The systemd units under a real systemd (`python -m deploy.services_check`)

x86_64 Debian bookworm (debootstrap minbase) booted by systemd-nspawn on the host; {version}.
Not a Raspberry Pi: the units and the README's commands are what is checked here, not arm64.

{chr(10).join(f"- {line}" for line in log)}
- mosquitto (Debian's unit + the fleet's drop-in): {mosquitto.get("ActiveState")}, {dropin}

| unit | user | watchdog | state | restarts | status line |
|---|---|---|---|---|---|
{table}
Watchdog: a loop that stops (SIGSTOP) is killed and restarted; a running one is not.

{hung}""")
    print(RESULTS.read_text())
    return (
        0 if "answered round 3" in dev.get("StatusText", "") and "waiting" in agg.get("StatusText", "") else 1
    )


if __name__ == "__main__":
    sys.exit(main())
