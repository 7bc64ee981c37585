"""``make pi-check``: the device side on Raspberry Pi OS's base, Debian bookworm arm64, under qemu.

As root on an x86_64 Debian host: build (or reuse) the arm64 root (:mod:`deploy.pi_root`),
build the project's wheel on the host from the committed tree (``git archive HEAD``), install
its device extra in a fresh venv in the root with ``pip --only-binary=:all:`` (aarch64 wheels
from PyPI; no compiler, no torch), then inside the root: time the device modules' imports, run
``edge-recorder --simulate printer``, run ``edge-trainer --simulate printer`` for a few rounds
against a fleet on the host (:mod:`deploy.pi_fleet`), and run the device-side tests.
Every figure has the host's (x86_64, the project's venv) beside it, measured in the same run.

    sudo .venv/bin/python -m deploy.pi_check [--root /var/tmp/ioft-pi-root] [--rounds 10]

Writes ``deploy/results/pi_check.md``.  A failing step is one line and exit 1; not root,
exit 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from deploy import pi_report
from deploy.pi_fleet import FleetRun, run_fleet
from deploy.pi_measure import IMPORT_PROBE, Usage, Watched, host_env
from deploy.pi_root import (
    ROOT_ENV,
    VENV,
    Install,
    PiCheckError,
    configure_root,
    du_bytes,
    ensure_binfmt,
    ensure_host_tools,
    ensure_root,
    in_root,
    mounted,
    run_logged,
)
from deploy.pi_tests import DEVICE_TESTS, rerun_on_host, run_tests, verdict

REPO = Path(__file__).resolve().parent.parent
TEST_TOOLS = ("pytest", "pytest-timeout", "hypothesis", "onnx")  # at the host venv's versions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pi-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("/var/tmp/ioft-pi-root"), help="the arm64 root (reused)")
    p.add_argument("--work", type=Path, default=Path("/var/tmp/ioft-pi-work"), help="wheel, fleet, logs")
    p.add_argument("--rounds", type=int, default=10, help="fleet rounds for edge-trainer")
    p.add_argument("--layers", type=int, default=10, help="layers edge-recorder --simulate records")
    p.add_argument("--tests-timeout", type=float, default=5400, help="seconds for the device-side tests")
    p.add_argument("--skip-tests", action="store_true", help="skip the device-side tests (quicker)")
    p.add_argument("--render-from", type=Path, help="only render the report from a run's figures.pickle")
    p.add_argument("--out", type=Path, default=REPO / "deploy" / "results" / "pi_check.md")
    return p.parse_args(argv)


def step(name: str) -> None:
    print(f"pi-check: {time.strftime('%H:%M:%S')} {name}", file=sys.stderr, flush=True)


def build_wheel(work: Path, log: Path) -> tuple[Path, Path, str]:
    """The wheel of ``git archive HEAD`` (never the tree's uncommitted edits); the source, wheel, commit."""
    src, dist = work / "src", work / "dist"
    for d in (src, dist):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    commit = run_logged(
        "git rev-parse", ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], log
    ).strip()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise PiCheckError(f"git archive HEAD: {archive.stderr.decode(errors='replace').strip()[-200:]}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    wheel_cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    run_logged("build the wheel (host)", [*wheel_cmd, str(src), "-w", str(dist)], log)
    wheels = sorted(dist.glob("ioft-*.whl"))
    if len(wheels) != 1:
        raise PiCheckError(f"build the wheel: expected one ioft wheel in {dist}, found {len(wheels)}")
    return src, wheels[0], commit


def install_device(root: Path, wheel: Path, log: Path) -> Install:
    """A fresh venv in the root with the wheel's device extra, aarch64 wheels only; then the test tools."""
    venv = root / VENV.lstrip("/")
    shutil.rmtree(venv, ignore_errors=True)
    dist = root / "opt" / "ioft-dist"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    shutil.copy2(wheel, dist / wheel.name)
    pip = [f"{VENV}/bin/python", "-m", "pip"]
    started = time.monotonic()
    run_logged("python3 -m venv (root)", in_root(root, ["python3", "-m", "venv", VENV]), log, env=ROOT_ENV)
    run_logged(
        "pip install the device extra (root, aarch64 wheels only)",
        in_root(root, [*pip, "install", "-q", "--only-binary=:all:", f"/opt/ioft-dist/{wheel.name}[device]"]),
        log, env=ROOT_ENV, timeout=3600,
    )  # fmt: skip
    seconds = time.monotonic() - started
    freeze = run_logged("pip freeze (root)", in_root(root, [*pip, "freeze", "--all"]), log, env=ROOT_ENV)
    if re.search(r"^torch\b", freeze, re.MULTILINE | re.IGNORECASE):
        raise PiCheckError(
            "pip install the device extra: torch got installed; the device extra must not pull it"
        )
    size = du_bytes(venv)
    pins = [f"{t}=={importlib.metadata.version(t)}" for t in TEST_TOOLS]
    run_logged(
        "pip install the test tools (root)",
        in_root(root, [*pip, "install", "-q", "--only-binary=:all:", *pins]),
        log, env=ROOT_ENV, timeout=3600,
    )  # fmt: skip
    return Install(seconds, size, freeze.splitlines(), pins)


def import_times(argv: list[str], env: dict[str, str], log: Path, repeats: int = 3) -> dict[str, float]:
    """Median over ``repeats`` fresh interpreters (after one that writes the bytecode caches)."""
    runs = []
    for _ in range(repeats + 1):
        runs.append(json.loads(run_logged("import times", [*argv, "-c", IMPORT_PROBE], log, env=env)))
    if any(r["torch_imported"] for r in runs):
        raise PiCheckError("import times: the device modules imported torch")
    return {k: sorted(r[k] for r in runs[1:])[repeats // 2] for k in runs[0] if k != "torch_imported"}


def run_recorder(argv: list[str], env: dict[str, str], log: Path, state: Path) -> tuple[Usage, dict]:
    """``edge-recorder --simulate printer`` to the end of its print; its usage and status file."""
    rec = Watched(argv, log, env)
    usage = rec.wait(1800)
    if usage is None:
        rec.stop()
        raise PiCheckError(f"edge-recorder --simulate printer: still running after 1800 s (log: {log})")
    if usage.returncode != 0:
        raise PiCheckError(f"edge-recorder --simulate printer: exit {usage.returncode} (log: {log})")
    status = state / "recorder-status.json"
    return usage, json.loads(status.read_text()) if status.exists() else {}


def run_check(args: argparse.Namespace) -> tuple[Path, str | None]:
    """Every step, and the report written; ``(the report, why the device-side tests did not pass)``."""
    work, root = args.work, args.root
    work.mkdir(parents=True, exist_ok=True)
    log = work / "pi-check.log"
    log.write_text(f"pi-check {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n")
    step(f"host tools and binfmt (log: {log})")
    ensure_host_tools(log)
    binfmt = ensure_binfmt(log)
    step(f"the arm64 root in {root} (first build: ~10 min under qemu)")
    root_state = ensure_root(root, log)
    with mounted(root, log):
        step("the root's packages (python3, python3-venv, mosquitto), CAs")
        configure_root(root, log)
        arch = run_logged("uname -m (root)", in_root(root, ["uname", "-m"]), log, env=ROOT_ENV).strip()
        if arch != "aarch64":
            raise PiCheckError(f"the root runs as {arch}, not aarch64: is qemu-aarch64 registered?")
        pyver = run_logged("python3 -V (root)", in_root(root, ["python3", "-V"]), log, env=ROOT_ENV).strip()
        step("the wheel (host, from git HEAD)")
        src, wheel, commit = build_wheel(work, log)
        step("pip install the device extra in the root (aarch64 wheels only)")
        install = install_device(root, wheel, log)
        step("import times (root, then host)")
        imports = {
            "arm64": import_times(in_root(root, [f"{VENV}/bin/python"]), ROOT_ENV, log),
            "host": import_times([sys.executable], host_env(), log),
        }
        step(f"edge-recorder --simulate printer, {args.layers} layers (root, then host)")
        rec_args = ["--simulate", "printer", "--layers", str(args.layers), "--layer-s", "0.5"]
        shutil.rmtree(root / "var" / "lib" / "ioft-pi-rec", ignore_errors=True)
        shutil.rmtree(work / "host-rec", ignore_errors=True)
        recorder = {
            "arm64": run_recorder(
                in_root(root, [f"{VENV}/bin/edge-recorder", *rec_args, "--state-dir", "/var/lib/ioft-pi-rec"]),
                {**ROOT_ENV, "PYTHONUNBUFFERED": "1"}, work / "recorder-arm64.log", root / "var/lib/ioft-pi-rec",
            ),
            "host": run_recorder(
                [str(Path(sys.executable).with_name("edge-recorder")), *rec_args, "--state-dir", str(work / "host-rec")],
                host_env(), work / "recorder-host.log", work / "host-rec",
            ),
        }  # fmt: skip
        step(
            f"fleet: mosquitto + serve on the host, edge-trainer in the root and on the host, {args.rounds} rounds"
        )
        fleet: FleetRun = run_fleet(root, work, args.rounds, log)
        tests = None
        if not args.skip_tests:
            step(f"device-side tests in the root (slow under qemu; limit {args.tests_timeout:.0f} s)")
            tests = run_tests(root, src, args.tests_timeout, log)
            step("the tests that failed in the root, again on the host (same source)")
            tests = rerun_on_host(src, tests, log)
    figures = dict(
        commit=commit, binfmt=binfmt, emulator=pi_report.qemu_version(), root_state=root_state, python=pyver, install=install,
        imports=imports, recorder=recorder, fleet=fleet, tests=tests, layers=args.layers,
        test_cmd=f"pytest -m 'not torch' {' '.join(DEVICE_TESTS)}",
    )  # fmt: skip
    # Kept, so a report can be rendered again (--render-from) without another hour under qemu.
    (work / "figures.pickle").write_bytes(pickle.dumps(figures))
    step(f"writing {args.out}")
    args.out.write_text(pi_report.render(**figures))
    return args.out, None if tests is None else verdict(tests)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render_from is not None:  # our own file, written by an earlier run
        figures = pickle.loads(args.render_from.read_bytes())
        figures.setdefault("emulator", pi_report.qemu_version())  # figures kept before it was one
        args.out.write_text(pi_report.render(**figures))
        return 0
    if os.geteuid() != 0:
        print("pi-check: needs root (debootstrap, chroot, mount): run it as root, e.g. sudo make pi-check",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        out, failed = run_check(args)
    except PiCheckError as exc:
        print(f"pi-check: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pi-check: interrupted", file=sys.stderr)
        return 130
    print(f"pi-check: wrote {out}")
    if failed is not None:
        print(f"pi-check: {failed} (the report lists each)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
