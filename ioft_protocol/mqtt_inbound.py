"""The session's inbound messages: what the network thread hands the owner, and the queue between them."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    retain: bool


class Inbound:
    """The session's inbound messages: a bounded FIFO that the network thread appends to and the
    owner pops from, with the interface of the ``queue.Queue`` it replaces (``put_nowait``, ``get``,
    ``get_nowait``, ``empty``, ``full``, ``qsize``, ``maxsize``; ``queue``: the deque itself).

    A ``queue.Queue`` takes a lock and notifies a condition on every put and every get: a
    message costs two lock round trips and, with the owner waiting, a wake-up each.  Here a put is a
    deque append, a get a pop (both atomic in CPython), and the network thread rings the owner's bell
    only when the owner went to sleep on an empty queue: an owner busy with a batch takes whatever
    arrived meanwhile with no wake-up at all, one wake-up per batch.  One owner reads it at a time
    (``MqttFleet``'s pump; every other session has one reader).

    Since the owner reads the socket itself (``ioft_protocol.mqtt_loop``), the put and the take
    mostly happen on one thread and the bell is rung only when the background thread read for a
    sleeping owner.  Measured per message, put then taken on one thread (``benchmarks.ingest_cpu``'s
    second table): about ``queue.SimpleQueue``'s cost, far below ``queue.Queue``'s; it stays for
    the bound (``inbound_limit``) and the deque that ``edge.swarm`` drains directly.
    """

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self.queue: deque[Message] = deque()
        # The owner sleeps on a plain lock that the network thread releases (C-level, no Condition),
        # and only when the owner said it sleeps: a busy owner costs the network thread an append.
        self._bell = threading.Lock()
        self._bell.acquire()
        self._sleeping = False
        #: Times an owner found it empty and slept until a message came (one per batch, not per message).
        self.wakeups = 0

    def qsize(self) -> int:
        return len(self.queue)

    def empty(self) -> bool:
        return not self.queue

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.queue)

    def put_nowait(self, msg: Message) -> None:
        if 0 < self.maxsize <= len(self.queue):
            raise queue.Full
        self.queue.append(msg)
        # After the append: an owner that said it sleeps after this look finds the message itself.
        if self._sleeping:
            self._sleeping = False
            with contextlib.suppress(RuntimeError):  # rung already: a spurious wake-up, looked past
                self._bell.release()

    def get_nowait(self) -> Message:
        try:
            return self.queue.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, block: bool = True, timeout: float | None = None) -> Message:
        """The oldest message, waiting up to ``timeout`` seconds (``None``: forever) for one."""
        items = self.queue
        if items or not block:
            return self.get_nowait()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._sleeping = True
            if items:  # came between the look above and saying so
                self._sleeping = False
                return items.popleft()
            left = -1 if deadline is None else deadline - time.monotonic()
            if deadline is not None and left <= 0:
                self._sleeping = False
                raise queue.Empty
            self._bell.acquire(timeout=left)
            self._sleeping = False
            if items:
                self.wakeups += 1
                return items.popleft()
