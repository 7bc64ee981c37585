"""A fake I2C bus with smbus2's interface, holding ADXL345 and MPU-6050 register maps.

The chips behave as their datasheets say where our drivers depend on it: samples
enter the FIFO at the configured output data rate as (virtual) time passes, the FIFO
overruns as the chip's does, raw counts follow the configured range and data format,
and the ADXL345 self-test shifts the outputs.  Errors are injected on the bus
(``OSError(121)`` on the nth access) or per chip (a chip that stops answering).

Sources cited: ADXL345 data sheet Rev. E (Analog Devices) and MPU-6000/MPU-6050
Register Map RM-MPU-6000A-00 Rev. 4.2 (InvenSense); section numbers in comments.
"""

from __future__ import annotations

import ctypes
import errno
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from sensors.accel.base import STANDARD_GRAVITY

I2C_M_RD = 0x0001  # linux/i2c.h; what smbus2.i2c_msg.read sets


class GaussianStream:
    """Default vibration: seeded white noise on x, y, z plus gravity on z (m/s²)."""

    def __init__(self, sigma: float = 0.3, seed: int = 0, gravity: float = STANDARD_GRAVITY) -> None:
        self.sigma, self.gravity = float(sigma), float(gravity)
        self.rng = np.random.default_rng(seed)

    def next(self, n: int) -> np.ndarray:
        out = self.rng.normal(0.0, self.sigma, (n, 3))
        out[:, 2] += self.gravity
        return out


class ConstantStream:
    """The same acceleration every sample (m/s²): for exact scaling and stuck-axis tests."""

    def __init__(self, xyz: tuple[float, float, float]) -> None:
        self.xyz = np.asarray(xyz, dtype=np.float64)

    def next(self, n: int) -> np.ndarray:
        return np.tile(self.xyz, (n, 1))


def _remote_io() -> OSError:
    # What the Pi's i2c-bcm2835 driver reports for a NACK.
    return OSError(errno.EREMOTEIO, "Remote I/O error")


class FakeChip:
    """Register file, virtual-time sample production and a FIFO; subclasses add semantics."""

    address: int = 0
    fifo_capacity: int = 0

    def __init__(self, stream, clock: Callable[[], float] | None = None) -> None:
        self.stream = stream
        self.clock = clock or time.monotonic
        self.regs = bytearray(128)
        self.fifo: deque = deque()
        self.produced = 0  # samples made since measuring (re)started
        self.produced_total = 0  # ground truth: samples made in all, across restarts
        self.lost = 0  # ground truth: samples the FIFO discarded
        self.dead = False  # stops answering: every access NACKs
        self.writes: list[tuple[int, int]] = []
        self._t0: float | None = None

    # -- subclass hooks
    def rate_hz(self) -> float:
        raise NotImplementedError

    def measuring(self) -> bool:
        raise NotImplementedError

    def encode(self, acc: np.ndarray) -> list:
        """m/s² (n, 3) to FIFO entries."""
        raise NotImplementedError

    # -- time
    def _restart_clock(self) -> None:
        self._t0 = self.clock() if self.measuring() else None
        self.produced = 0

    def advance(self) -> None:
        """Produce the samples due by now at the ODR into the FIFO."""
        if self._t0 is None:
            return
        due = int(np.floor((self.clock() - self._t0) * self.rate_hz() + 1e-9)) - self.produced
        if due <= 0:
            return
        self.produced += due
        self.produced_total += due
        acc = self.stream.next(due)
        self.push(self.encode(np.asarray(acc, dtype=np.float64)))

    def push(self, entries: list) -> None:
        self.fifo.extend(entries)
        over = len(self.fifo) - self.fifo_capacity
        if over > 0:
            for _ in range(over):
                self.fifo.popleft()  # stream mode keeps the newest
            self.on_overflow(over)

    def on_overflow(self, n: int) -> None:
        self.lost += n

    # -- register access
    def read(self, reg: int, length: int) -> bytes:
        raise NotImplementedError

    def write(self, reg: int, data: bytes) -> None:
        self.advance()  # the chip samples on its own clock: what was due is made first
        for i, v in enumerate(data):
            self.writes.append((reg + i, v))
            self.write_reg(reg + i, v)

    def write_reg(self, reg: int, value: int) -> None:
        self.regs[reg] = value & 0xFF


