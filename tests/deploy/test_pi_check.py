"""The Pi check's own plumbing, on the host (the check itself needs root, qemu and an hour):
its refusal without root, the per-round CPU arithmetic, a watched process's wait4 figures,
and the report over made-up figures."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from deploy import pi_check, pi_report, pi_root, pi_tests
from deploy.pi_fleet import MARK, FleetRun, figures
from deploy.pi_measure import Mark, Usage, Watched, host_env


def test_without_root_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(pi_check.os, "geteuid", lambda: 1000)
    assert pi_check.main(["--skip-tests"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "root" in err


class FakeDevice:
    """What :func:`figures` reads of a :class:`Watched` device."""

    def __init__(self, marks: list[Mark]) -> None:
        self.marks, self.started, self.argv, self.log = marks, 100.0, ["edge-trainer"], Path("x.log")


def line(rnd: int, phase: str, secs: float) -> str:
    return f"2026-11-25 13:48:10,684 pi1 INFO edge.daemon: pi1: task speed round {rnd} {phase}: test_loss 1.0 ({secs:.2f} s)"


def test_cpu_per_round_is_the_difference_between_the_ends_of_successive_rounds():
    marks = [
        Mark("2026-11-25 pi1 INFO edge.daemon: pi1 running (state /x, 40 train / 10 test rows)", 112.0, 5.0),
        Mark(line(1, "train", 0.25), 120.0, 6.0),
        Mark(line(2, "train", 0.5), 121.0, 6.5),
        Mark(line(2, "finetune", 0.25), 121.5, 7.0),  # a second phase of round 2
        Mark(line(3, "train", 0.5), 122.0, 7.25),
    ]
    assert all(MARK.search(m.line) for m in marks)
    fig = figures(FakeDevice(marks), Usage(0, 8.0, 90.0, 30.0))
    assert fig.cpu_per_round_s == [1.0, 1.0, 0.25]
    assert fig.train_s == [0.25, 0.75, 0.5]
    assert (fig.start_cpu_s, fig.start_wall_s) == (5.0, 12.0)
    assert fig.steady_cpu_s == 0.625  # rounds 2..R


def test_a_watched_process_reports_its_marks_and_wait4_usage(tmp_path):
    code = "import sys; sys.stdout.write('a: task t round 1 train: (0.01 s)\\nother\\n')"
    proc = Watched([sys.executable, "-c", code], tmp_path / "out.log", host_env(), MARK)
    usage = proc.wait(60)
    assert usage is not None and usage.returncode == 0
    assert usage.cpu_s > 0 and usage.peak_rss_mib > 1
    assert [m.line for m in proc.marks] == ["a: task t round 1 train: (0.01 s)"]
    assert "other" in proc.tail()


def test_the_report_lists_every_installed_package(monkeypatch, tmp_path):
    # Rendering formats the figures it is given: no program runs (make test installs no qemu).
    monkeypatch.setenv("PATH", str(tmp_path))
    usage = Usage(0, 1.0, 50.0, 2.0)
    fig = figures(
        FakeDevice([Mark("x running (state /s", 101.0, 0.5), Mark(line(1, "train", 0.1), 102, 0.75)]), usage
    )
    freeze = ["numpy==2.4.6", "ioft @ file:///opt/ioft-dist/ioft-0.1.0-py3-none-any.whl", "paho-mqtt==2.2.0"]
    text = pi_report.render(
        commit="abc1234", binfmt="/usr/libexec/qemu-binfmt/aarch64-binfmt-P (flags PF)",
        emulator="qemu-aarch64 version 7.2.0", root_state="reused",
        python="Python 3.11.2", install=pi_root.Install(100.0, 180 * 2**20, freeze, ["pytest==9.2.0"]),
        imports={k: {"numpy": 0.2, "total": 0.9} for k in ("arm64", "host")},
        recorder={k: (usage, {"appended": 10, "rows": {"train": 7, "test": 3}}) for k in ("arm64", "host")},
        fleet=FleetRun(1, 1, [["host1", "pi1"]], [0.2], fig, fig),
        tests=pi_tests.TestRun({"passed": 3}, [], 60.0, "3 passed in 60.00s"), layers=10, test_cmd="pytest",
    )  # fmt: skip
    for name in ("numpy", "ioft", "paho-mqtt"):
        assert re.search(rf"^\| {re.escape(name)} +\|", text, re.MULTILINE), name


PYTEST_OUTPUT = """\
..F.s                                                                    [100%]
=================================== FAILURES ===================================
_ test_over_mqtt_matches _
E       AssertionError: Traceback (most recent call last):
E         ModuleNotFoundError: No module named 'uvicorn'
=========================== short test summary info ============================
SKIPPED [2] tests/sensors/test_printer_sim.py:40: real printer data not at /x
FAILED tests/t/test_a.py::test_over_mqtt_matches - AssertionError: Traceback (most recent call last):
1 failed, 3 passed, 2 skipped, 7 deselected in 794.14s (0:13:14)
"""


def test_the_pytest_summary_failures_with_their_cause_and_skips_by_reason():
    run = pi_tests.parse_test_log(PYTEST_OUTPUT, 800.0)
    assert run.counts == {"failed": 1, "passed": 3, "skipped": 2, "deselected": 7}
    assert run.failed == [
        ("tests/t/test_a.py::test_over_mqtt_matches", "ModuleNotFoundError: No module named 'uvicorn'")
    ]
    assert run.skipped == {"real printer data not at /x": 2}
    stopped = pi_tests.parse_test_log(PYTEST_OUTPUT, 800.0, stopped_at=600)
    assert stopped.summary.startswith(run.summary) and stopped.summary != run.summary


COLLECTION_ERRORS = """\
______________ ERROR collecting tests/edge/test_b.py ______________
E   ModuleNotFoundError: No module named 'benchmarks'
=========================== short test summary info ============================
ERROR tests/edge/test_b.py
!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
5 skipped, 7 deselected, 1 error in 26.33s
"""

TIMEOUT = "subprocess.TimeoutExpired: Command '['python']' timed out after 10 seconds"


def _run(
    failed: list[tuple[str, str]], on_host: set[str] | None, summary: str = "1 failed, 9 passed in 9.00s"
):
    return pi_tests.TestRun(
        {"failed": len(failed), "passed": 9}, failed, 9.0, summary, failed_on_host=on_host
    )


def test_pi_check_fails_on_a_collection_error_a_real_failure_or_an_unfinished_run():
    """The check's exit: before, a run interrupted by two collection errors wrote its report and
    exited 0; only a qemu timeout that passes on the host is left to the report."""
    errors = pi_tests.parse_test_log(COLLECTION_ERRORS, 30.0)
    errors.failed_on_host = set()  # the host has the module: it passes there
    assert "tests/edge/test_b.py" in (pi_tests.verdict(errors) or "")
    assert pi_tests.verdict(_run([("t.py::a", TIMEOUT)], on_host=set())) is None
    assert pi_tests.verdict(_run([("t.py::a", TIMEOUT)], on_host={"t.py::a"})) is not None
    assert pi_tests.verdict(_run([("t.py::a", "AssertionError: 1 != 2")], on_host=set())) is not None
    assert pi_tests.verdict(_run([("t.py::a", TIMEOUT)], on_host=None)) is not None
    stopped = pi_tests.parse_test_log("..\n9 passed in 600.00s\n", 600.0, stopped_at=600)
    stopped.failed_on_host = set()
    assert "did not finish" in (pi_tests.verdict(stopped) or "")
    assert pi_tests.verdict(_run([], on_host=None, summary="9 passed in 9.00s")) is None
