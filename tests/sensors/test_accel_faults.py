"""Faults through the supervisor: bus errors, wrong id, stuck and saturated axes, overrun.
The caller keeps running, gets no bad sample, and the source comes back with backoff."""

from __future__ import annotations

import numpy as np
import pytest

from sensors.accel import Adxl345, Mpu6050, Supervisor
from sensors.accel.base import STANDARD_GRAVITY, RawChecker, StuckAxis
from sensors.sim.i2c_bus import ConstantStream, FakeAdxl345, FakeI2cBus, FakeMpu6050, GaussianStream
from sensors.sim.printer import VirtualClock


def supervised(chip_cls=FakeAdxl345, driver_cls=Adxl345, stream=None, rate=400.0, range_g=16, **kw):
    clock = VirtualClock()
    chip = chip_cls(stream or GaussianStream(), clock)
    bus = FakeI2cBus(chip)
    sup = Supervisor(driver_cls(bus, rate_hz=rate, range_g=range_g, clock=clock), clock=clock, **kw)
    return clock, chip, bus, sup


def run(sup, clock, seconds, dt=0.02):
    out = []
    end = clock.t + seconds
    while clock.t < end - 1e-12:
        clock.advance(dt)
        out.append((sup.read(), sup.status()))
    return out


@pytest.mark.parametrize("chip_cls,driver_cls", [(FakeAdxl345, Adxl345), (FakeMpu6050, Mpu6050)])
def test_oserror_faults_backs_off_and_recovers(chip_cls, driver_cls):
    clock, _, bus, sup = supervised(chip_cls, driver_cls, backoff_s=0.5)
    sup.start()
    run(sup, clock, 0.2)
    bus.fail_at(1)  # the next bus access answers Remote I/O
    clock.advance(0.02)
    b = sup.read()
    st = sup.status()
    assert len(b) == 0 and st["state"] == "fault" and "bus_error" in st["reason"] and "121" in st["reason"]
    assert st["next_retry_in"] == pytest.approx(0.5)
    # nothing is retried before the backoff has passed
    early = run(sup, clock, 0.4)
    assert all(len(b) == 0 and s["state"] == "fault" for b, s in early) and sup.retries == 0
    later = run(sup, clock, 0.5)
    assert sup.retries == 1 and sup.status()["state"] == "ok"
    got = [b for b, _ in later if len(b)]
    assert got, "data flows again after recovery"
    assert sum(b.dropped for b, _ in later) > 0  # the downtime is counted, not hidden


def _delivered_and_dropped(chip_cls, driver_cls, rate, fail_count, fail_at=1):
    """4 s at ``rate``, a bus error at 1 s on the ``fail_at``-th access from then lasting
    ``fail_count`` accesses, then close; returns (clock, chip, supervisor, delivered)."""
    clock, chip, bus, sup = supervised(chip_cls, driver_cls, rate=rate, backoff_s=0.5)
    sup.start()
    results = run(sup, clock, 1.0)
    bus.fail_at(fail_at, count=fail_count)
    results += run(sup, clock, 3.0)
    assert sup.retries == 1 and sup.state == "ok" and sup.status()["faults"] == {"bus_error": 1}
    before = sup.dropped
    sup.close()  # counts what the driver still held back or left in the FIFO
    at_close = sup.dropped - before
    delivered = sum(len(b) for b, _ in results)
    assert sup.dropped == sum(b.dropped for b, _ in results) + at_close  # batches report it all
    return clock, chip, sup, delivered


@pytest.mark.parametrize(
    "chip_cls,driver_cls,rate", [(FakeAdxl345, Adxl345, 400.0), (FakeMpu6050, Mpu6050, 250.0)]
)
@pytest.mark.parametrize("fail_at", [1, 4])  # the status read; or the FIFO data, mid-drain
def test_bus_error_dropped_count_is_exact_when_the_chip_samples_on(chip_cls, driver_cls, rate, fail_at):
    # The error lasts two accesses: a read, and the driver's standby write on close, so
    # the chip never stops (the ADXL345's FIFO overflows while the supervisor backs off;
    # the MPU-6050's holds 0.68 s and is reset on restart).  Every
    # sample the chip made either reached the caller or is counted as dropped -- the
    # gate's hold-back, samples popped by a drain that then failed and the FIFO content
    # that re-configuration clears included.
    _, chip, sup, delivered = _delivered_and_dropped(chip_cls, driver_cls, rate, 2, fail_at)
    assert chip.produced_total == round(4.0 * rate)  # it sampled all along
    assert delivered + sup.dropped == chip.produced_total


