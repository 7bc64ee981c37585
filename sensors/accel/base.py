"""The contract every accelerometer source keeps, and the pieces the I2C drivers share.

A source yields :class:`AccelBatch` es: timestamps in seconds, accelerations in m/s²
and how many samples were lost since the previous batch.  The per-layer recorder and
the printer simulator are written against :class:`AccelSource` only, so an I2C chip,
Klipper's stream and a supervised wrapper are interchangeable.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

STANDARD_GRAVITY = 9.80665  # m/s² per g (CGPM 1901); Klipper uses the same constant


@dataclass
class AccelBatch:
    """Samples read in one call: ``t`` (n,) seconds, ``xyz`` (n, 3) m/s², ``dropped`` lost."""

    t: np.ndarray
    xyz: np.ndarray
    dropped: int = 0

    @classmethod
    def empty(cls, dropped: int = 0) -> AccelBatch:
        return cls(np.empty(0, dtype=np.float64), np.empty((0, 3), dtype=np.float64), int(dropped))

    def __len__(self) -> int:
        return len(self.t)


@runtime_checkable
class AccelSource(Protocol):
    """What the recorder needs from an accelerometer."""

    rate_hz: float

    def start(self) -> None: ...

    def read(self) -> AccelBatch:
        """Whatever is available now (possibly empty); never blocks for long."""
        ...

    def close(self) -> int | None:
        """Stop; may return how many samples closing discarded (also counted in ``dropped``)."""
        ...

    def status(self) -> dict:
        """At least ``state`` ("ok"/"fault"), ``reason``, ``retries`` and ``dropped`` (total)."""
        ...


def wait(clock, dt: float) -> None:
    """Let ``dt`` pass: move a virtual clock (one with ``advance``) or sleep on a real one."""
    advance = getattr(clock, "advance", None)
    if advance is not None:
        advance(dt)
    else:
        time.sleep(dt)


def periods_between(t_start: float, rate_hz: float, t0: float, t1: float) -> int:
    """Samples a chip measuring since ``t_start`` at ``rate_hz`` makes in ``(t0, t1]``.

    Sample k is due at ``t_start + k / rate_hz`` (k >= 1), so counts over consecutive
    intervals add up to the count over their union: nothing is counted twice or lost to
    rounding at the boundaries.  A real chip's ODR is only within a few % of nominal, so
    on hardware this is an estimate; it is only ever applied to the time since the last
    read, where that error stays below a sample or two.
    """

    def k(t: float) -> int:
        return math.floor((t - t_start) * rate_hz + 1e-9)

    return max(0, k(t1) - k(t0))


class SensorFault(Exception):  # noqa: N818 -- a fault state, reported, not a program error
    """The sensor gave data that must not reach a data set; ``lost`` samples go with it."""

    kind = "fault"

    def __init__(self, message: str, *, lost: int = 0) -> None:
        super().__init__(message)
        self.lost = int(lost)


class WrongDevice(SensorFault):
    kind = "wrong_device"


class FifoOverrun(SensorFault):
    kind = "fifo_overrun"


class StuckAxis(SensorFault):
    kind = "stuck_axis"


class SaturatedAxis(SensorFault):
    kind = "saturated_axis"


class RegisterMismatch(SensorFault):
    """A register read back differently from what was written: wiring or a bad chip."""

    kind = "register_mismatch"


@dataclass
class RawChecker:
    """Stuck and saturated axes on raw counts, across batches.

    ``stuck_window`` identical consecutive readings on one axis is a stuck axis: a live
    MEMS axis has at least ~1 LSB rms noise (ADXL345 datasheet Table 1 noise; MPU-6050
    400 µg/√Hz), so a long run of one value means a dead channel or a frozen bus.
    A reading on either rail (``lo``/``hi``) is saturation: the true value is unknown.
    """

    lo: int
    hi: int
    stuck_window: int
    _last: np.ndarray = field(default_factory=lambda: np.full(3, np.iinfo(np.int64).min))
    _run: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))

    def reset(self) -> None:
        self._last = np.full(3, np.iinfo(np.int64).min)
        self._run = np.zeros(3, dtype=np.int64)

    def check(self, raw: np.ndarray) -> None:
        """Raise :class:`SaturatedAxis` or :class:`StuckAxis` for ``raw`` (n, 3) ints."""
        n = len(raw)
        if n == 0:
            return
        sat = (raw <= self.lo) | (raw >= self.hi)
        if sat.any():
            axis = "xyz"[int(np.flatnonzero(sat.any(axis=0))[0])]
            raise SaturatedAxis(f"{axis} axis at full scale ({self.lo}..{self.hi} counts)", lost=n)
        for a in range(3):
            col = raw[:, a]
            change = np.flatnonzero(col[1:] != col[:-1])
            runs = np.diff(np.concatenate([[-1], change, [n - 1]]))
            if col[0] == self._last[a]:
                runs[0] += self._run[a]  # the run that ended the previous batch goes on
            longest = int(runs.max())
            if longest >= self.stuck_window:
                raise StuckAxis(f"{'xyz'[a]} axis repeated one value {longest} times", lost=n)
            self._last[a] = col[-1]
            self._run[a] = runs[-1]


class Timestamper:
    """Sample times from the read time and the ODR, monotonic and evenly spaced.

    A FIFO has no timestamps: the newest sample in it was produced within one period
    before the read.  Counting periods from the previous batch keeps the spacing exact;
    when the count drifts from the read time by more than ``tolerance_s`` (the chip's
    ODR is only ±a few % of nominal, or samples were lost) the series is re-anchored on
    the read time, never stepping backwards.
    """

    def __init__(self, rate_hz: float, tolerance_s: float | None = None) -> None:
        self.period = 1.0 / float(rate_hz)
        self.tolerance_s = tolerance_s if tolerance_s is not None else max(0.02, 8 * self.period)
        self.last: float | None = None
        self.resyncs = 0

    def reset(self) -> None:
        self.last = None

    def place(self, n: int, t_read: float, lost: int = 0) -> np.ndarray:
        if n == 0:
            return np.empty(0)
        k = np.arange(n, dtype=np.float64)
        anchored = t_read - (n - 1 - k) * self.period
        if self.last is None:
            t = anchored
        else:
            t = self.last + (1 + lost + k) * self.period
            if abs(t[-1] - t_read) > self.tolerance_s:
                self.resyncs += 1
                t = np.maximum(anchored, self.last + (1 + k) * self.period)
        self.last = float(t[-1])
        return t


class SampleGate:
    """Checks raw counts and holds back the newest ``stuck_window - 1`` samples.

    A stuck axis is only recognisable once its run reaches the window, so the samples
    of a run that is still shorter are held until the run ends (released) or reaches
    the window (discarded with the fault).  No released sample belongs to a stuck run;
    the price is a fixed latency of ``stuck_window - 1`` samples (0.25 s by default).
    """

    def __init__(self, checker: RawChecker) -> None:
        self.checker = checker
        self.hold = max(checker.stuck_window - 1, 0)
        self._t = np.empty(0)
        self._xyz = np.empty((0, 3))

    @property
    def pending(self) -> int:
        return len(self._t)

    def discard(self) -> int:
        """Drop what is held (after a fault); returns how many samples that was."""
        n = len(self._t)
        self._t, self._xyz = np.empty(0), np.empty((0, 3))
        return n

    def reset(self) -> None:
        self.checker.reset()
        self.discard()

    def admit(self, raw: np.ndarray, t: np.ndarray, xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples safe to release now; raises a :class:`SensorFault` carrying all it dropped."""
        try:
            self.checker.check(raw)
        except SensorFault as exc:
            exc.lost += self.discard()
            raise
        t = np.concatenate([self._t, t])
        xyz = np.concatenate([self._xyz, xyz])
        k = max(0, len(t) - self.hold)
        self._t, self._xyz = t[k:], xyz[k:]
        return t[:k], xyz[:k]