# ----------------------------------------------------------------------------- ADXL345
class FakeAdxl345(FakeChip):
    """ADXL345 on I2C (data sheet Rev. E, Table 19 register map).

    FIFO (section "FIFO", Table 23): 32 entries plus one in the output registers, so
    33 available; stream mode keeps the newest, discarding the oldest.  Reading the six
    data bytes 0x32-0x37 pops one entry.  INT_SOURCE (0x30) bit 0 Overrun is set when
    the FIFO is filled and cleared when its contents are read.  Self-test (section
    "Self-Test"): the SELF_TEST bit of DATA_FORMAT adds an electrostatic force, here a
    fixed shift per axis inside Table 15's limits at Vs = 2.5 V (X 50..540, Y -540..-50,
    Z 75..875 LSB at 3.9 mg/LSB).
    """

    DEVID = 0xE5
    fifo_capacity = 33
    SCALE_G = 0.0039  # g/LSB, full resolution (Table 1 scale factor, typ.)
    SELF_TEST_LSB = (200, -200, 300)

    def __init__(self, stream=None, clock=None, *, address: int = 0x53, devid: int = DEVID) -> None:
        super().__init__(stream if stream is not None else GaussianStream(), clock)
        self.address = address
        self.regs[0x00] = devid
        self.regs[0x2C] = 0x0A  # BW_RATE reset value: 100 Hz
        self.stuck: np.ndarray | None = None  # force raw counts, e.g. a dead axis

    def rate_hz(self) -> float:
        return 3200.0 / 2 ** (15 - (self.regs[0x2C] & 0x0F))  # Table 7: code 0xF = 3200 Hz

    def measuring(self) -> bool:
        return bool(self.regs[0x2D] & 0x08)

    def _bits(self) -> int:
        fmt = self.regs[0x31]
        return 10 + (fmt & 0x03) if fmt & 0x08 else 10  # FULL_RES: 10..13 bits

    def lsb_g(self) -> float:
        fmt = self.regs[0x31]
        return self.SCALE_G if fmt & 0x08 else self.SCALE_G * (1 << (fmt & 0x03))

    def encode(self, acc: np.ndarray) -> list:
        raw = np.rint(acc / STANDARD_GRAVITY / self.lsb_g())
        if self.regs[0x31] & 0x80:
            raw = raw + np.asarray(self.SELF_TEST_LSB)
        half = 1 << (self._bits() - 1)
        raw = np.clip(raw, -half, half - 1).astype(np.int64)
        if self.stuck is not None:
            mask = ~np.isnan(self.stuck)
            raw[:, mask] = self.stuck[mask].astype(np.int64)
        if self.regs[0x31] & 0x04:  # left-justified: MSB at bit 15 (Figure 50)
            raw = raw << (16 - self._bits())
        le = raw.astype("<i2").tobytes()
        return [le[i : i + 6] for i in range(0, len(le), 6)]

    def push(self, entries: list) -> None:
        if (self.regs[0x38] >> 6) == 0:  # bypass: only the output registers hold data
            self.lost += max(len(self.fifo) + len(entries) - 1, 0)
            self.fifo = deque(entries[-1:] or list(self.fifo)[-1:])
            return
        super().push(entries)

    def write_reg(self, reg: int, value: int) -> None:
        was_measuring = self.measuring()
        if reg == 0x38 and (value >> 6) == 0:
            self.fifo.clear()  # entering bypass clears the FIFO
        if reg in (0x00, 0x30, 0x39) or 0x32 <= reg <= 0x37:
            return  # read-only
        super().write_reg(reg, value)
        if (reg == 0x2D and self.measuring() != was_measuring) or (reg == 0x2C and self.measuring()):
            self._restart_clock()

    def read(self, reg: int, length: int) -> bytes:
        self.advance()
        out = bytearray()
        r = reg
        while len(out) < length:
            if 0x32 <= r <= 0x37:
                entry = self.fifo[0] if self.fifo else b"\x00" * 6
                take = min(0x38 - r, length - len(out))
                out += entry[r - 0x32 : r - 0x32 + take]
                r += take
                if r == 0x38 and self.fifo:
                    self.fifo.popleft()  # the transition 0x37 -> 0x38 pops (FIFO section)
                continue
            if r == 0x39:  # FIFO_STATUS entries[5:0]
                out.append(min(len(self.fifo), 32) & 0x3F)
            elif r == 0x30:  # INT_SOURCE: DATA_READY bit 7, watermark bit 1, overrun bit 0
                wm = self.regs[0x38] & 0x1F
                v = (0x80 if self.fifo else 0) | (0x02 if len(self.fifo) >= max(wm, 1) else 0)
                v |= 0x01 if len(self.fifo) >= 32 else 0
                out.append(v)
            else:
                out.append(self.regs[r & 0x7F])
            r += 1
        return bytes(out)


