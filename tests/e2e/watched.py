"""A child process whose output lines are collected as they come, for tests that wait on a log line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class Watched:
    """``python -m <module> <args>`` with stdout and stderr merged and read on a thread."""

    def __init__(self, module: str, args: Sequence[str], cwd: Path | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def matching(self, *needles: str) -> list[str]:
        """The lines holding every one of ``needles``."""
        return [ln for ln in list(self.lines) if all(n in ln for n in needles)]

    def wait_until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait for ``cond`` (a generous ``timeout`` only guards against hanging the suite)."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"never saw {what}; output:\n{self.text[-4000:]}")
            time.sleep(0.1)

    def wait_exit(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
