"""A stand-in for systemd's end of ``$NOTIFY_SOCKET``: a unix datagram socket a test binds and reads."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import threading
import time


class NotifyListener:
    """Binds ``@ioft-test-<random>`` (Linux's abstract namespace: no path length limit, nothing to
    clean up) and, like systemd, reads it at once (a thread), keeping every datagram in order as
    a list of ``KEY=value`` lines."""

    def __init__(self) -> None:
        self.address = f"@ioft-test-{secrets.token_hex(6)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.settimeout(0.1)
        self.messages: list[list[str]] = []
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-listener", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue
            except OSError:
                return

    def env(self, watchdog_s: float) -> dict[str, str]:
        """What systemd puts in a ``Type=notify`` service's environment with ``WatchdogSec=``."""
        return {**os.environ, "NOTIFY_SOCKET": self.address, "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}

    def drain(self, timeout: float) -> None:
        """Let ``timeout`` seconds of messages arrive."""
        time.sleep(timeout)

    def wait_for(self, line: str, timeout: float, *, after: int = 0) -> int:
        """Index of the first message from ``after`` on holding ``line`` (waiting up to ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(after, len(self.messages)):
                if line in self.messages[i]:
                    return i
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {line!r} within {timeout} s; got {self.messages[after:]}")
            time.sleep(0.05)

    def count(self, line: str, start: int = 0, stop: int | None = None) -> int:
        return sum(line in m for m in self.messages[start:stop])

    def pings_then_stops(self, proc: subprocess.Popen, ready: int, pinged_before: int = 0) -> None:
        """The service goes on pinging: at least 3 more times since its READY message (waited for,
        not counted over a fixed 1.5 s a starved box may not give it); on SIGTERM it exits 0 and
        says STOPPING."""
        deadline = time.monotonic() + 60  # a bound on a hang, not a measured time
        while self.count("WATCHDOG=1", ready) < pinged_before + 3:
            assert proc.poll() is None, f"the service exited {proc.returncode} instead of pinging"
            assert time.monotonic() < deadline, f"fewer than 3 more pings; got {self.messages[ready:]}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        self.wait_for("STOPPING=1", 5, after=ready)

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()
