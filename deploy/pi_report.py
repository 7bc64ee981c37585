"""``deploy/results/pi_check.md`` from one Pi check's figures (arm64 emulated beside the x86_64 host)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, Any

from benchmarks.common import markdown_table

if TYPE_CHECKING:
    from deploy.pi_fleet import DeviceFigures, FleetRun
    from deploy.pi_measure import Usage
    from deploy.pi_root import Install
    from deploy.pi_tests import TestRun

MIB = 1024 * 1024


def _host_cpu() -> str:
    for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115 (a small read)
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def qemu_version() -> str:
    """The emulator's version line, measured by the check (render only formats what it is given)."""
    try:
        out = subprocess.run(
            ["qemu-aarch64-static", "--version"], capture_output=True, text=True, check=False
        )
    except OSError:
        return "qemu-aarch64-static (not found)"
    return out.stdout.splitlines()[0] if out.stdout else "qemu-aarch64-static (version unknown)"


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _rounds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _device_rows(pi: DeviceFigures, host: DeviceFigures) -> list[list[str]]:
    both = (pi, host)
    return [
        ["start to 'running': CPU s (wall s)", *(f"{d.start_cpu_s:.2f} ({d.start_wall_s:.1f})" for d in both)],
        ["CPU s per round, mean of rounds 1..R", *(f"{d.mean_cpu_s:.4f}" for d in both)],
        ["CPU s per round, median of rounds 2..R", *(f"{d.steady_cpu_s:.2f}" for d in both)],
        ["CPU s per round, rounds 1..R", *(_rounds(d.cpu_per_round_s) for d in both)],
        ["local training s per round (daemon's log), median",
         *(f"{statistics.median(d.train_s):.2f}" if d.train_s else "-" for d in both)],
        ["peak RSS (wait4 ru_maxrss)", *(f"{d.usage.peak_rss_mib:.1f} MiB" for d in both)],
        ["total CPU s over the run", *(f"{d.usage.cpu_s:.2f}" for d in both)],
    ]  # fmt: skip


def _recorder_rows(recorder: dict[str, tuple[Usage, dict[str, Any]]]) -> list[list[str]]:
    arm, host = recorder["arm64"], recorder["host"]
    accel = lambda st: st.get("accel", {})  # noqa: E731
    return [
        ["wall s", *(f"{u.wall_s:.1f}" for u, _ in (arm, host))],
        ["CPU s", *(f"{u.cpu_s:.2f}" for u, _ in (arm, host))],
        ["peak RSS", *(f"{u.peak_rss_mib:.1f} MiB" for u, _ in (arm, host))],
        ["rows appended (train/test)",
         *(f"{st.get('appended', '?')} ({st.get('rows', {}).get('train', '?')}/{st.get('rows', {}).get('test', '?')})"
           for _, st in (arm, host))],
        ["layers dropped (reason: count)",
         *(", ".join(f"{k}: {v}" for k, v in st.get("dropped_layers", {}).items()) or "0" for _, st in (arm, host))],
        ["accelerometer: achieved Hz of 200", *(f"{accel(st).get('achieved_hz', 0):.1f}" for _, st in (arm, host))],
        ["accelerometer: samples dropped", *(str(accel(st).get("dropped", "?")) for _, st in (arm, host))],
    ]  # fmt: skip


def _on_host(tests: TestRun, test_id: str) -> str:
    if tests.failed_on_host is None:
        return "not rerun on the host"
    return "**fails on the host too**" if test_id in tests.failed_on_host else "passes on the host"


def _versions(freeze: list[str]) -> list[list[str]]:
    rows = []
    for line in freeze:
        name, _, version = line.partition("==")
        if " @ " in line:  # the project itself, installed from its wheel
            name, version = line.split(" @ ")[0], f"the wheel ({line.rsplit('/', 1)[-1]})"
        try:
            host = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            host = "-"
        rows.append([name, version, host])
    return rows


