"""ADXL345 and MPU-6050 drivers against the fake bus: probe, config, FIFO streaming,
overrun, scaling and self-test.  The fake chips follow the datasheets (sensors/sim/i2c_bus.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sensors.accel import Adxl345, FifoOverrun, Mpu6050, WrongDevice
from sensors.accel.base import STANDARD_GRAVITY, AccelSource
from sensors.sim.i2c_bus import FakeAdxl345, FakeI2cBus, FakeMpu6050, GaussianStream
from sensors.sim.printer import VirtualClock
from tests.budget import examples


class RecordingStream(GaussianStream):
    """Gaussian stream that keeps every sample it hands to the chip, in order."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.history: list[np.ndarray] = []

    def next(self, n: int) -> np.ndarray:
        out = super().next(n)
        self.history.append(out)
        return out


def adxl_rig(rate=400.0, range_g=16, stream=None, **kw):
    clock = VirtualClock()
    chip = FakeAdxl345(stream or GaussianStream(), clock)
    bus = FakeI2cBus(chip)
    return clock, chip, bus, Adxl345(bus, rate_hz=rate, range_g=range_g, clock=clock, **kw)


def mpu_rig(rate=250.0, range_g=16, stream=None, **kw):
    clock = VirtualClock()
    chip = FakeMpu6050(stream or GaussianStream(), clock)
    bus = FakeI2cBus(chip)
    return clock, chip, bus, Mpu6050(bus, rate_hz=rate, range_g=range_g, clock=clock, **kw)


# ----------------------------------------------------------------------------- probe and config
def test_drivers_satisfy_the_protocol():
    assert isinstance(adxl_rig()[3], AccelSource)
    assert isinstance(mpu_rig()[3], AccelSource)


def test_probe_accepts_the_right_id_and_refuses_a_wrong_one():
    clock = VirtualClock()
    bus = FakeI2cBus(
        FakeAdxl345(clock=clock, devid=0xE6), FakeMpu6050(clock=clock, address=0x69, who_am_i=0x71)
    )
    with pytest.raises(WrongDevice, match="DEVID 0xE6"):
        Adxl345(bus, clock=clock).start()
    with pytest.raises(WrongDevice, match="WHO_AM_I 0x71"):
        Mpu6050(bus, address=0x69, clock=clock).start()
    # an ADXL345 driver pointed at an MPU-6050 reads its register 0x00 (0) -> refused
    bus.add(FakeMpu6050(clock=clock))
    with pytest.raises(WrongDevice):
        Adxl345(bus, address=0x68, clock=clock).start()


def test_missing_chip_is_an_oserror():
    with pytest.raises(OSError) as err:
        Adxl345(FakeI2cBus(), clock=VirtualClock()).start()
    assert err.value.errno == 121


def test_adxl345_config_registers_as_the_datasheet_says():
    _, chip, _, drv = adxl_rig(rate=227.0, range_g=8)
    drv.start()
    assert drv.rate_hz == 200.0  # 227 Hz is no ADXL345 rate: nearest on the 6.25·2^k ladder
    writes = chip.writes
    assert writes[0] == (0x2D, 0x00)  # standby while configuring
    assert (0x31, 0x0A) in writes  # FULL_RES | range ±8 g, right-justified
    assert (0x2C, 0x0B) in writes  # BW_RATE code 0xB = 200 Hz, normal power
    assert writes.index((0x38, 0x00)) < writes.index((0x38, 0x90))  # bypass clears, then stream, wm 16
    assert writes[-1] == (0x2D, 0x08)  # measure last
    assert chip.rate_hz() == 200.0


def test_mpu6050_config_registers_as_the_register_map_says():
    _, chip, _, drv = mpu_rig(rate=227.0, range_g=4)
    drv.start()
    assert (drv.rate_hz, drv.divider) == (250.0, 3)  # 1 kHz / (1 + 3)
    regs = chip.regs
    assert regs[0x6B] == 0x01  # awake, PLL on X gyro
    assert 1 <= regs[0x1A] <= 6 and regs[0x1A] == 2  # DLPF on (1 kHz gyro rate), 94 Hz < 125 Hz Nyquist
    assert regs[0x19] == 3
    assert regs[0x1C] == 0x08  # AFS_SEL = 1: ±4 g
    assert regs[0x23] == 0x08  # ACCEL_FIFO_EN only
    assert regs[0x6A] == 0x40  # FIFO enabled
    assert (0x6A, 0x04) in chip.writes  # FIFO reset before enabling
    assert chip.rate_hz() == 250.0


