"""Fault state, retry and exponential backoff around any accelerometer source.

The daemon must keep running when a sensor misbehaves, and no garbage sample may
reach a data set.  :class:`Supervisor` turns every ``OSError`` and
:class:`~sensors.accel.base.SensorFault` from the wrapped source into a reported
fault: the failing batch is discarded whole (its samples counted in ``dropped``),
the source is closed, and after a backoff that doubles with each failed attempt the
source is started again (re-probe, re-configure).

``dropped`` counts every sample period at the source's rate, from the first start
on, that did not deliver a sample, so delivered + dropped covers the whole timeline
once the source is closed: the failing batch, what the driver held back or left in
the chip's FIFO when it was closed (the I2C drivers' ``close()`` returns that count;
re-configuration clears the FIFO), and the downtime until the restart, estimated
from the clock -- whether the chip went on sampling into an overflowing FIFO
because the bus was still failing, or sat in standby.  A recorder thus sees the gap.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from sensors.accel.base import AccelBatch, SensorFault

log = logging.getLogger(__name__)


class Supervisor:
    """An :class:`~sensors.accel.base.AccelSource` that never raises from ``read()``."""

    def __init__(
        self,
        source,
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff_s: float = 0.5,
        max_backoff_s: float = 60.0,
    ) -> None:
        self.source, self.clock = source, clock
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.state = "stopped"
        self.reason = ""
        self.retries = 0  # restart attempts in all
        self.failures = 0  # consecutive failed attempts: the backoff exponent
        self.faults: dict[str, int] = {}
        self.dropped = 0
        self.discarded_batches = 0
        self.next_retry = 0.0
        self._down_since: float | None = None

    @property
    def rate_hz(self) -> float:
        return float(self.source.rate_hz)

    def _fault(self, exc: BaseException) -> int:
        kind = getattr(exc, "kind", None) or ("bus_error" if isinstance(exc, OSError) else "fault")
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.state, self.reason = "fault", f"{kind}: {exc}"
        lost = int(getattr(exc, "lost", 0))
        if lost:
            self.discarded_batches += 1
        lost += self._close_source()
        self.dropped += lost
        self.failures += 1
        now = self.clock()
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1))
        self.next_retry = now + delay
        if self._down_since is None:
            self._down_since = now
        log.warning("accelerometer fault (%s); retry in %.2f s", self.reason, delay)
        return lost

    def _close_source(self) -> int:
        """Close the source; the samples that discards (an int from the I2C drivers)."""
        with contextlib.suppress(OSError, SensorFault):
            return int(self.source.close() or 0)
        return 0

    def _try_start(self) -> bool:
        try:
            self.source.start()
        except (OSError, SensorFault) as exc:
            self._fault(exc)
            return False
        self.state, self.reason = "ok", ""
        return True

    def start(self) -> None:
        self._try_start()

    def read(self) -> AccelBatch:
        missed = 0
        if self.state == "fault":
            if self.clock() < self.next_retry:
                return AccelBatch.empty()
            self.retries += 1
            if not self._try_start():
                return AccelBatch.empty()
            if self._down_since is not None:
                missed = round((self.clock() - self._down_since) * self.rate_hz)
                self.dropped += missed
                self._down_since = None
        elif self.state == "stopped":
            return AccelBatch.empty()
        try:
            batch = self.source.read()
        except (OSError, SensorFault) as exc:
            return AccelBatch.empty(self._fault(exc) + missed)
        if len(batch):
            self.failures = 0  # data flows again: the next fault backs off from the start
        self.dropped += batch.dropped
        return AccelBatch(batch.t, batch.xyz, batch.dropped + missed)

    def close(self) -> int:
        """Close the source; returns the samples that discards, counted in ``dropped``
        (closing while down counts the downtime so far as well)."""
        lost = int(self.source.close() or 0)
        if self._down_since is not None:
            lost += round((self.clock() - self._down_since) * self.rate_hz)
            self._down_since = None
        self.dropped += lost
        self.state = "stopped"
        return lost

    def status(self) -> dict:
        inner = {}
        with contextlib.suppress(OSError, SensorFault):
            inner = self.source.status()
        return {
            **inner,
            "state": self.state,
            "reason": self.reason,
            "retries": self.retries,
            "dropped": self.dropped,
            "discarded_batches": self.discarded_batches,
            "faults": dict(self.faults),
            "next_retry_in": max(0.0, self.next_retry - self.clock()) if self.state == "fault" else 0.0,
        }