# ----------------------------------------------------------------------------- MPU-6050
class FakeMpu6050(FakeChip):
    """MPU-6050 accelerometer path (Register Map Rev. 4.2).

    Sample rate = gyro output rate / (1 + SMPLRT_DIV), gyro output 8 kHz with the DLPF
    off (DLPF_CFG 0 or 7), 1 kHz on (section 4.2).  ACCEL_CONFIG AFS_SEL[4:3] gives
    16384/8192/4096/2048 LSB/g (section 4.17).  With ACCEL_FIFO_EN (FIFO_EN bit 3,
    section 4.7) and USER_CTRL FIFO_EN (bit 6), each sample writes ACCEL_XOUT_H..ZOUT_L
    (6 bytes, big-endian) into a 1024-byte FIFO; on overflow the oldest bytes are lost
    and INT_STATUS FIFO_OFLOW_INT (bit 4) is set (section 4.31), cleared by reading
    INT_STATUS (section 4.16, INT_RD_CLEAR = 0).  FIFO_COUNT is latched by reading
    FIFO_COUNT_H (section 4.30).  USER_CTRL FIFO_RESET (bit 2) empties it.
    """

    WHO_AM_I = 0x68
    fifo_capacity = 1024  # bytes
    ST_CODES = (16, 18, 20)  # XA/YA/ZA_TEST factory-trim codes in 0x0D-0x10 (section 4.1)

    def __init__(self, stream=None, clock=None, *, address: int = 0x68, who_am_i: int = WHO_AM_I) -> None:
        super().__init__(stream if stream is not None else GaussianStream(), clock)
        self.address = address
        self.regs[0x75] = who_am_i
        self.regs[0x6B] = 0x40  # PWR_MGMT_1 reset value: SLEEP
        self._count_latch = 0
        self.stuck: np.ndarray | None = None
        self.self_test_gain = 1.0  # response / factory trim: 1 healthy, 0 a dead element
        xa, ya, za = self.ST_CODES
        self.regs[0x0D], self.regs[0x0E], self.regs[0x0F] = (xa >> 2) << 5, (ya >> 2) << 5, (za >> 2) << 5
        self.regs[0x10] = ((xa & 3) << 4) | ((ya & 3) << 2) | (za & 3)

    def rate_hz(self) -> float:
        dlpf = self.regs[0x1A] & 0x07
        gyro = 8000.0 if dlpf in (0, 7) else 1000.0
        return gyro / (1 + self.regs[0x19])

    def measuring(self) -> bool:
        return not (self.regs[0x6B] & 0x40)

    def lsb_per_g(self) -> float:
        return 16384.0 / (1 << ((self.regs[0x1C] >> 3) & 0x03))

    def encode(self, acc: np.ndarray) -> list:
        raw = np.rint(acc / STANDARD_GRAVITY * self.lsb_per_g())
        st_bits = self.regs[0x1C] >> 5  # XA_ST bit 7, YA_ST bit 6, ZA_ST bit 5
        if st_bits:
            # the self-test response equals the factory trim (LSB at ±8 g) times the gain
            ft = np.array([4096 * 0.34 * (0.92 / 0.34) ** ((c - 1) / 30) for c in self.ST_CODES])
            on = np.array([(st_bits >> 2) & 1, (st_bits >> 1) & 1, st_bits & 1])
            raw = raw + np.rint(on * ft * self.self_test_gain * self.lsb_per_g() / 4096)
        raw = np.clip(raw, -32768, 32767).astype(np.int64)
        if self.stuck is not None:
            mask = ~np.isnan(self.stuck)
            raw[:, mask] = self.stuck[mask].astype(np.int64)
        self.regs[0x3B:0x41] = raw[-1].astype(">i2").tobytes()  # sensor registers: newest
        if not (self.regs[0x6A] & 0x40 and self.regs[0x23] & 0x08):
            return []
        return list(raw.astype(">i2").tobytes())

    def on_overflow(self, n: int) -> None:
        self.lost += n  # bytes here; the driver reckons in samples
        self.regs[0x3A] |= 0x10

    def write_reg(self, reg: int, value: int) -> None:
        was = self.measuring()
        if reg == 0x6B and value & 0x80:  # DEVICE_RESET
            self.regs[:] = bytes(128)
            self.regs[0x75], self.regs[0x6B] = self.WHO_AM_I, 0x40
            self.fifo.clear()
            self._restart_clock()
            return
        if reg == 0x6A and value & 0x04:  # FIFO_RESET, self-clearing
            self.fifo.clear()
            value &= ~0x04
        if reg in (0x3A, 0x72, 0x73, 0x75) or 0x0D <= reg <= 0x10:  # factory trim codes: keep
            return
        if reg == 0x74:
            return  # writing FIFO data is not used here
        super().write_reg(reg, value)
        if self.measuring() != was or (reg in (0x19, 0x1A) and self.measuring()):
            self._restart_clock()

    def read(self, reg: int, length: int) -> bytes:
        self.advance()
        if reg == 0x74:  # FIFO_R_W: no auto-increment, each byte pops
            n = min(length, len(self.fifo))
            out = bytes(self.fifo.popleft() for _ in range(n))
            last = out[-1:] or b"\x00"
            return out + last * (length - n)  # empty FIFO repeats the last byte (4.31)
        out = bytearray()
        for r in range(reg, reg + length):
            r &= 0x7F
            if r == 0x72:
                self._count_latch = len(self.fifo)
                out.append(self._count_latch >> 8)
            elif r == 0x73:
                out.append(self._count_latch & 0xFF)
            elif r == 0x3A:
                out.append(self.regs[0x3A] | (0x01 if self.fifo else 0))
                self.regs[0x3A] = 0
            else:
                out.append(self.regs[r])
        return bytes(out)