# ----------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("rate,use_rdwr", [(400.0, False), (3200.0, False), (3200.0, True)])
def test_adxl345_stream_loses_nothing_over_many_seconds(rate, use_rdwr):
    stream = RecordingStream(seed=3)
    clock, chip, _, drv = adxl_rig(rate=rate, stream=stream, use_rdwr=use_rdwr)
    drv.start()
    rng = np.random.default_rng(0)
    ts, xs = [], []
    period = 1.0 / rate
    while clock.t < 20.0:  # jittered polling, always inside the 33-sample FIFO
        clock.advance(float(rng.uniform(1, 30)) * period)
        b = drv.read()
        assert b.dropped == 0
        ts.append(b.t)
        xs.append(b.xyz)
    t, xyz = np.concatenate(ts), np.concatenate(xs)
    sent = np.concatenate(stream.history)
    assert chip.lost == 0 and drv.dropped == 0
    assert (
        len(t) == len(sent) - len(chip.fifo) - drv.gate.pending
    )  # everything produced was read, but what is still in the FIFO
    lsb = 0.0039 * STANDARD_GRAVITY
    np.testing.assert_allclose(xyz, np.rint(sent[: len(xyz)] / lsb) * lsb, atol=1e-12)
    np.testing.assert_allclose(np.diff(t), period, rtol=1e-9)  # monotonic, at the ODR
    assert abs(t[-1] + drv.gate.pending * period - clock.t) <= 3 * period  # and on the read clock
    assert drv.status()["achieved_hz"] == pytest.approx(rate, rel=0.01)


@pytest.mark.parametrize("use_rdwr", [True, False])
def test_mpu6050_stream_loses_nothing_over_many_seconds(use_rdwr):
    stream = RecordingStream(seed=4)
    clock, chip, _, drv = mpu_rig(rate=1000.0, range_g=2, stream=stream, use_rdwr=use_rdwr)
    drv.start()
    rng = np.random.default_rng(1)
    ts, xs = [], []
    while clock.t < 20.0:
        clock.advance(float(rng.uniform(0.001, 0.15)))  # FIFO holds 170 ms at 1 kHz
        b = drv.read()
        ts.append(b.t)
        xs.append(b.xyz)
    t, xyz = np.concatenate(ts), np.concatenate(xs)
    sent = np.concatenate(stream.history)
    assert chip.lost == 0 and drv.dropped == 0
    assert len(t) == len(sent) - len(chip.fifo) // 6 - drv.gate.pending
    lsb = STANDARD_GRAVITY / 16384.0
    np.testing.assert_allclose(xyz, np.rint(sent[: len(xyz)] / lsb) * lsb, atol=1e-12)
    np.testing.assert_allclose(np.diff(t), 1e-3, rtol=1e-9)


def test_adxl345_overrun_is_detected_and_counted():
    clock, chip, _, drv = adxl_rig(rate=400.0)
    drv.start()
    for _ in range(10):
        clock.advance(0.02)
        drv.read()
    held = drv.gate.pending  # the gate's hold-back, discarded with the faulty batch
    clock.advance(1.0)  # a stalled reader: 400 samples into a 33-deep FIFO
    with pytest.raises(FifoOverrun) as err:
        drv.read()
    assert abs(err.value.lost - (chip.lost + 32 + held)) <= 2  # the lost ones plus the discarded samples
    assert drv.dropped == err.value.lost
    clock.advance(0.02)
    batches = []
    for _ in range(25):  # and it streams on
        batches.append(drv.read())
        clock.advance(0.02)
    t = np.concatenate([b.t for b in batches])
    assert len(t) > 100 and drv.dropped == err.value.lost and np.all(np.diff(t) > 0)


def test_mpu6050_overflow_sets_the_flag_is_counted_and_resets_the_fifo():
    clock, chip, _, drv = mpu_rig(rate=250.0)
    drv.start()
    clock.advance(0.5)
    assert len(drv.read()) == 125 - 63  # less the gate's hold-back
    clock.advance(1.0)  # 250 samples = 1500 bytes > 1024
    assert chip.regs[0x3A] == 0 and chip.lost == 0
    chip.advance()
    assert chip.regs[0x3A] & 0x10  # FIFO_OFLOW_INT
    with pytest.raises(FifoOverrun) as err:
        drv.read()
    assert err.value.lost == 250 + 63
    assert len(chip.fifo) == 0  # reset: the next records are aligned again
    clock.advance(0.5)
    b = drv.read()
    assert len(b) == 125 - 63
    assert np.all(np.abs(b.xyz[:, 2] - STANDARD_GRAVITY) < 2.0)  # z is gravity, not a shifted byte


