"""The device-side tests, run inside the arm64 root against the installed wheel, and what their
pytest output says: counts, each failure with its error line, skips grouped by reason."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from deploy.pi_measure import Watched, host_env
from deploy.pi_root import ROOT_ENV, VENV, in_root

#: The device-side tests: the packages a Pi runs (less the gold tests against torch, marked
#: ``torch``).  Some import cloud_aggregator's pure-NumPy parts (strategies, simulation) or
#: export.synthetic (builds test ONNX files with ``onnx``, installed in the root for the tests only).
DEVICE_TESTS = ("tests/ioft_protocol", "tests/edge", "tests/sensors", "tests/trainer_lite")
#: Loaded with ``-p`` before the suite's conftest: the CI profile (derandomized) without
#: hypothesis' 200 ms deadline and too-slow check, which measure qemu, not the code.
EMULATED_PROFILE = """from hypothesis import HealthCheck, settings
settings.register_profile("emulated", derandomize=True, database=None, print_blob=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
"""
#: The real printer runs some sensor tests read (``IOFT_PRINTER_DATA``), when this checkout has them.
PRINTER_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "printers"
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.*\bin [\d.]+s\b.*?)\s*=*$")
HEADER = re.compile(r"^_+ (\S+) _+$")
ERROR_LINE = re.compile(r"^E\s+([\w.]+(?:Error|Expired|Exception|Failed)\b:?.*)$")


@dataclass
class TestRun:
    counts: dict[str, int]
    failed: list[tuple[str, str]]  # (test id, its error line)
    seconds: float
    summary: str
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> tests
    failed_on_host: set[str] | None = None  # of ``failed``, those that fail on the x86_64 host too


def parse_test_log(text: str, seconds: float, stopped_at: float | None = None) -> TestRun:
    """``pytest -q -rfEs`` output as a :class:`TestRun`; ``stopped_at``: the limit it was stopped at."""
    lines = text.splitlines()
    summary = next((m[1] for ln in reversed(lines) if (m := SUMMARY.match(ln))), "")
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed)", summary)
    }
    failed = [
        (tid, _error_line(lines, tid, msg))
        for tid, msg in re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", text, re.M)
    ]
    skipped: Counter[str] = Counter()
    for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", text, re.M):
        skipped[reason[:160]] += int(n)
    if stopped_at is not None:
        summary = (
            summary or "no summary"
        ) + f" (stopped at the {stopped_at:.0f} s limit: the rest did not run)"
    elif not summary:
        summary = "no summary line: pytest did not finish normally"
    return TestRun(counts, failed, seconds, summary, dict(skipped))  # fmt: skip


def _error_line(lines: list[str], test_id: str, fallback: str) -> str:
    """The first ``E   SomeError: ...`` line of the test's section (a nested traceback's cause
    before the assertion that wrapped it), else pytest's one-line message."""
    name = test_id.split("::")[-1]
    inside = False
    for ln in lines:
        if (head := HEADER.match(ln)) is not None or ln.startswith("===="):
            inside = head is not None and head[1] == name
            continue
        if inside and (m := ERROR_LINE.match(ln)) and not m[1].startswith("AssertionError: Traceback"):
            return _short(m[1])
    return _short(fallback or "")


def _short(line: str, keep: int = 90) -> str:
    return line if len(line) <= 2 * keep else f"{line[:keep]} … {line[-keep:]}"


def run_tests(root: Path, src: Path, timeout: float, log: Path) -> TestRun:
    """The device-side tests inside the root, against the installed wheel (not a source tree)."""
    where = root / "opt" / "ioft-tests"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    shutil.copytree(src / "tests", where / "tests")
    # What the tests read outside the wheel: their helpers (``checks.fuzz_decoders``' mutator,
    # ``benchmarks``' pure-NumPy figures; on their PYTHONPATH) and the docs some hold to the code.
    for helper in ("checks", "benchmarks", "docs"):
        shutil.copytree(src / helper, where / helper, ignore=shutil.ignore_patterns("results"))
    shutil.copy2(src / "README.md", where / "README.md")
    shutil.copy2(src / "pyproject.toml", where / "pyproject.toml")  # pytest's markers and timeout
    (where / "pi_check_profile.py").write_text(EMULATED_PROFILE)
    env = {**ROOT_ENV, "CI": "1", "HYPOTHESIS_PROFILE": "emulated", "PYTHONPATH": "/opt/ioft-tests"}
    if PRINTER_DATA.is_dir():
        shutil.copytree(PRINTER_DATA, where / "data" / "printers")
        env["IOFT_PRINTER_DATA"] = "/opt/ioft-tests/data/printers"
    cmd = ["sh", "-c", f"cd /opt/ioft-tests && exec {VENV}/bin/python -m pytest -q -p pi_check_profile "
           f"-p no:cacheprovider -m 'not torch' -rfEs {' '.join(DEVICE_TESTS)}"]  # fmt: skip
    out_log = log.with_name("pi-tests.log")
    out_log.unlink(missing_ok=True)
    tests = Watched(in_root(root, cmd), out_log, env)
    usage = tests.wait(timeout)
    stopped = usage is None
    if usage is None:  # SIGINT: pytest stops where it is and still prints its summary
        usage = tests.stop(grace_s=60, sig=signal.SIGINT)
    return parse_test_log(out_log.read_text(errors="replace"), usage.wall_s, timeout if stopped else None)


def verdict(run: TestRun) -> str | None:
    """Why the device-side tests did not pass (``None``: they did).  A failure in the root that passes
    on the host and is a timeout is qemu's speed, not the code's (listed in the report, not fatal);
    any other failure, an error (collection included) or a run that did not finish fails the check."""
    if run.failed_on_host is None and run.failed:
        return f"{len(run.failed)} device-side tests failed in the root and were not rerun on the host"
    if "did not finish" in run.summary or "stopped at" in run.summary:
        return f"the device-side tests did not finish: {run.summary}"
    real = [tid for tid, why in run.failed if tid in (run.failed_on_host or set()) or "Timeout" not in why]
    if real:
        return (
            f"{len(real)} device-side tests failed in the root, not by a qemu timeout that passes on the "
            f"host: {', '.join(real[:3])}{' …' if len(real) > 3 else ''}"
        )
    if run.counts.get("error", 0) + run.counts.get("errors", 0):
        return f"the device-side tests had errors: {run.summary}"
    return None


def rerun_on_host(src: Path, run: TestRun, log: Path) -> TestRun:
    """The failed tests again on the host, from the same source and with the project's venv, so a
    failure reads as arm64's (or the device extra's) or the commit's own."""
    ids = [tid for tid, _ in run.failed]
    if not ids:
        return run
    env = {**host_env(), "CI": "1", "HYPOTHESIS_PROFILE": "ci", "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not torch", "-rfE", *ids],
        cwd=src, env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    with log.open("a") as f:
        f.write(f"\n$ pytest (host) {' '.join(ids)}\n{out.stdout}{out.stderr}")
    run.failed_on_host = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)) & set(ids)
    return run
