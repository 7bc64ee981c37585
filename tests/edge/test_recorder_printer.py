"""edge-recorder on a printer: the real loop, the real ADXL345 driver on a fake I2C bus playing a
simulated print, and Moonraker answered over real HTTP on loopback -- in virtual time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge.config import DataConfig, DeviceConfig, SensorsConfig
from edge.dataset import load_dataset, prepare_dataset, save_dataset
from edge.recording.base import STATUS_FILE, RecorderError, split_for
from edge.recording.cli import make_recorder
from edge.recording.printer import PrinterRecorder
from edge.simulated import simulated_printer_dataset
from ioft_protocol.config import ConfigError, build
from sensors.layers import to_xy
from sensors.sim.printer import VirtualClock, plan_fleet_member, timeline_for
from tests.sensors.recorder_helpers import FakeMoonraker, fake_printer_bus, short_timeline
from trainer_lite.data import Dataset

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "printer3"


@pytest.fixture
def sim():
    """Two runs of a simulated printer (6 layers at speed 40, then at speed 90) on a virtual clock."""
    plans = plan_fleet_member(DEVICE, settings=(40, 90), layers=6)
    runs = [plans[40], plans[90]]
    timeline = timeline_for(runs)
    sigmas = {(p.job, p.layer): (p.sigma_ax, p.sigma_ay) for run in runs for p in run}
    clock = VirtualClock(0.0)
    chip, bus = fake_printer_bus(timeline, sigmas, clock)
    server = FakeMoonraker(timeline, clock)
    yield {"runs": runs, "timeline": timeline, "clock": clock, "chip": chip, "bus": bus, "server": server}
    server.close()


def recorder_for(sim, state_dir, **cfg) -> PrinterRecorder:
    config = SensorsConfig(kind="printer", moonraker_url=sim["server"].url, poll_s=0.05, **cfg)
    return PrinterRecorder(DEVICE, state_dir, config, clock=sim["clock"], bus_factory=lambda n: sim["bus"])


def stored_rows(state_dir) -> tuple[Dataset, Dataset, dict]:
    loaded = load_dataset(state_dir)
    assert loaded is not None
    return loaded


def expected_xy(rows):
    table = np.array([r.row for r in rows])
    return to_xy(table)


def test_every_layer_is_appended_as_the_layer_recorder_made_it(sim, tmp_path):
    rec = recorder_for(sim, tmp_path, test_fraction=0.0)
    end = sim["timeline"].end + 1.0
    rec.run(until=lambda: sim["clock"].t > end)

    train, test, meta = stored_rows(tmp_path)
    assert len(rec.layers.rows) == 12 and not rec.layers.dropped
    x, y = expected_xy(rec.layers.rows)
    np.testing.assert_array_equal(train.x, x)
    np.testing.assert_array_equal(train.y, y)
    assert len(test) == 0
    # ... and they are the simulated printer's layers: speed and sigma_a as planned.
    plans = [p for run in sim["runs"] for p in run]
    np.testing.assert_allclose(train.y[:, 0] * 50, [p.speed for p in plans], rtol=0.02)
    np.testing.assert_allclose(train.x[:, 0], [np.hypot(p.sigma_ax, p.sigma_ay) for p in plans], rtol=0.08)
    assert (
        meta["source"] == "record-printer" and meta["runs"] == 2 and meta["rows"] == {"train": 12, "test": 0}
    )
    status = json.loads((tmp_path / STATUS_FILE).read_text())
    assert status["running"] is False and status["rows"]["train"] == 12 and status["accel"]["faults"] == {}
    assert sim["server"].requests > 100  # the context really came over HTTP
    # edge-trainer's [data] source = "state" reads exactly this, in the simulated printers' form
    train2, _, _ = prepare_dataset(tmp_path, DEVICE, DataConfig())
    np.testing.assert_array_equal(train2.x, train.x)
    sim_train, _, _ = simulated_printer_dataset(DEVICE, DataConfig(source="simulate-printer"))
    assert train2.x.shape[1:] == sim_train.x.shape[1:] and train2.y.shape[1:] == sim_train.y.shape[1:]


def test_a_bus_error_mid_layer_drops_that_layer_and_recording_goes_on(sim, tmp_path):
    rec = recorder_for(sim, tmp_path, test_fraction=0.0)
    segs = sim["timeline"].segments
    target = segs[2]  # layer 2 of the first run
    t_fault = 0.5 * (target.t0 + target.t1)
    end = sim["timeline"].end + 1.0
    injected = []

    def until():
        if not injected and sim["clock"].t >= t_fault:
            sim["bus"].fail_at(1, count=3)  # the next three bus accesses NACK
            injected.append(sim["clock"].t)
        return sim["clock"].t > end

    rec.run(until=until)

    assert injected
    train, _, meta = stored_rows(tmp_path)
    recorded = {(r.job, r.layer) for r in rec.layers.rows}
    assert (target.job, target.layer) not in recorded
    assert rec.layers.dropped["accel_fault"] >= 1 and meta["dropped_layers"]["accel_fault"] >= 1
    # the loop kept going: the rest of the first run and all of the second are there
    assert {(s.job, s.layer) for s in segs[4:]} <= recorded
    x, y = expected_xy(rec.layers.rows)
    np.testing.assert_array_equal(train.x, x)
    np.testing.assert_array_equal(train.y, y)
    status = rec.accel.status()
    assert status["faults"].get("bus_error", 0) >= 1 and status["retries"] >= 1


def test_moonraker_going_silent_drops_the_layer_and_never_writes_garbage(sim, tmp_path):
    rec = recorder_for(sim, tmp_path, test_fraction=0.0)
    segs = sim["timeline"].segments
    down_from, down_to = 0.5 * (segs[7].t0 + segs[7].t1), segs[8].t1  # mid-layer 1 of run 2 .. end of layer 2
    end = sim["timeline"].end + 1.0

    def until():
        sim["server"].down = down_from <= sim["clock"].t < down_to
        return sim["clock"].t > end

    rec.run(until=until)

    train, _, _ = stored_rows(tmp_path)
    recorded = {(r.job, r.layer) for r in rec.layers.rows}
    assert (segs[7].job, segs[7].layer) not in recorded
    assert rec.layers.dropped["context_fault"] >= 1
    assert {(s.job, s.layer) for s in segs[:7]} <= recorded and (segs[-1].job, segs[-1].layer) in recorded
    assert np.isfinite(train.x).all() and np.isfinite(train.y).all()
    np.testing.assert_array_equal(train.x, expected_xy(rec.layers.rows)[0])


def test_split_holds_out_whole_runs_by_hash_and_a_restart_appends(sim, tmp_path):
    segs = sim["timeline"].segments
    mid = segs[6].t0 - 1.0  # between the two runs
    first = recorder_for(sim, tmp_path, test_fraction=0.5)
    first.run(until=lambda: sim["clock"].t > mid)
    train1, test1, meta1 = stored_rows(tmp_path)
    assert len(train1) == 6 and len(test1) == 0  # the first run trains: the train split is never empty
    assert meta1["runs"] == 1

    # A new process on the same state directory (and a fresh bus handle to the same chip).
    second = PrinterRecorder(
        DEVICE,
        tmp_path,
        SensorsConfig(kind="printer", moonraker_url=sim["server"].url, poll_s=0.05, test_fraction=0.5),
        clock=sim["clock"],
        bus_factory=lambda n: type(sim["bus"])(sim["chip"]),
    )
    end = sim["timeline"].end + 1.0
    second.run(until=lambda: sim["clock"].t > end)
    train, test, meta = stored_rows(tmp_path)
    assert meta["runs"] == 2
    x2, _ = expected_xy(second.layers.rows)
    split = split_for(DEVICE, f"{segs[6].job}#2", 0.5)
    if split == "train":
        np.testing.assert_array_equal(train.x, np.concatenate([train1.x, x2]))
        assert len(test) == 0
    else:
        np.testing.assert_array_equal(train.x, train1.x)
        np.testing.assert_array_equal(test.x, x2)


def test_split_rule_is_deterministic_and_near_its_fraction():
    keys = [f"job{i}#1" for i in range(2000)]
    a = [split_for("printer1", k, 0.25) for k in keys]
    assert a == [split_for("printer1", k, 0.25) for k in keys]
    assert 0.2 < a.count("test") / len(a) < 0.3
    assert split_for("printer1", keys[0], 0.25, train_empty=True) == "train"
    assert all(split_for("printer1", k, 0.0) == "train" for k in keys[:50])


def test_refuses_to_mix_into_a_simulated_dataset(tmp_path):
    d = Dataset(np.ones((3, 1)), np.ones((3, 1)))
    save_dataset(tmp_path, d, d, {"source": "simulate-printer"})
    cfg = SensorsConfig(kind="printer", moonraker_url="http://127.0.0.1:9")
    with pytest.raises(RecorderError, match="simulate-printer"):
        PrinterRecorder(DEVICE, tmp_path, cfg, clock=VirtualClock(), bus_factory=lambda n: None)
    config = build(
        DeviceConfig,
        {
            "device": DEVICE,
            "state_dir": str(tmp_path),
            "data": {"source": "simulate-printer"},
            "sensors": {"kind": "printer"},
        },
    )
    with pytest.raises(RecorderError, match="source = 'state'"):
        make_recorder(config)


def test_sensors_config_errors_are_clear():
    with pytest.raises(ConfigError) as err:
        build(
            DeviceConfig,
            {
                "device": DEVICE,
                "sensors": {"kind": "lathe", "accel": "bmi160", "address": 0x90, "range_g": 3, "poll_s": 0},
            },
        )
    text = str(err.value)
    for needle in ("sensors.kind", "sensors.accel", "sensors.address", "sensors.range_g", "sensors.poll_s"):
        assert needle in text
    with pytest.raises(ConfigError, match="weld_folder is required"):
        build(DeviceConfig, {"device": DEVICE, "sensors": {"kind": "welder"}})
    with pytest.raises(ConfigError, match="unknown field"):
        build(DeviceConfig, {"device": DEVICE, "sensors": {"kind": "printer", "i2c": 1}})
    for bad in ({"poll_s": float("inf")}, {"settle_s": 1e9}, {"rate_hz": 10**400}, {"test_fraction": 1.0}):
        with pytest.raises(ConfigError, match=f"sensors.{next(iter(bad))}"):
            build(DeviceConfig, {"device": DEVICE, "sensors": {"kind": "printer", **bad}})
    ok = build(DeviceConfig, {"device": DEVICE, "sensors": {"kind": "printer", "accel": "mpu6050"}})
    assert ok.sensors.i2c_address == 0x68 and ok.sensors.split_rule == "run"


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_sigtermed_recorder_process_leaves_a_loadable_dataset(tmp_path):
    # The print starts in wall time: leave the child time to import and open its sensor even on a
    # loaded 2-core machine, or it joins layer 0 late and (rightly) drops it as partial.
    start = time.monotonic() + 4.0
    timeline, _ = short_timeline(start)
    server = FakeMoonraker(timeline, time.monotonic)
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sensors.recorder_helpers", server.url, repr(start), str(state)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def rows() -> int:
            loaded = load_dataset(state)  # read while the recorder writes: must always verify
            return 0 if loaded is None else len(loaded[0]) + len(loaded[1])

        assert _wait_for(lambda: rows() >= 4, 30.0), proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()
    assert proc.returncode == 0, err
    train, test, meta = load_dataset(state)
    assert len(train) + len(test) >= 4 and len(train) >= 1 and meta["source"] == "record-printer"
    assert not [p for p in os.listdir(state) if p.endswith(".tmp")]
    # Layer i runs at 30 + i mm/s with sigmas (0.5 + 0.01 i, 0.4 + 0.01 i): every stored row is
    # one of them, and layer 0 -- opened by a context sample that the poller thread hands over
    # after the accelerometer has been read past it -- is there, first, in train.
    speeds = np.concatenate([train.y[:, 0], test.y[:, 0]]) * 50
    layer = np.round(speeds - 30).astype(int)
    np.testing.assert_allclose(speeds, 30 + layer, atol=1e-6)
    # A row's sigma is estimated from at most 0.6 s x 200 Hz = 120 samples: its relative standard
    # error is about 0.72 / sqrt(2 n) ~ 5%, so one row is held to 5 standard errors and the mean
    # ratio over the rows to 4 of its own (a wrong axis or plain sx would be 22% off).
    sigma = np.concatenate([train.x[:, 0], test.x[:, 0]])
    ratio = sigma / np.hypot(0.5 + 0.01 * layer, 0.4 + 0.01 * layer)
    assert np.all(np.abs(ratio - 1) < 5 * 0.72 / np.sqrt(2 * 96)), ratio
    assert abs(ratio.mean() - 1) < 4 * 0.72 / np.sqrt(2 * 96 * len(ratio)), ratio
    assert train.y[0, 0] * 50 == pytest.approx(30.0)
    status = json.loads((state / STATUS_FILE).read_text())
    assert status["running"] is False and status["rows"]["train"] + status["rows"]["test"] == len(
        train
    ) + len(test)


def test_cli_without_the_i2c_bus_reports_it_and_keeps_retrying(tmp_path):
    cfg = tmp_path / "printer3.toml"
    cfg.write_text(
        f'device = "{DEVICE}"\nstate_dir = "{tmp_path / "state"}"\n'
        '[sensors]\nkind = "printer"\naccel = "adxl345"\ni2c_bus = 99\naddress = 0x53\n'
        'moonraker_url = "http://127.0.0.1:9"\npoll_s = 0.2\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.recording.cli", "--device", DEVICE, "--config", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if sum("/dev/i2c-99 not found" in ln for ln in lines) >= 2:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=10)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    assert text.count("/dev/i2c-99 not found: enable I2C") >= 2  # reported, then retried
    assert "Traceback" not in text
    assert not (tmp_path / "state" / "dataset.segments").exists()  # nothing recorded, nothing written


def run_recorder_cli(cfg, state_dir) -> subprocess.CompletedProcess:
    cmd = [
        "-m",
        "edge.recording.cli",
        "--device",
        DEVICE,
        "--config",
        str(cfg),
        "--state-dir",
        str(state_dir),
    ]
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_cli_config_errors_exit_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[sensors]\nkind = "printer"\naccel = "adxl999"\n')
    out = run_recorder_cli(cfg, tmp_path)
    assert out.returncode == 2 and "sensors.accel" in out.stderr
    cfg.write_text("")
    out = run_recorder_cli(cfg, tmp_path)
    assert out.returncode == 2 and "no [sensors] table" in out.stderr


class LaggingContext:
    """Hands over each Moonraker sample one poll late, as a slow printer host or the poller
    thread does: by then the accelerometer has been read past the sample's time.  With a
    0.5 s poll the lag exceeds the ~0.3 s the ADXL345 driver's stuck-axis gate holds samples
    back (a Klipper stream holds none), so without the recorder's ordering the samples at the
    start of a print were forgotten before the sample opening its first layer came in."""

    def __init__(self, inner) -> None:
        self.inner, self.prev = inner, None

    def poll(self):
        sample, self.prev = self.prev, self.inner.poll()
        return sample if sample is not None else self.prev

    def status(self) -> dict:
        return self.inner.status()


def test_context_that_arrives_late_still_opens_the_first_layer_of_each_print(sim, tmp_path):
    from edge.recording.printer import build_context

    cfg = SensorsConfig(kind="printer", moonraker_url=sim["server"].url, poll_s=0.5, read_interval_s=0.05)
    rec = PrinterRecorder(
        DEVICE,
        tmp_path,
        cfg,
        clock=sim["clock"],
        bus_factory=lambda n: sim["bus"],
        context=LaggingContext(build_context(cfg, sim["clock"])),
    )
    end = sim["timeline"].end + 1.0
    rec.run(until=lambda: sim["clock"].t > end)
    assert {(r.job, r.layer) for r in rec.layers.rows} == {(s.job, s.layer) for s in sim["timeline"].segments}
    assert not rec.layers.dropped


def test_the_mpu6050_records_the_same_layers(sim, tmp_path):
    plans = sim["runs"]
    sigmas = {(p.job, p.layer): (p.sigma_ax, p.sigma_ay) for run in plans for p in run}
    _, bus = fake_printer_bus(sim["timeline"], sigmas, sim["clock"], chip="mpu6050")
    cfg = SensorsConfig(
        kind="printer", accel="mpu6050", moonraker_url=sim["server"].url, poll_s=0.05, test_fraction=0.0
    )
    rec = PrinterRecorder(DEVICE, tmp_path, cfg, clock=sim["clock"], bus_factory=lambda n: bus)
    end = sim["timeline"].end + 1.0
    rec.run(until=lambda: sim["clock"].t > end)
    train, _, meta = stored_rows(tmp_path)
    assert len(train) == 12 and meta["accel"] == "mpu6050" and meta["accel_hz"] == 200.0
    planned = [np.hypot(p.sigma_ax, p.sigma_ay) for run in plans for p in run]
    np.testing.assert_allclose(train.x[:, 0], planned, rtol=0.08)
