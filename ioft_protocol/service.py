"""systemd's notify protocol (``Type=notify`` + ``WatchdogSec=``), for the daemons' main loops.

A unit started with ``Type=notify`` is *activating* until the process sends ``READY=1``
on the datagram socket in ``$NOTIFY_SOCKET``; with ``WatchdogSec=`` systemd sets
``$WATCHDOG_USEC`` and restarts the service (``Restart=on-failure``) when no
``WATCHDOG=1`` arrives within it.  So the pings must come from the loop that does the
work, never from a timer thread: a hung loop then stops pinging and is restarted.

Before ``READY=1`` the same call sends ``EXTEND_TIMEOUT_USEC=`` instead, so a daemon
that waits for its broker as long as it takes (by design) is not killed by
``TimeoutStartSec=`` while its loop is alive, and is when the loop hangs.

Without ``$NOTIFY_SOCKET`` (not under systemd, or a unit of another type) every call
is a no-op.  The protocol is a few datagrams (``sd_notify(3)``), so no library.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)
#: Longest a READY, STATUS or STOPPING waits on a full notify socket (systemd busy) before it is dropped.
SEND_TIMEOUT_S = 1.0


class Notifier:
    """Sends ``READY=1``, ``WATCHDOG=1``, ``STATUS=…`` and ``STOPPING=1`` to systemd, if it listens.

    Parameters
    ----------
    address
        ``$NOTIFY_SOCKET``: a path, or ``@name`` for Linux's abstract namespace; ``None``: no-op.
    watchdog_s
        ``$WATCHDOG_USEC`` in seconds; ``None``: no watchdog, :meth:`alive` sends nothing.
    """

    def __init__(self, address: str | None = None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self.ready_sent = False
        self._sock: socket.socket | None = None
        self._ping_sock: socket.socket | None = None  # non-blocking: a ping never waits
        self._next_ping = -1.0
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(SEND_TIMEOUT_S)
            self._ping_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._ping_sock.setblocking(False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """The notifier systemd's environment asks for (``WATCHDOG_PID``, when set, must be ours)."""
        env = os.environ if env is None else env
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and ours else None
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_s)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str, wait: bool = True) -> bool:
        """Send ``fields`` (``KEY=value`` each) in one datagram; ``False`` if it was not sent.

        A full socket (systemd busy) makes the send wait up to ``SEND_TIMEOUT_S``, or, without
        ``wait`` (the pings), not at all: the loop's next ping goes instead.
        """
        sock = self._sock if wait else self._ping_sock
        if sock is None or self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            sock.sendto("\n".join(fields).encode(), target)
        except OSError as exc:  # systemd gone or the socket full: never a reason to stop working
            log.debug("sd_notify %s: %s", fields, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> None:
        """``READY=1`` (once): the service is up; from now on the watchdog counts."""
        if not self.ready_sent:
            self.ready_sent = True
            self.notify("READY=1", *([f"STATUS={status}"] if status else []))
            self._next_ping = time.monotonic() + self._interval()

    def status(self, text: str) -> None:
        """A one-line ``STATUS=`` that ``systemctl status`` shows."""
        self.notify(f"STATUS={text.splitlines()[0] if text else ''}")

    def alive(self) -> None:
        """Called from each turn of the main loop: a ping at most every third of the watchdog.

        Before :meth:`ready`: ``EXTEND_TIMEOUT_USEC`` (twice the watchdog), so waiting for a
        broker is not a start timeout while the loop turns.
        """
        if self.watchdog_s is None or self._sock is None:
            return
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + self._interval()
        if self.ready_sent:
            self.notify("WATCHDOG=1", wait=False)
        else:
            self.notify(f"EXTEND_TIMEOUT_USEC={int(2 * self.watchdog_s * 1e6)}", wait=False)

    def stopping(self, status: str | None = None) -> None:
        """``STOPPING=1``: shutting down on purpose (systemd then waits, and does not count a hang)."""
        self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        for sock in (self._sock, self._ping_sock):
            if sock is not None:
                sock.close()
        self._sock = self._ping_sock = None

    @property
    def ping_every_s(self) -> float | None:
        """How often :meth:`alive` sends (a third of the watchdog); ``None`` without a watchdog."""
        return None if self.watchdog_s is None or self._sock is None else self._interval()

    def _interval(self) -> float:
        return (self.watchdog_s or 0.0) / 3