@pytest.mark.parametrize(
    "chip_cls,driver_cls,rate", [(FakeAdxl345, Adxl345, 400.0), (FakeMpu6050, Mpu6050, 250.0)]
)
def test_bus_error_dropped_count_covers_the_timeline_when_the_chip_is_put_to_standby(
    chip_cls, driver_cls, rate
):
    # A single failed access: the close after the fault reaches the chip, which sleeps
    # until the restart.  The caller's timeline still has a gap of that length, and the
    # count covers it: delivered + dropped = rate x elapsed, more than the chip made.
    clock, chip, sup, delivered = _delivered_and_dropped(chip_cls, driver_cls, rate, 1)
    assert delivered + sup.dropped == round(clock.t * rate) == round(4.0 * rate)
    assert chip.produced_total < round(4.0 * rate)  # the chip really was off for a while


def test_backoff_doubles_while_the_chip_stays_away_and_resets_after_recovery():
    clock, chip, _, sup = supervised(backoff_s=0.5, max_backoff_s=4.0)
    sup.start()
    run(sup, clock, 0.1)
    chip.dead = True  # stops answering
    delays = []
    for _ in range(3000):
        clock.advance(0.01)
        before = sup.retries
        sup.read()
        if sup.retries != before or (not delays and sup.state == "fault"):
            delays.append(round(sup.status()["next_retry_in"], 6))
        if len(delays) == 6:
            break
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]  # doubling, capped
    chip.dead = False
    run(sup, clock, 5.0)
    assert sup.state == "ok" and sup.failures == 0
    assert sup.status()["faults"] == {"bus_error": 6}


def test_wrong_device_is_a_reported_fault_and_the_caller_keeps_running():
    clock = VirtualClock()
    bus = FakeI2cBus(FakeAdxl345(clock=clock, devid=0x00))
    sup = Supervisor(Adxl345(bus, clock=clock), clock=clock)
    sup.start()
    results = run(sup, clock, 3.0)
    assert all(len(b) == 0 for b, _ in results)
    st = sup.status()
    assert st["state"] == "fault" and st["reason"].startswith("wrong_device") and st["retries"] >= 2


@pytest.mark.parametrize("chip_cls,driver_cls", [(FakeAdxl345, Adxl345), (FakeMpu6050, Mpu6050)])
def test_saturated_axis_batch_is_discarded_whole(chip_cls, driver_cls):
    # 5 g on x against a ±2 g range: the chip clips at its rail
    clock, _, _, sup = supervised(
        chip_cls, driver_cls, stream=ConstantStream((5 * STANDARD_GRAVITY, 0.1, STANDARD_GRAVITY)), range_g=2
    )
    sup.start()
    results = run(sup, clock, 1.0)
    assert all(len(b) == 0 for b, _ in results)  # not one clipped sample got through
    st = sup.status()
    assert st["faults"].get("saturated_axis", 0) >= 1 and st["dropped"] > 0 and st["discarded_batches"] >= 1


@pytest.mark.parametrize("chip_cls,driver_cls", [(FakeAdxl345, Adxl345), (FakeMpu6050, Mpu6050)])
def test_stuck_axis_faults_and_no_stuck_run_reaches_the_caller(chip_cls, driver_cls):
    clock, chip, _, sup = supervised(chip_cls, driver_cls, rate=400.0)
    sup.start()
    ok_before = [b for b, _ in run(sup, clock, 0.5) if len(b)]
    assert ok_before and sup.state == "ok"
    chip.stuck = np.array([np.nan, 123.0, np.nan])  # y frozen at one count
    after = run(sup, clock, 2.0)
    assert sup.status()["faults"].get("stuck_axis", 0) >= 1
    window = sup.source.gate.checker.stuck_window
    y = np.concatenate([b.xyz[:, 1] for b, _ in after if len(b)] or [np.empty(0)])
    # what reached the caller never holds a run of the stuck value as long as the window
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[np.inf], y, [np.inf]])) != 0))
    assert (runs.max() if len(runs) else 0) < window


def test_overrun_through_the_supervisor_marks_the_gap_and_recovers():
    clock, _, _, sup = supervised(rate=400.0, backoff_s=0.1)
    sup.start()
    run(sup, clock, 0.2)
    clock.advance(0.5)  # the daemon stalled
    b = sup.read()
    assert len(b) == 0 and b.dropped > 150 and sup.state == "fault"
    assert sup.status()["faults"] == {"fifo_overrun": 1}
    later = run(sup, clock, 0.5)
    t = np.concatenate([b.t for b, _ in later if len(b)])
    assert sup.state == "ok" and np.all(np.diff(t) > 0)


def test_raw_checker_sees_a_run_across_batches():
    chk = RawChecker(lo=-512, hi=511, stuck_window=10)
    rng = np.random.default_rng(0)
    base = rng.integers(-100, 100, (20, 3))
    chk.check(base)
    a = base.copy()
    a[-6:, 0] = 7
    chk.check(a)  # a run of 6: fine
    b = rng.integers(-100, 100, (8, 3))
    b[:4, 0] = 7  # continues to 10 across the boundary
    with pytest.raises(StuckAxis, match="x axis repeated one value 10 times"):
        chk.check(b)
