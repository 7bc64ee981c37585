"""Group commit: a swarm's task-state files made durable together, once per turn of its loop.

A single daemon writes each task state as :func:`ioft_protocol.state.atomic_write_bytes` does
(temp file, fsync, rename, folder fsync) before it publishes the upload.  A swarm's devices live
in one process and die together, so the devices that answer a round in the same turn of the
swarm's loop share the syncs instead: each writes its temp file (no fsync), and before the loop
next writes to a socket, :meth:`GroupCommit.commit` makes every temp file durable with one
``syncfs`` per file system, renames each over its target (the old one to ``.prev``, as
``save_arrays`` does), and makes the renames durable with one more ``syncfs``.

The guarantees per device stay the single daemon's: after a crash each state file is its old or
its new complete version (the renames happen only once the new bytes are durable), and an upload
that refers to a new state leaves only after that state is durable (the swarm commits before
every poll of its loop, the only place it writes to sockets; paho only queues a publish).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from pathlib import Path

from ioft_protocol.state import put_in_place, write_temp

#: Writes a task state's bytes to its file (``edge.task_state.TaskStates.write``).
Write = Callable[[str | Path, bytes], None]


def _load_syncfs() -> Callable[[int], None]:
    """``syncfs(fd)``: flush the file system holding ``fd`` (Linux; elsewhere ``os.sync()``, all of them).
    Python 3.11's ``os`` has no ``syncfs``: libc's, through ctypes."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        call = libc.syncfs
    except (OSError, AttributeError):
        return lambda fd: os.sync()

    def syncfs(fd: int) -> None:
        if call(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    return syncfs


syncfs = _load_syncfs()


class GroupCommit:
    """The task-state writes of many devices, staged and then committed together (module docstring).

    :meth:`writer` gives each device's :class:`edge.task_state.TaskStates` its ``write``; the owner
    calls :meth:`commit` before anything the devices queued may reach the network.  The folders'
    descriptors (one per file system) stay open for the owner's life.
    """

    def __init__(self) -> None:
        self._pending: dict[str, str] = {}  # target -> its durable-to-be temp file
        self._fds: dict[int, int] = {}  # file system (st_dev) -> a folder's fd on it, for syncfs
        self._failed: BaseException | None = None

    def writer(self, state_dir: Path) -> Write:
        """The ``write`` for the device whose state lives under ``state_dir`` (its file system noted)."""
        dev = os.stat(state_dir).st_dev
        if dev not in self._fds:
            self._fds[dev] = os.open(state_dir, os.O_RDONLY | os.O_CLOEXEC)
        return self.write

    @property
    def pending(self) -> int:
        """Files written but not yet committed."""
        return len(self._pending)

    def write(self, path: str | Path, data: bytes) -> None:
        """Stage ``data`` for ``path``: in its temp file now, in place at the next :meth:`commit`."""
        target = os.fspath(path)
        if target in self._pending:  # written again in the same turn: its temp file is in the batch
            self.commit()
        self._pending[target] = write_temp(target, data, sync=False)[1]

    def commit(self) -> None:
        """Make every staged file durable and put it in place; a no-op when none is staged.

        After a failure every later call raises too: the uploads queued with the batch must not go
        out (the swarm's shutdown commits before it writes to its sockets).
        """
        if self._failed is not None:
            raise OSError("an earlier group commit of the task states failed") from self._failed
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            for fd in self._fds.values():
                syncfs(fd)  # every temp file's bytes
            for target, tmp in pending.items():
                put_in_place(tmp, target, keep_previous=True)
            for fd in self._fds.values():
                syncfs(fd)  # the renames
        except BaseException as exc:
            self._failed = exc
            raise
