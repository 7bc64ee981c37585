"""MPU-6050 accelerometer over I2C (smbus2 interface), FIFO streaming.

Register facts from the MPU-6000/MPU-6050 Register Map RM-MPU-6000A-00 Rev. 4.2
(InvenSense), checked against NOTES.md: SMPLRT_DIV 0x19 (4.2: sample rate = gyro
output rate / (1 + SMPLRT_DIV), gyro output 1 kHz with the DLPF on; the accelerometer
itself outputs at 1 kHz, so rates above 1 kHz only repeat samples); CONFIG 0x1A
(DLPF_CFG bits 2:0, 4.3); ACCEL_CONFIG 0x1C (AFS_SEL bits 4:3 = ±2/4/8/16 g, 16384/
8192/4096/2048 LSB/g, 4.5/4.17); FIFO_EN 0x23 (ACCEL_FIFO_EN bit 3, 4.7); INT_STATUS
0x3A (FIFO_OFLOW_INT bit 4, cleared on read, 4.16); ACCEL_XOUT_H 0x3B (big-endian);
USER_CTRL 0x6A (FIFO_EN bit 6, FIFO_RESET bit 2, 4.27); PWR_MGMT_1 0x6B (SLEEP bit 6,
CLKSEL 2:0, 4.28); FIFO_COUNT_H/L 0x72/0x73 (read H first: it latches both, 4.30);
FIFO_R_W 0x74 (4.31: on overflow the oldest bytes are lost); WHO_AM_I 0x75 = 0x68.
The FIFO is 1024 bytes: 170 accelerometer samples of 6 bytes.
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

SMPLRT_DIV, CONFIG, ACCEL_CONFIG, FIFO_EN, INT_STATUS = 0x19, 0x1A, 0x1C, 0x23, 0x3A
USER_CTRL, PWR_MGMT_1, FIFO_COUNT_H, FIFO_R_W, WHO_AM_I = 0x6A, 0x6B, 0x72, 0x74, 0x75
SELF_TEST_X, SELF_TEST_A = 0x0D, 0x10
ST_ALL = 0xE0  # ACCEL_CONFIG XA_ST | YA_ST | ZA_ST (4.5)
ST_LIMIT = 0.14  # change from factory trim, ±14 % (MPU-6050 Product Specification, accel table)
ADDRESS = 0x68  # AD0 low; 0x69 with AD0 high
WHO_AM_I_VALUE = 0x68
ACCEL_FIFO_EN = 0x08
USER_FIFO_EN, USER_FIFO_RESET = 0x40, 0x04
FIFO_OFLOW = 0x10
RANGES = {2: 0, 4: 1, 8: 2, 16: 3}
FIFO_BYTES = 1024
SAMPLE_BYTES = 6
# DLPF_CFG -> accelerometer bandwidth in Hz (Register Map 4.3, table); 0 (260 Hz) would
# switch the gyro output to 8 kHz, so the driver keeps the DLPF on.
DLPF_BW = {1: 184, 2: 94, 3: 44, 4: 21, 5: 10, 6: 5}


def factory_trim(code: int) -> float:
    """FT in LSB at ±8 g for a 5-bit XA/YA/ZA_TEST code (Register Map 4.1); 0 if unset."""
    return 4096 * 0.34 * (0.92 / 0.34) ** ((code - 1) / 30) if code else 0.0


def rate_for(rate_hz: float) -> tuple[float, int]:
    """Nearest achievable rate and SMPLRT_DIV for a 1 kHz gyro output (227 Hz -> 250 Hz, 3)."""
    div = min(range(256), key=lambda d: abs(1000.0 / (1 + d) - rate_hz))
    return 1000.0 / (1 + div), div


class Mpu6050(I2cAccel):
    """One MPU-6050 on an smbus2-like ``bus``; an :class:`~sensors.accel.base.AccelSource`.

    Only the accelerometer goes into the FIFO.  ``read()`` raises ``OSError`` (bus) or
    a :class:`SensorFault` and returns nothing of that batch; an overflow also resets
    the FIFO, because losing the oldest *bytes* of 6-byte records misaligns every
    record after it.
    """

    chip = "mpu6050"
    name = "MPU-6050"
    id_register, id_name, id_value = WHO_AM_I, "WHO_AM_I", WHO_AM_I_VALUE
    id_hint = "0x68, or 0x69 with AD0 high; an MPU-9250 answers 0x71"

    def __init__(
        self,
        bus,
        address: int = ADDRESS,
        rate_hz: float = 250.0,
        range_g: int = 16,
        *,
        clock: Callable[[], float] = time.monotonic,
        use_rdwr: bool = True,
        stuck_window: int | None = None,
    ) -> None:
        if range_g not in RANGES:
            raise ValueError(f"range_g={range_g} is not an MPU-6050 range; choose one of {sorted(RANGES)}")
        self.bus, self.address, self.range_g, self.clock = bus, address, range_g, clock
        self.requested_hz = float(rate_hz)
        self.rate_hz, self.divider = rate_for(rate_hz)
        # the widest DLPF bandwidth below Nyquist, so the FIFO is not aliased
        self.dlpf = min((c for c, bw in DLPF_BW.items() if bw <= self.rate_hz / 2), default=6)
        self.use_rdwr = use_rdwr
        self.scale = STANDARD_GRAVITY / (16384.0 / (1 << RANGES[range_g]))  # m/s² per LSB
        window = stuck_window or max(64, int(0.25 * self.rate_hz))
        self.gate = SampleGate(RawChecker(lo=-32768, hi=32767, stuck_window=window))
        self.stamps = Timestamper(self.rate_hz)
        self.samples = self.dropped = 0
        self._t_start = self._t_last_read = 0.0
        self.started = False

    def start(self) -> None:
        self.probe()
        self._set(PWR_MGMT_1, 0x01)  # wake, PLL on the X gyro: the recommended clock (4.28)
        self._set(CONFIG, self.dlpf)
        self._set(SMPLRT_DIV, self.divider)
        self._set(ACCEL_CONFIG, RANGES[self.range_g] << 3)
        self._set(USER_CTRL, 0x00)
        self.bus.write_byte_data(self.address, USER_CTRL, USER_FIFO_RESET)  # self-clearing bit
        self._set(FIFO_EN, ACCEL_FIFO_EN)
        self.bus.read_byte_data(self.address, INT_STATUS)  # clear a stale FIFO_OFLOW
        self._set(USER_CTRL, USER_FIFO_EN)
        self.gate.reset()
        self.stamps.reset()
        self._t_start = self._t_last_read = self.clock()
        self.samples = 0
        self.started = True

    def _standby(self) -> None:
        self.bus.write_byte_data(self.address, USER_CTRL, 0x00)
        self.bus.write_byte_data(self.address, PWR_MGMT_1, 0x40)  # sleep

    def _fifo_samples(self) -> np.ndarray:
        hi, lo = self.bus.read_i2c_block_data(self.address, FIFO_COUNT_H, 2)
        k = ((hi << 8) | lo) // SAMPLE_BYTES
        if not k:
            return np.empty((0, 3), dtype=np.int64)
        return np.frombuffer(self._read_fifo(k * SAMPLE_BYTES), dtype=">i2").reshape(k, 3).astype(np.int64)

    def _read_fifo(self, nbytes: int) -> bytes:
        if self.use_rdwr:
            from smbus2 import i2c_msg  # pure Python; imported here so a laptop needs nothing

            write, read = i2c_msg.write(self.address, [FIFO_R_W]), i2c_msg.read(self.address, nbytes)
            self.bus.i2c_rdwr(write, read)
            return bytes(read)
        out = bytearray()
        while len(out) < nbytes:  # SMBus block reads stop at 32 bytes: take 30 (5 records)
            out += bytes(self.bus.read_i2c_block_data(self.address, FIFO_R_W, min(30, nbytes - len(out))))
        return bytes(out)

    def read(self) -> AccelBatch:
        oflow = bool(self.bus.read_byte_data(self.address, INT_STATUS) & FIFO_OFLOW)
        now = self.clock()
        if oflow:
            produced = periods_between(self._t_start, self.rate_hz, self._t_last_read, now)
            lost = max(produced, FIFO_BYTES // SAMPLE_BYTES + 1) + self.gate.discard()
            self.dropped += lost
            self._t_last_read = now
            self.stamps.reset()
            self.bus.write_byte_data(self.address, USER_CTRL, USER_FIFO_EN | USER_FIFO_RESET)
            raise FifoOverrun(
                f"MPU-6050 FIFO overflowed (~{produced - 170} samples lost); FIFO reset, read more often",
                lost=lost,
            )
        hi, lo = self.bus.read_i2c_block_data(self.address, FIFO_COUNT_H, 2)
        count = (hi << 8) | lo
        n = count // SAMPLE_BYTES
        if n == 0:
            self._t_last_read = now
            return AccelBatch.empty()
        raw = np.frombuffer(self._read_fifo(n * SAMPLE_BYTES), dtype=">i2").reshape(n, 3).astype(np.int64)
        self._t_last_read = now  # only now are they taken: a failed read leaves them to close()
        return self._admit(raw, now)

    def self_test(self, n: int = 100) -> dict:
        """Accelerometer self-test (Register Map 4.1, 4.5): at ±8 g, the output with
        XA/YA/ZA_ST set minus without is the response STR; its change from the factory
        trim FT (codes in SELF_TEST_X..Z bits 7:5 and SELF_TEST_A) must be within ±14 %.
        The chip is left configured as before.
        """
        st = [self.bus.read_byte_data(self.address, r) for r in range(SELF_TEST_X, SELF_TEST_A + 1)]
        codes = [((st[i] >> 3) & 0x1C) | ((st[3] >> (4 - 2 * i)) & 0x03) for i in range(3)]
        trims = [factory_trim(c) for c in codes]
        means = []
        for cfg in (RANGES[8] << 3, ST_ALL | RANGES[8] << 3):
            self._set(ACCEL_CONFIG, cfg)
            self.bus.write_byte_data(self.address, USER_CTRL, USER_FIFO_EN | USER_FIFO_RESET)
            self._collect(4)  # let the output settle after the switch
            means.append(self._collect(n).mean(axis=0))
        self._set(ACCEL_CONFIG, RANGES[self.range_g] << 3)
        self.bus.write_byte_data(self.address, USER_CTRL, USER_FIFO_EN | USER_FIFO_RESET)
        self.gate.reset()
        self.stamps.reset()
        self._t_last_read = self.clock()  # the self-test used what came before
        response = means[1] - means[0]
        change = [(r - ft) / ft if ft else float("inf") for r, ft in zip(response, trims, strict=True)]
        passed = all(abs(c) <= ST_LIMIT for c in change)
        return {
            "response_lsb": response.tolist(),
            "factory_trim_lsb": trims,
            "change": change,
            "passed": bool(passed),
        }
