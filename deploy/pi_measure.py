"""A process watched from the host: its output to a log, its CPU time read at the log lines that mark
rounds, and its peak RSS and total CPU from ``wait4`` when it ends.

Under qemu-user the watched process is the emulator running the arm64 program, so its figures
include the emulator's own work and memory (translated code): they are emulated figures.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

TICK = os.sysconf("SC_CLK_TCK")


def host_env() -> dict[str, str]:
    """The host's environment for a measured process: unbuffered output, and bytecode caches
    allowed (this host may set PYTHONDONTWRITEBYTECODE; the root's pip wrote its caches)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONUNBUFFERED": "1"}


@dataclass
class Usage:
    """What ``wait4`` says of a process that ended."""

    returncode: int
    cpu_s: float
    peak_rss_mib: float
    wall_s: float


@dataclass
class Mark:
    """A log line that matched, with the process's CPU seconds when it was read."""

    line: str
    at: float
    cpu_s: float


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads) from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Watched:
    """``argv`` started with its output piped to ``log``; lines matching ``mark`` are timed."""

    argv: list[str]
    log: Path
    env: dict[str, str]
    mark: re.Pattern[str] | None = None
    cwd: Path | None = None
    marks: list[Mark] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        self.usage: Usage | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self.log.open("ab") as out:
            for raw in self.proc.stdout or ():
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip()
                if self.mark is not None and self.mark.search(line):
                    with contextlib.suppress(OSError, IndexError):  # it ended between the line and the read
                        self.marks.append(Mark(line, time.monotonic(), cpu_seconds(self.proc.pid)))

    def alive(self) -> bool:
        return self.usage is None and self._reap(block=False) is None

    def wait(self, timeout: float) -> Usage | None:
        """Its usage once it ends within ``timeout``, else None (still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (usage := self._reap(block=False)) is not None:
                return usage
            time.sleep(0.2)
        return None

    def stop(self, grace_s: float = 20, sig: int = signal.SIGTERM) -> Usage:
        """``sig``, then SIGKILL after ``grace_s``; its usage."""
        usage = self._reap(block=False)
        if usage is None:
            self.proc.send_signal(sig)
            usage = self.wait(grace_s)
        if usage is None:
            self.proc.kill()
            usage = self._reap(block=True)
        return usage

    @overload
    def _reap(self, *, block: Literal[True]) -> Usage: ...
    @overload
    def _reap(self, *, block: bool) -> Usage | None: ...
    def _reap(self, *, block: bool) -> Usage | None:
        if self.usage is not None:
            return self.usage
        pid, status, ru = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return None
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait on it again
        self._reader.join(5)
        self.usage = Usage(
            self.proc.returncode,
            ru.ru_utime + ru.ru_stime,
            ru.ru_maxrss / 1024,
            time.monotonic() - self.started,
        )
        return self.usage

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


#: Run by the measured interpreter: import time of what the device's two daemons import,
#: the big dependencies first, each counted once (a module imported already costs nothing).
IMPORT_PROBE = r"""
import json, sys, time
t = [time.perf_counter()]
import numpy; t.append(time.perf_counter())
import onnxruntime; t.append(time.perf_counter())
import pywt; t.append(time.perf_counter())
import edge.cli, edge.recording.cli, edge.models.onnx; t.append(time.perf_counter())
print(json.dumps({"numpy": t[1] - t[0], "onnxruntime": t[2] - t[1], "pywt": t[3] - t[2],
  "edge (rest)": t[4] - t[3], "total": t[4] - t[0],
  "torch_imported": any(m == "torch" or m.startswith("torch.") for m in sys.modules)}))
"""
