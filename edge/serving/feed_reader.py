"""Reading the row feed: from where the last run stopped, woken by the recorder's datagrams.

edge-recorder appends rows to the feed (:mod:`edge.feed`) and sends a datagram to the wake-up
socket; :class:`FeedReader` waits on that socket (or polls, where it cannot be bound), reads
every line appended since, and keeps its position on disk so that a restarted trainer answers
from where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from edge.feed import SERVING_DIR, feed_path, wake_path
from edge.jsonlog import Tail
from ioft_protocol.state import atomic_write_json

log = logging.getLogger(__name__)

POSITION_FILE = "feed.pos"
#: Without a wake-up the feed is still read this often (a recorder whose datagram was lost).
POLL_S = 0.5
#: The feed position is saved when no row came for ``POLL_S`` (never between a row and the next),
#: and at least this often under an unbroken stream: a killed trainer answers again at most the
#: rows of the last ``SAVE_MAX_S`` seconds, and loses none.
SAVE_MAX_S = 5.0


class FeedReader:
    """The row feed of the device whose state folder is ``state_dir`` (see the module docstring)."""

    def __init__(self, state_dir: Path, device: str) -> None:
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / SERVING_DIR
        self.device = device
        self._sock: socket.socket | None = None
        self._tail: Tail | None = None
        self._saved_pos: tuple[int, int] | None = None

    def open(self) -> None:
        """Start reading where the last run stopped, and listen for the recorder's wake-ups."""
        self._tail = Tail(feed_path(self.state_dir), self._start_position())
        self._sock = self._bind()

    def read(self) -> Iterable[Any]:
        """Every record appended since the last read (none before :meth:`open`)."""
        return self._tail.read() if self._tail is not None else ()

    @property
    def skipped(self) -> int:
        """Lines of the feed that were not JSON records."""
        return self._tail.skipped if self._tail is not None else 0

    def _start_position(self) -> tuple[int, int] | None:
        """Where the last run stopped reading the feed; without one, its end (only new rows are answered)."""
        try:
            pos = json.loads((self.dir / POSITION_FILE).read_text())
            return int(pos[0]), int(pos[1])
        except (OSError, ValueError, TypeError, IndexError, KeyError):
            pass
        with contextlib.suppress(OSError):
            st = feed_path(self.state_dir).stat()
            return st.st_ino, st.st_size
        return None

    def _bind(self) -> socket.socket | None:
        path = wake_path(self.state_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            path.unlink(missing_ok=True)
            sock.bind(str(path))
        except OSError as exc:  # a path over 107 bytes, a read-only folder: poll instead
            sock.close()
            log.warning(
                "%s: no wake-up socket at %s (%s); reading the row feed every %.1f s",
                self.device,
                path,
                exc,
                POLL_S,
            )
            return None
        sock.settimeout(POLL_S)
        return sock

    def wait(self, stop: threading.Event) -> bool:
        """Until the recorder wakes us or ``POLL_S`` passes; whether it woke us."""
        if self._sock is None:
            stop.wait(POLL_S)
            return False
        with contextlib.suppress(TimeoutError, OSError):
            self._sock.recv(64)
            self._sock.setblocking(False)
            try:
                while True:  # several rows fed since: one read takes them all
                    self._sock.recv(64)
            except (BlockingIOError, OSError):
                pass
            finally:
                self._sock.settimeout(POLL_S)
            return True
        return False

    def wake(self) -> None:
        """Wake :meth:`wait` now (the serving thread is stopping).  Never blocks: a queue the
        recorder's datagrams filled wakes it anyway, and a blocking send would wait forever on a
        reader that has already stopped."""
        if self._sock is not None:
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"\x00", socket.MSG_DONTWAIT, str(wake_path(self.state_dir)))

    def save(self) -> None:
        """Keep the position read so far on disk (once per change)."""
        pos = self._tail.position if self._tail is not None else None
        if pos is None or pos == self._saved_pos:
            return
        try:
            atomic_write_json(self.dir / POSITION_FILE, list(pos))
            self._saved_pos = pos
        except OSError as exc:
            log.warning("%s: could not save the feed position: %s", self.device, exc)

    def close(self) -> None:
        """Save the position, remove the wake-up socket and close the feed."""
        self.save()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                wake_path(self.state_dir).unlink()
        if self._tail is not None:
            self._tail.close()
