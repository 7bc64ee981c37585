"""edge-recorder on a welder: simulated welds exported into the watched folder the way a
monitoring system does, labelled from the maintenance log, stored as 624 DWT features."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from edge.config import SensorsConfig
from edge.dataset import load_dataset, save_dataset
from edge.recording.base import RecorderError, split_for
from edge.recording.welder import PENDING_FILE, WelderRecorder
from ioft_protocol.state import load_arrays
from sensors.features.dwt import extract_features
from sensors.features.schema import DEFAULT_SCHEMA
from sensors.sim.printer import VirtualClock
from sensors.sim.welder import GROUP_M_CLASSES, WeldCondition, simulate_weld
from sensors.welding.formats import read_weld_file, write_weld_file
from trainer_lite.data import Dataset

DEVICE = "welder2"
START = datetime(2026, 3, 2, 7, 0, tzinfo=UTC)


def export_weld(inbox, i: int, tool: str = "TC1"):
    """Simulate weld ``i`` with tool class ``tool`` and export it (NPY + sidecar, then ``.done``)."""
    horn, anvil = dict(GROUP_M_CLASSES)[tool]
    rec = simulate_weld(
        WeldCondition(horn, anvil, "clean", "Al-Cu", 0.5),
        np.random.default_rng(i),
        time_scale=0.3,
        weld_id=f"{DEVICE}-{i:05d}",
        started_at=START + timedelta(seconds=30 * i),
    )
    path = write_weld_file(rec, inbox / f"{rec.weld_id}.npy")
    path.with_name(path.name + ".done").touch()
    return rec.weld_id, path


def write_labels(log, entries) -> None:
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))


@pytest.fixture
def welder(tmp_path):
    inbox = tmp_path / "export"
    inbox.mkdir()
    labels = tmp_path / "maintenance.jsonl"
    cfg = SensorsConfig(
        kind="welder",
        weld_folder=str(inbox),
        label_log=str(labels),
        target="tool_m",
        test_fraction=0.0,
        poll_s=0.5,
    )
    return inbox, labels, cfg, tmp_path / "state"


def test_welds_become_labelled_feature_rows_with_the_schema_hash(welder):
    inbox, labels, cfg, state = welder
    tools = ["TC1", "TC2", "TC3", "TC4", "TC2"]
    exported = [export_weld(inbox, i, t) for i, t in enumerate(tools)]
    # the log labels the first four welds; the fifth is not in it yet
    write_labels(
        labels, [{"weld_id": wid, "tool": t} for (wid, _), t in zip(exported[:4], tools, strict=False)]
    )
    (inbox / "garbage.npy").write_bytes(b"not a weld")
    (inbox / "garbage.npy.done").touch()

    clock = VirtualClock()
    rec = WelderRecorder(DEVICE, state, cfg, clock=clock)
    rec.run(until=lambda: rec.steps >= 2)

    train, test, meta = load_dataset(state)
    assert meta["source"] == "record-welder"
    assert meta["schema_hash"] == DEFAULT_SCHEMA.schema_hash()
    assert meta["classes"] == ["TC1", "TC2", "TC3", "TC4"] and meta["target"] == "tool_m"
    assert train.x.shape == (4, 624) and len(test) == 0
    classes = meta["classes"]
    by_class = {classes[int(k)]: row for k, row in zip(train.y, train.x, strict=True)}
    for (_, path), tool in zip(exported[:4], tools, strict=False):
        expected = extract_features(read_weld_file(path), DEFAULT_SCHEMA)
        np.testing.assert_allclose(by_class[tool], expected, rtol=0, atol=0)
    assert train.y.dtype == np.int64
    # the unlabelled weld waits, persisted; the bad file was set aside, the loop went on
    arrays, pending = load_arrays(state / PENDING_FILE)
    assert [w["weld_id"] for w in pending["welds"]] == [exported[4][0]] and arrays["x"].shape == (1, 624)
    status = rec.status()
    assert status["folder"]["rejected"] == 1 and status["pending_welds"] == 1

    # The operator logs the fifth weld later; a new recorder process picks the label up.
    write_labels(labels, [{"weld_id": wid, "tool": t} for (wid, _), t in zip(exported, tools, strict=True)])
    export_weld(inbox, 5, "TC3")
    with labels.open("a") as fh:
        fh.write(json.dumps({"time": (START + timedelta(seconds=140)).isoformat(), "tool": "TC3"}) + "\n")
    rec2 = WelderRecorder(DEVICE, state, cfg, clock=clock)
    rec2.run(until=lambda: rec2.steps >= 2)
    train2, _, _ = load_dataset(state)
    assert len(train2) == 6  # no weld delivered twice (ledger), the pending one and the new one added
    np.testing.assert_array_equal(train2.x[:4], train.x)
    assert [classes[int(k)] for k in train2.y[4:]] == ["TC2", "TC3"]
    _, pending2 = load_arrays(state / PENDING_FILE)
    assert pending2["welds"] == []


def test_welder_split_by_weld_hash(welder):
    inbox, labels, cfg, state = welder
    cfg = SensorsConfig(**{**cfg.__dict__, "test_fraction": 0.5})
    exported = [export_weld(inbox, i, "TC1") for i in range(6)]
    write_labels(labels, [{"time": START.isoformat(), "tool": "TC1"}])  # a state change: holds for all
    rec = WelderRecorder(DEVICE, state, cfg, clock=VirtualClock())
    rec.run(until=lambda: rec.steps >= 1)
    train, test, _ = load_dataset(state)
    assert len(train) + len(test) == 6 and len(train) >= 1
    # Welds arrive oldest first; the first one trains (the train split is empty), the rest by hash.
    ids = [wid for wid, _ in exported]
    assert len(test) == sum(split_for(DEVICE, wid, 0.5) == "test" for wid in ids[1:])


def test_refuses_a_dataset_of_another_schema(welder):
    _, _, cfg, state = welder
    d = Dataset(np.zeros((2, 624)), np.zeros(2, dtype=np.int64))
    meta = {
        "source": "record-welder",
        "schema_hash": "0" * 64,
        "target": "tool_m",
        "classes": ["TC1", "TC2", "TC3", "TC4"],
    }
    save_dataset(state, d, d, meta)
    with pytest.raises(RecorderError, match="feature schema"):
        WelderRecorder(DEVICE, state, cfg, clock=VirtualClock())


def test_a_missing_folder_is_retried_not_fatal(welder):
    inbox, _, cfg, state = welder
    cfg = SensorsConfig(**{**cfg.__dict__, "weld_folder": str(inbox / "not-mounted")})
    rec = WelderRecorder(DEVICE, state, cfg, clock=VirtualClock())
    rec.run(until=lambda: rec.steps >= 3)
    assert rec.loop_errors == 0 and rec.status()["folder"]["ready"] is False
    assert load_dataset(state) is None


def test_a_wearing_tool_and_its_lagging_log_off_the_real_clock(tmp_path):
    """``SimulatedWelder.weld_run`` (what the export thread paces and the demo replays): new tool
    before ``wear_from``, worn from it (``wear_welds=1``), each label landing ``lag`` welds later."""
    from edge.recording.simulate import SimulatedWelder

    sim = SimulatedWelder(
        DEVICE, tmp_path, 7, 1.0, wear_from=3, wear_welds=1, label_lag_h=1.0, sim_weld_min=20
    )
    welds = list(sim.weld_run("r", START))
    assert [w.tool for w in welds] == ["TC1"] * 3 + ["TC4"] * 4
    assert [w.recording.weld_id for w in welds] == [f"{DEVICE}-r-{i:03d}" for i in range(7)]
    # One simulated hour is 3 welds: weld i's label lands with weld i + 3, the last 3 not in this run.
    assert [[e["weld_id"] for e in w.landed] for w in welds] == [[], [], []] + [
        [f"{DEVICE}-r-{i:03d}"] for i in range(4)
    ]
    assert [e["tool"] for w in welds for e in w.landed] == ["TC1"] * 3 + ["TC4"]
    assert not list(tmp_path.iterdir())  # nothing written: the thread exports, not the run