# ----------------------------------------------------------------------------- bus
class FakeI2cBus:
    """smbus2.SMBus look-alike: ``read_byte_data``, ``write_byte_data``,
    ``read_i2c_block_data``, ``write_i2c_block_data``, ``i2c_rdwr`` and ``close``.

    ``fail_at(n)`` makes the nth access from now raise ``OSError(121)``; ``count``
    consecutive accesses fail.  An address with no chip NACKs the same way.
    """

    BLOCK_MAX = 32  # I2C_SMBUS_BLOCK_MAX, which smbus2 enforces

    def __init__(self, *chips: FakeChip) -> None:
        self.chips: dict[int, FakeChip] = {}
        for chip in chips:
            self.add(chip)
        self.accesses = 0
        self.closed = False
        self._fail: list[int] = []

    def add(self, chip: FakeChip) -> FakeChip:
        self.chips[chip.address] = chip
        return chip

    def fail_at(self, n: int, count: int = 1) -> None:
        self._fail.extend(range(self.accesses + n, self.accesses + n + count))

    def _chip(self, addr: int) -> FakeChip:
        if self.closed:
            raise OSError(errno.EBADF, "bus closed")
        self.accesses += 1
        if self.accesses in self._fail:
            self._fail.remove(self.accesses)
            raise _remote_io()
        chip = self.chips.get(addr)
        if chip is None or chip.dead:
            raise _remote_io()
        return chip

    def read_byte_data(self, i2c_addr: int, register: int, force: bool | None = None) -> int:
        return self._chip(i2c_addr).read(register, 1)[0]

    def write_byte_data(self, i2c_addr: int, register: int, value: int, force: bool | None = None) -> None:
        self._chip(i2c_addr).write(register, bytes([value & 0xFF]))

    def read_i2c_block_data(
        self, i2c_addr: int, register: int, length: int, force: bool | None = None
    ) -> list[int]:
        if length > self.BLOCK_MAX:
            raise ValueError(f"Desired block length over {self.BLOCK_MAX}")
        return list(self._chip(i2c_addr).read(register, length))

    def write_i2c_block_data(self, i2c_addr: int, register: int, data, force: bool | None = None) -> None:
        self._chip(i2c_addr).write(register, bytes(data))

    def i2c_rdwr(self, *i2c_msgs) -> None:
        """Combined transactions: a 1-byte write sets the register pointer, a read follows."""
        pointer: dict[int, int] = {}
        for msg in i2c_msgs:
            chip = self._chip(msg.addr)
            if msg.flags & I2C_M_RD:
                data = chip.read(pointer.get(msg.addr, 0), msg.len)
                ctypes.memmove(msg.buf, data, msg.len)
            else:
                raw = ctypes.string_at(msg.buf, msg.len)
                pointer[msg.addr] = raw[0]
                if len(raw) > 1:
                    chip.write(raw[0], raw[1:])

    def close(self) -> None:
        self.closed = True