class I2cAccel:
    """What the I2C drivers (:class:`~sensors.accel.adxl345.Adxl345`,
    :class:`~sensors.accel.mpu6050.Mpu6050`) do alike: checked register writes, the identity
    probe, closing, the self-test's sample collection and the status.

    A driver sets the class attributes below and, in ``__init__``, ``bus``, ``address``,
    ``clock``, ``rate_hz``, ``gate`` (a :class:`SampleGate`), ``samples``, ``dropped``,
    ``_t_start``, ``_t_last_read`` and ``started``; it defines ``start``, ``read``,
    :meth:`_standby` and :meth:`_fifo_samples`.
    """

    chip = ""
    #: The chip's name as its data sheet spells it, for messages.
    name = ""
    #: The identity register, its name, the value the chip answers and what to check when it differs.
    id_register = 0
    id_name = ""
    id_value = 0
    id_hint = ""

    bus: Any
    address: int
    clock: Callable[[], float]
    rate_hz: float
    gate: SampleGate
    stamps: Timestamper
    scale: float
    samples: int
    dropped: int
    started: bool
    _t_start: float
    _t_last_read: float

    def _set(self, reg: int, value: int) -> None:
        """Write and read back, as Klipper does: a mismatch means wiring or a bad chip."""
        self.bus.write_byte_data(self.address, reg, value)
        got = self.bus.read_byte_data(self.address, reg)
        if got != value:
            raise RegisterMismatch(f"{self.name} register 0x{reg:02X}: wrote 0x{value:02X}, read 0x{got:02X}")

    def probe(self) -> None:
        """Raise :class:`WrongDevice` unless the chip at ``address`` answers with its identity."""
        got = self.bus.read_byte_data(self.address, self.id_register)
        if got != self.id_value:
            raise WrongDevice(
                f"no {self.name} at 0x{self.address:02X}: {self.id_name} 0x{got:02X}, "
                f"expected 0x{self.id_value:02X} ({self.id_hint})"
            )

    def _admit(self, raw: np.ndarray, now: float) -> AccelBatch:
        """The batch of the ``(n, 3)`` counts read at ``now``: checked, stamped and scaled by the
        gate; a :class:`SensorFault` drops them (counted) and restarts the stamps."""
        n = len(raw)
        try:
            t, xyz = self.gate.admit(raw, self.stamps.place(n, now), raw * self.scale)
        except SensorFault as exc:
            self.dropped += exc.lost
            self.stamps.reset()
            raise
        self.samples += n  # delivered by the chip: the achieved rate, hold-back or not
        return AccelBatch(t, xyz, 0)

    def _unread(self, now: float) -> int:
        """Samples the chip made since the last successful FIFO read."""
        return periods_between(self._t_start, self.rate_hz, self._t_last_read, now)

    def _standby(self) -> None:
        """Stop the chip sampling (may raise ``OSError``)."""
        raise NotImplementedError

    def _fifo_samples(self) -> np.ndarray:
        """Raw ``(n, 3)`` int counts the FIFO holds now (possibly none)."""
        raise NotImplementedError

    def close(self) -> int:
        """Standby.  Returns the samples this discards, also added to ``dropped``: those the
        gate holds back and those the chip made since the last successful FIFO read (left
        in the FIFO, or popped by a read that then failed); a restart clears the FIFO."""
        lost = 0
        if self.started:
            lost = self._unread(self.clock()) + self.gate.discard()
            self.dropped += lost
            with contextlib.suppress(OSError):  # the bus may be what failed; standby is a courtesy
                self._standby()
        self.started = False
        return lost

    def _collect(self, n: int) -> np.ndarray:
        """``n`` raw samples for a self-test; :class:`SensorFault` when they do not come in time."""
        out: list[np.ndarray] = []
        got = 0
        deadline = self.clock() + 10.0 + 2 * n / self.rate_hz
        while got < n:
            raw = self._fifo_samples()
            out.append(raw)
            got += len(raw)
            if self.clock() > deadline:
                raise SensorFault(f"self-test: only {got} of {n} samples arrived")
            if not len(raw):
                wait(self.clock, 1.0 / self.rate_hz)
        return np.concatenate(out)[:n]

    def status(self) -> dict:
        elapsed = self.clock() - self._t_start
        return {
            "state": "ok" if self.started else "stopped",
            "reason": "",
            "retries": 0,
            "dropped": self.dropped,
            "chip": self.chip,
            "rate_hz": self.rate_hz,
            "achieved_hz": self.samples / elapsed if elapsed > 0 else 0.0,
        }