def render(
    *,
    commit: str,
    binfmt: str,
    emulator: str,
    root_state: str,
    python: str,
    install: Install,
    imports: dict[str, dict[str, float]],
    recorder: dict[str, tuple[Usage, dict[str, Any]]],
    fleet: FleetRun,
    tests: TestRun | None,
    layers: int,
    test_cmd: str,
) -> str:
    """The results file's text."""
    arm, host = imports["arm64"], imports["host"]
    parts = [
        "# pi_check",
        "",
        f"Command: `sudo make pi-check` (`python -m deploy.pi_check`), wheel built from commit `{commit}`.  ",
        f"Commit: {commit}  ",
        f"Host: x86_64, {_host_cpu()}, {os.cpu_count()} CPUs, Python {platform.python_version()} (the project's venv, "
        "the tree installed editable).  ",
        f"arm64: Debian bookworm arm64 root ({root_state} this run) from `debootstrap --arch=arm64 --foreign`, "
        f"{python}, run by {emulator} through binfmt_misc ({binfmt}).  ",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "**Every arm64 figure is emulated**: qemu-user translates each aarch64 instruction to x86_64 on",
        "this host, so its CPU and RSS include the emulator's own work and translated-code cache. They",
        "show that the device side installs, imports and runs on arm64, and roughly what it costs under",
        "emulation; they are not a Raspberry Pi's speed. The x86_64 column is the same command on the host",
        "in the same run, for reference.",
        "",
        "## Install (device extra, `pip install --only-binary=:all: 'ioft-…whl[device]'`, fresh venv)",
        "",
        markdown_table(
            ["", "arm64 (emulated)"],
            [
                [
                    f"venv + pip install time (root's pip cache {'cold' if root_state == 'built' else 'warm'})",
                    f"{install.seconds:.0f} s",
                ],
                ["installed size of the venv (`du -sb`)", f"{install.venv_bytes / MIB:.1f} MiB"],
                ["torch installed", "no"],
            ],
        ),
        "",
        "## Import time of the device modules (median of 3 fresh interpreters, bytecode cached)",
        "",
        markdown_table(
            ["import", "arm64 (emulated)", "x86_64 host"],
            [[k, _ms(arm[k]), _ms(host[k])] for k in arm],
        ),
        "",
        "`edge (rest)`: `edge.cli`, `edge.recording.cli`, `edge.models.onnx` and what they pull in beyond",
        "numpy, onnxruntime and pywt. torch was imported by none of them.",
        "",
        f"## `edge-recorder --simulate printer --layers {layers} --layer-s 0.5`",
        "",
        markdown_table(["", "arm64 (emulated)", "x86_64 host"], _recorder_rows(recorder)),
        "",
        f"## `edge-trainer --simulate printer`, {fleet.rounds} rounds of PFL-DA against a fleet on the host",
        "",
        "`fleet init` (TLS, client certificates) → the fleet's mosquitto on the host → `pi1`'s device",
        "folder copied into the root and `edge-trainer` run there, `host1` run on the host → the README's",
        "`speed` task (PFL-DA, sigmoid GLM) appended to `aggregator.toml` → `cloud-aggregator serve`.",
        f"Rounds completed: {fleet.completed} of {fleet.rounds}; participants per round: "
        f"{', '.join('+'.join(p) for p in fleet.participants)}; round wall time (s): {_rounds(fleet.round_wall_s)}.",
        "",
        "CPU per round: the device process's CPU (`/proc/<pid>/stat`, all threads) read at each of its",
        "round log lines, differenced (the kernel counts in 10 ms ticks, hence the mean over all rounds);",
        "it includes the MQTT traffic over TLS and the idle polling between rounds. The task is small (a",
        "one-feature GLM): these rounds cost the daemon's plumbing more than its arithmetic.",
        "",
        markdown_table(
            ["", "pi1: arm64 (emulated)", "host1: x86_64 host"], _device_rows(fleet.pi, fleet.host)
        ),
        "",
        "## Device-side tests inside the arm64 root",
        "",
    ]
    if tests is None:
        parts += ["Not run this time (`--skip-tests`).", ""]
    else:
        parts += [
            f"`{test_cmd}` against the installed wheel, with mosquitto from Debian's arm64 packages, the CI",
            "settings (`CI=1`: broker tests fail rather than skip; hypothesis derandomized) less hypothesis'",
            "deadline and too-slow check (they time qemu).",
            "",
            f"Result: **{tests.summary}** ({tests.seconds / 60:.1f} min).",
            "",
        ]
        if tests.failed:
            parts += [
                "Failed or errored (the first error line of each; then the same test on the x86_64 host,",
                "from the same source, in the project's venv):",
                "",
            ]
            parts += [f"- `{t}`: {why} — {_on_host(tests, t)}" for t, why in tests.failed] + [""]
        if tests.skipped:
            parts += ["Skipped (reason: tests):", ""]
            parts += [f"- {why}: {n}" for why, n in tests.skipped.items()] + [""]
    parts += [
        "## Exact versions installed in the arm64 root (`pip freeze --all`)",
        "",
        markdown_table(["package", "arm64 root", "host venv"], _versions(install.freeze)),
        "",
        f"Then, for the tests only: {', '.join(f'`{t}`' for t in install.test_tools)} (aarch64/pure-Python wheels).",
        "",
    ]
    return "\n".join(parts)
