"""Simulated datasets: a printer or welder played through the same intake path a Pi runs.

Each creates a device's whole dataset once, seeded by its id, for ``[data] source`` =
``"simulate-printer"``, ``"simulate-printer-raw"`` or ``"simulate-welder"``
(:func:`edge.dataset.prepare_dataset`).  The simulators and drivers (``sensors``) load only
when one is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.config import DataConfig
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset

#: The paper's accelerometers ran at 227 Hz; an ADXL345 offers 200 Hz as the nearest rate.
SIM_ACCEL_HZ = 227.0


def _fake_adxl345(stream, clock):
    """The real ADXL345 driver on a fake I2C bus whose chip plays ``stream`` on ``clock``."""
    from sensors.accel.adxl345 import Adxl345
    from sensors.sim.i2c_bus import FakeAdxl345, FakeI2cBus

    bus = FakeI2cBus(FakeAdxl345(stream, clock))
    # ±4 g: a print head's few m/s² of vibration plus gravity on z, with room for peaks.
    return Adxl345(bus, rate_hz=SIM_ACCEL_HZ, range_g=4, clock=clock)


def simulated_printer_dataset(device: str, cfg: DataConfig) -> tuple[Dataset, Dataset, dict]:
    """A simulated printer that has printed at only ``cfg.train_speeds`` speed settings.

    Every layer goes through the path a Pi runs: the simulator's vibration stream feeds
    a fake ADXL345 on a fake I2C bus, the real driver reads its FIFO, and the
    LayerRecorder turns the samples and the simulated printer context into per-layer
    rows (speed, sigma_ax, sigma_ay) -- all in virtual time, nothing sleeps.

    The test split is every other setting: the model must generalise to speeds
    this printer never ran, which is where borrowing the fleet's curve pays off.
    """
    from sensors.accel.adxl345 import nearest_rate
    from sensors.layers import to_xy
    from sensors.sim.printer import SPEED_SETTINGS, device_seed, job_name, plan_fleet_member, record_runs

    plans = plan_fleet_member(device, seed=cfg.seed)
    rng = derive_rng(cfg.seed, device, "train-speeds")
    k = min(max(1, cfg.train_speeds), len(SPEED_SETTINGS) - 1)
    # One setting from each of k equal bands of the speed range: every printer has
    # seen slow, middle and fast printing, but only a few runs of each.
    bands = np.array_split(np.array(SPEED_SETTINGS), k)
    train_speeds = sorted(int(rng.choice(band)) for band in bands)
    rate = nearest_rate(SIM_ACCEL_HZ)
    tables, dropped = record_runs(
        [plans[s] for s in SPEED_SETTINGS],
        _fake_adxl345,
        rate_hz=rate,
        rng=np.random.default_rng(device_seed(device, cfg.seed) ^ 0xACCE1),
    )
    train = np.concatenate([tables[job_name(s)] for s in train_speeds])
    test = np.concatenate([tables[job_name(s)] for s in SPEED_SETTINGS if s not in train_speeds])
    meta = {
        "source": "simulate-printer",
        "train_speeds": train_speeds,
        "seed": cfg.seed,
        "path": "FakeAdxl345/FakeI2cBus -> Adxl345 -> LayerRecorder",
        "accel_hz": rate,
        "dropped_layers": dropped,
    }
    return Dataset(*to_xy(train)), Dataset(*to_xy(test)), meta


def live_printer_plan(
    device: str, history: dict, k: int, layers: int
) -> tuple[str, list[tuple[float, float, float]]] | None:
    """The ``k``-th live print (0-based) of the simulated printer ``device`` whose seeded history
    ``history`` (the dataset's metadata) describes: its job name and each layer's ``(speed,
    sigma_ax, sigma_ay)``, a run of the same machine at its training settings in turn, so that a
    rehearsal records on where its history left off.  ``None`` without such a history."""
    from sensors.sim.printer import device_seed, plan_run, profile_for

    settings = history.get("train_speeds")
    if history.get("source") != "simulate-printer" or not settings:
        return None
    seed = int(history.get("seed", 0))
    setting = int(settings[k % len(settings)])
    rng = np.random.default_rng([device_seed(device, seed), 0x11FE, k])
    run = plan_run(profile_for(device, seed), setting, rng, layers)
    return f"live_speed{setting}.gcode", [(p.speed, p.sigma_ax, p.sigma_ay) for p in run]


def simulated_printer_raw_dataset(device: str, cfg: DataConfig) -> tuple[Dataset, Dataset, dict]:
    """Raw 2-axis vibration windows, one per printed layer, with the speed as target.

    Rows are windows flattened axis-major (``sensors.sim.vibration``); the target is
    ``speed / 50`` as in the per-layer task.  A seeded quarter of the layers is held out.
    """
    from sensors.layers import SPEED_SCALE
    from sensors.sim.vibration import WINDOW_SCHEMA, simulate_windows

    windows, speed, _ = simulate_windows(device, seed=cfg.seed)
    x = windows.reshape(len(windows), -1)
    y = (speed / SPEED_SCALE)[:, None]
    order = derive_rng(cfg.seed, device, "raw-split").permutation(len(x))
    n_test = max(1, round(TEST_FRACTION * len(x)))
    test_idx, train_idx = order[:n_test], order[n_test:]
    meta = {
        "source": "simulate-printer-raw",
        "schema_hash": WINDOW_SCHEMA.schema_hash(),
        "window_shape": list(WINDOW_SCHEMA.shape),
        "seed": cfg.seed,
    }
    return Dataset(x[train_idx], y[train_idx]), Dataset(x[test_idx], y[test_idx]), meta


#: Welds a simulated welder records before it first trains, and the share held out for testing.
SIM_WELDS = 48
TEST_FRACTION = 0.25


def simulated_welder_dataset(state_dir: Path, device: str, cfg: DataConfig) -> tuple[Dataset, Dataset, dict]:
    """A simulated welder of FTL-TP's domain group M or S, through the real intake path.

    The simulator exports each weld into the device's inbox the way a welder's
    monitoring system does (NPY + sidecar + ``.done`` marker) and the maintenance log
    gets each weld's tool (and surface) condition; then the watched-folder source picks
    the welds up, the DWT features are extracted and the log labels them, exactly as on
    a Pi.  Group M (``cfg.welder_group``): one material pair and weld time per device,
    targets TC1-TC4 (horn/anvil new or worn).  Group S: Cu-Cu at one surface condition
    per device, targets New/Worn/DMGD.
    """
    import json
    from datetime import UTC, datetime, timedelta

    from sensors.features.pipeline import labelled_rows
    from sensors.sim.welder import (
        GROUP_M_CLASSES,
        GROUP_M_DOMAINS,
        GROUP_S_CLASSES,
        GROUP_S_DOMAINS,
        GROUP_S_MATERIAL,
        GROUP_S_TIME,
        WeldCondition,
        simulate_weld,
    )
    from sensors.welding.folder import FolderSourceConfig, WatchedFolderSource
    from sensors.welding.formats import write_weld_file
    from sensors.welding.labels import LabelLog

    rng = derive_rng(cfg.seed, device, "welds")
    if cfg.welder_group == "M":
        class_table, target, surface = GROUP_M_CLASSES, "tool_m", "clean"
        material, weld_time = GROUP_M_DOMAINS[int(rng.integers(len(GROUP_M_DOMAINS)))]
    else:
        class_table, target, material, weld_time = GROUP_S_CLASSES, "tool_s", GROUP_S_MATERIAL, GROUP_S_TIME
        surface = GROUP_S_DOMAINS[int(rng.integers(len(GROUP_S_DOMAINS)))]
    inbox = state_dir / "weld-inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    start = datetime(2026, 1, 5, 6, 0, tzinfo=UTC)
    log_lines = []
    for i in range(SIM_WELDS):
        name, (horn, anvil) = class_table[i % len(class_table)]
        rec = simulate_weld(
            WeldCondition(horn, anvil, surface, material, weld_time),
            derive_rng(cfg.seed, device, "weld", i),
            time_scale=0.3,
            weld_id=f"{device}-{i:05d}",
            started_at=start + timedelta(seconds=30 * i),
        )
        path = write_weld_file(rec, inbox / f"{rec.weld_id}.npy")
        path.with_name(path.name + ".done").touch()
        log_lines.append(json.dumps({"weld_id": rec.weld_id, "tool": name, "surface": surface}))
    (state_dir / "maintenance.jsonl").write_text("\n".join(log_lines) + "\n")
    with WatchedFolderSource(FolderSourceConfig(inbox, state_dir=state_dir / "weld-ledger")) as source:
        recordings = source.read_all()
    rows = list(labelled_rows(recordings, LabelLog.load(state_dir / "maintenance.jsonl")))
    classes = [c for c, _ in class_table]
    x = np.stack([r.features for r in rows])
    y = np.array([classes.index(r.target(target)) for r in rows], dtype=np.int64)
    order = rng.permutation(len(rows))
    n_test = max(1, round(TEST_FRACTION * len(rows)))
    test_idx, train_idx = order[:n_test], order[n_test:]
    meta = {
        "source": "simulate-welder",
        "group": cfg.welder_group,
        "target": target,  # as edge-recorder writes it: --simulate's live welder appends to these rows
        "surface": surface,
        "material": material,
        "weld_time": weld_time,
        "classes": classes,
        "schema_hash": rows[0].schema_hash,
        "seed": cfg.seed,
    }
    return Dataset(x[train_idx], y[train_idx]), Dataset(x[test_idx], y[test_idx]), meta