# ----------------------------------------------------------------------------- scaling
@settings(max_examples=examples(60), deadline=None)
@given(range_g=st.sampled_from([2, 4, 8, 16]), data=st.data())
def test_adxl345_scaling_is_exact(range_g, data):
    half = 1 << (10 + {2: 0, 4: 1, 8: 2, 16: 3}[range_g] - 1)
    raw = data.draw(st.lists(st.integers(-half + 1, half - 2), min_size=3, max_size=3))
    _, chip, _, drv = adxl_rig(range_g=range_g, stuck_window=2)  # hold back one sample only
    drv.start()
    chip.fifo.append(np.asarray(raw, dtype="<i2").tobytes())
    chip.fifo.append(np.asarray([r + 1 if r < 0 else r - 1 for r in raw], dtype="<i2").tobytes())
    b = drv.read()
    # 3.9 mg/LSB at full resolution in every range (ADXL345 Table 1)
    np.testing.assert_allclose(b.xyz[0], np.asarray(raw) * 0.0039 * 9.80665, rtol=1e-12, atol=0)


@settings(max_examples=examples(60), deadline=None)
@given(range_g=st.sampled_from([2, 4, 8, 16]), data=st.data())
def test_mpu6050_scaling_is_exact(range_g, data):
    raw = data.draw(st.lists(st.integers(-32767, 32766), min_size=3, max_size=3))
    _, chip, _, drv = mpu_rig(range_g=range_g, stuck_window=2)
    drv.start()
    chip.fifo.extend(np.asarray(raw, dtype=">i2").tobytes())
    chip.fifo.extend(np.asarray([r + 1 if r < 0 else r - 1 for r in raw], dtype=">i2").tobytes())
    b = drv.read()
    lsb_per_g = {2: 16384, 4: 8192, 8: 4096, 16: 2048}[range_g]
    np.testing.assert_allclose(b.xyz[0], np.asarray(raw) / lsb_per_g * 9.80665, rtol=1e-12, atol=0)


def test_known_values():
    # ADXL345: 256 LSB at 3.9 mg/LSB = 0.9984 g; MPU-6050 ±2 g: 16384 LSB = 1 g exactly
    _, chip, _, drv = adxl_rig(range_g=2, stuck_window=2)
    drv.start()
    chip.fifo.extend([np.array([256, -256, 1], "<i2").tobytes(), np.array([0, 0, 0], "<i2").tobytes()])
    np.testing.assert_allclose(drv.read().xyz[0], [0.9984 * 9.80665, -0.9984 * 9.80665, 0.0039 * 9.80665])
    _, chip, _, drv = mpu_rig(range_g=2, stuck_window=2)
    drv.start()
    chip.fifo.extend(np.array([16384, -8192, 0, 1, 1, 1], ">i2").tobytes())
    np.testing.assert_allclose(drv.read().xyz[0], [9.80665, -4.903325, 0.0])


# ----------------------------------------------------------------------------- self-test
def test_adxl345_self_test_passes_and_restores_the_range():
    _, chip, _, drv = adxl_rig(rate=400.0, range_g=4)
    drv.start()
    result = drv.self_test()
    assert result["passed"]
    assert result["shift_lsb"] == pytest.approx(list(FakeAdxl345.SELF_TEST_LSB), abs=40)
    assert chip.regs[0x31] == 0x08 | 0x01  # back to ±4 g, SELF_TEST off


def test_adxl345_self_test_fails_for_a_dead_element():
    _, chip, _, drv = adxl_rig(rate=400.0)
    chip.SELF_TEST_LSB = (0, 0, 0)
    drv.start()
    assert not drv.self_test()["passed"]


def test_adxl345_self_test_refuses_an_unsupported_rate():
    _, _, _, drv = adxl_rig(rate=1600.0)
    drv.start()
    with pytest.raises(ValueError, match="100-800 Hz or 3200 Hz"):
        drv.self_test()


def test_mpu6050_self_test_against_factory_trim():
    _, chip, _, drv = mpu_rig(rate=250.0, range_g=2)
    drv.start()
    result = drv.self_test()
    assert result["passed"], result
    # codes 16/18/20 from SELF_TEST_X..Z[7:5] and SELF_TEST_A: FT = 4096·0.34·(0.92/0.34)^((c-1)/30)
    assert result["factory_trim_lsb"][0] == pytest.approx(4096 * 0.34 * (0.92 / 0.34) ** 0.5)
    assert max(abs(c) for c in result["change"]) < 0.02
    assert chip.regs[0x1C] == 0x00  # back to ±2 g, self-test bits off


def test_mpu6050_self_test_fails_outside_14_percent():
    _, chip, _, drv = mpu_rig(rate=250.0)
    chip.self_test_gain = 0.8  # a weak element: -20 % from factory trim
    drv.start()
    result = drv.self_test()
    assert not result["passed"] and all(c < -0.14 for c in result["change"])
