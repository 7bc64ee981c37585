"""ADXL345 over I2C (smbus2 interface), FIFO in stream mode.

Register facts from the ADXL345 data sheet Rev. E (Analog Devices), checked against
NOTES.md: DEVID 0x00 = 0xE5; BW_RATE 0x2C (rate code in bits 3:0, Table 7: 0xF =
3200 Hz, halving per step down to 0x6 = 6.25 Hz); POWER_CTL 0x2D (Measure = bit 3);
INT_SOURCE 0x30 (Overrun = bit 0: in FIFO modes set when the FIFO is filled, cleared
by reading it); DATA_FORMAT 0x31 (SELF_TEST bit 7, FULL_RES bit 3, Justify bit 2,
Range bits 1:0); DATAX0..DATAZ1 0x32-0x37, little-endian int16; FIFO_CTL 0x38
(FIFO_MODE bits 7:6, 10 = stream; samples/watermark bits 4:0); FIFO_STATUS 0x39
(entries bits 5:0).  Full resolution keeps 3.9 mg/LSB in every range (Table 1).
The FIFO holds 32 entries plus one in the output registers; each entry is popped by a
read that runs through DATAZ1, and the next read must start >= 5 µs later (FIFO
section) -- one SMBus transaction per entry on a 400 kHz bus is far slower than that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from sensors.accel.base import (
    STANDARD_GRAVITY,
    AccelBatch,
    FifoOverrun,
    I2cAccel,
    RawChecker,
    SampleGate,
    Timestamper,
    periods_between,
)

DEVID, BW_RATE, POWER_CTL, INT_SOURCE, DATA_FORMAT = 0x00, 0x2C, 0x2D, 0x30, 0x31
DATAX0, FIFO_CTL, FIFO_STATUS = 0x32, 0x38, 0x39
ADDRESS = 0x53  # SDO low; 0x1D with SDO high
DEVID_VALUE = 0xE5
MEASURE = 0x08
FULL_RES, SELF_TEST = 0x08, 0x80
STREAM_MODE = 0x80
RANGES = {2: 0b00, 4: 0b01, 8: 0b10, 16: 0b11}
RATES = {3200.0 / 2 ** (15 - code): code for code in range(0x6, 0x10)}  # 6.25 .. 3200 Hz
SCALE_G = 0.0039  # g/LSB at full resolution (Table 1, typ.)
FIFO_DEPTH = 32
# Table 15 (±2 g or full resolution, Vs = 2.5 V) in LSB; Table 14 scales X/Y and Z with Vs.
SELF_TEST_LIMITS = ((50, 540), (-540, -50), (75, 875))
SELF_TEST_VS_SCALE = {2.0: (0.64, 0.8), 2.5: (1.0, 1.0), 3.3: (1.77, 1.47), 3.6: (2.11, 1.69)}


def nearest_rate(rate_hz: float) -> float:
    """The ODR the chip can do that is closest to ``rate_hz`` (227 Hz -> 200 Hz)."""
    return min(RATES, key=lambda r: abs(np.log(r / rate_hz)))


class Adxl345(I2cAccel):
    """One ADXL345 on an smbus2-like ``bus``; an :class:`~sensors.accel.base.AccelSource`.

    ``read()`` raises ``OSError`` (bus) or a :class:`SensorFault` (wrong id, overrun,
    stuck or saturated axis) and then returns nothing of that batch; wrap it in
    :class:`~sensors.accel.supervisor.Supervisor` for retry with backoff.
    """

    chip = "adxl345"
    name = "ADXL345"
    id_register, id_name, id_value = DEVID, "DEVID", DEVID_VALUE
    id_hint = "check the address, 0x53 or 0x1D with SDO high, and the wiring"

    def __init__(
        self,
        bus,
        address: int = ADDRESS,
        rate_hz: float = 400.0,
        range_g: int = 16,
        *,
        clock: Callable[[], float] = time.monotonic,
        watermark: int = 16,
        stuck_window: int | None = None,
        use_rdwr: bool = False,
    ) -> None:
        if range_g not in RANGES:
            raise ValueError(f"range_g={range_g} is not an ADXL345 range; choose one of {sorted(RANGES)}")
        self.bus, self.address, self.range_g, self.clock = bus, address, range_g, clock
        self.rate_hz = nearest_rate(rate_hz)
        self.requested_hz = float(rate_hz)
        self.watermark = int(watermark) & 0x1F
        self.use_rdwr = use_rdwr
        half = 1 << (10 + RANGES[range_g] - 1)  # full resolution: 10..13 bits
        window = stuck_window or max(64, int(0.25 * self.rate_hz))
        self.gate = SampleGate(RawChecker(lo=-half, hi=half - 1, stuck_window=window))
        self.stamps = Timestamper(self.rate_hz)
        self.scale = SCALE_G * STANDARD_GRAVITY  # m/s² per LSB
        self.samples = self.dropped = 0
        self._t_start = self._t_last_read = 0.0
        self._leftover = 0
        self.started = False

    # ------------------------------------------------------------------ setup
    def start(self) -> None:
        self.probe()
        self._set(POWER_CTL, 0x00)  # standby while configuring (POWER_CTL section)
        self._set(DATA_FORMAT, FULL_RES | RANGES[self.range_g])  # right-justified, sign-extended
        self._set(BW_RATE, RATES[self.rate_hz])  # normal power (LOW_POWER bit 4 = 0)
        self._set(FIFO_CTL, 0x00)  # through bypass: clears the FIFO
        self._set(FIFO_CTL, STREAM_MODE | self.watermark)
        self._set(POWER_CTL, MEASURE)
        self.gate.reset()
        self.stamps.reset()
        self._t_start = self._t_last_read = self.clock()
        self._leftover = 0
        self.samples = 0
        self.started = True

    def _unread(self, now: float) -> int:
        """Samples made but not taken: what the last drain left plus what came since."""
        return self._leftover + super()._unread(now)

    def _standby(self) -> None:
        self.bus.write_byte_data(self.address, POWER_CTL, 0x00)

    # ------------------------------------------------------------------ data
    def _drain(self) -> tuple[np.ndarray, bool]:
        """Raw (n, 3) int counts from the FIFO and whether it had filled."""
        full = bool(self.bus.read_byte_data(self.address, INT_SOURCE) & 0x01)
        entries = self.bus.read_byte_data(self.address, FIFO_STATUS) & 0x3F
        if entries == 0:
            return np.empty((0, 3), dtype=np.int64), full
        if self.use_rdwr:
            buf = self._drain_rdwr(entries)
        else:
            buf = bytearray()
            for _ in range(entries):  # one transaction per entry: each pops one level
                buf += bytes(self.bus.read_i2c_block_data(self.address, DATAX0, 6))
        raw = np.frombuffer(bytes(buf), dtype="<i2").reshape(-1, 3).astype(np.int64)
        return raw, full

    def _fifo_samples(self) -> np.ndarray:
        return self._drain()[0]

    def _drain_rdwr(self, entries: int) -> bytes:
        """The same per-entry reads, many per ioctl: [write 0x32, read 6] pairs, repeated start.

        Fewer system calls per sample; the bits on the bus are the same.  The pop is
        signalled by the register pointer passing 0x37 (FIFO section), and the next pair's
        address byte alone lasts > 20 µs at 400 kHz, more than the 5 µs the FIFO needs.
        Not yet tried on hardware, hence opt-in.  Linux takes at most 42 messages per
        I2C_RDWR ioctl (I2C_RDWR_IOCTL_MAX_MSGS), so 21 entries per call.
        """
        from smbus2 import i2c_msg  # pure Python; imported here so a laptop needs nothing

        out = bytearray()
        for start in range(0, entries, 21):
            reads = [i2c_msg.read(self.address, 6) for _ in range(min(21, entries - start))]
            msgs = []
            for r in reads:
                msgs += [i2c_msg.write(self.address, [DATAX0]), r]
            self.bus.i2c_rdwr(*msgs)
            for r in reads:
                out += bytes(r)
        return bytes(out)

    def read(self) -> AccelBatch:
        raw, full = self._drain()
        now = self.clock()
        n = len(raw)
        lost = 0
        if full:
            # The FIFO keeps the newest 33 (32 + output registers): what was produced
            # since the last read, plus what that read left behind, beyond 33 was
            # overwritten.  ODR tolerance and read-time phase make this ±1-2 samples,
            # so a couple of samples' excess is not called an overrun.
            produced = periods_between(self._t_start, self.rate_hz, self._t_last_read, now)
            est = self._leftover + produced - (FIFO_DEPTH + 1)
            lost = est if est >= max(2, 0.05 * produced) else 0
        self._leftover = 1 if n == FIFO_DEPTH else 0
        self._t_last_read = now
        if lost:
            discarded = n + self.gate.discard()
            self.dropped += lost + discarded
            self.stamps.reset()
            raise FifoOverrun(
                f"ADXL345 FIFO overran: ~{lost} samples lost (read more often)", lost=lost + discarded
            )
        return self._admit(raw, now)

    # ------------------------------------------------------------------ self-test
    def self_test(self, n: int = 100, vs: float = 2.5) -> dict:
        """Datasheet self-test: mean output with SELF_TEST on minus off, against Table 15.

        Runs at ±16 g full resolution (3.9 mg/LSB, so Table 15's LSB limits apply) and
        needs an ODR of 100-800 Hz or 3200 Hz, normal power ("Self-Test" section).
        Returns the shift per axis in LSB, the limits and ``passed``; the chip is left
        configured as before.
        """
        if self.rate_hz not in (100.0, 200.0, 400.0, 800.0, 3200.0):
            raise ValueError(f"self-test needs 100-800 Hz or 3200 Hz, not {self.rate_hz:g} Hz")
        fx, fz = SELF_TEST_VS_SCALE[min(SELF_TEST_VS_SCALE, key=lambda v: abs(v - vs))]
        limits = [(lo * f, hi * f) for (lo, hi), f in zip(SELF_TEST_LIMITS, (fx, fx, fz), strict=True)]
        base = FULL_RES | RANGES[16]
        means = []
        for fmt in (base, base | SELF_TEST):
            self._set(DATA_FORMAT, fmt)
            self._set(FIFO_CTL, 0x00)
            self._set(FIFO_CTL, STREAM_MODE | self.watermark)
            self._collect(4)  # let the output settle after the switch
            means.append(self._collect(n).mean(axis=0))
        self._set(DATA_FORMAT, FULL_RES | RANGES[self.range_g])
        self.stamps.reset()
        self.gate.reset()
        self._t_last_read, self._leftover = self.clock(), 0  # the self-test used what came before
        shift = means[1] - means[0]
        passed = all(lo <= s <= hi for s, (lo, hi) in zip(shift, limits, strict=True))
        return {"shift_lsb": shift.tolist(), "limits_lsb": limits, "passed": bool(passed)}
