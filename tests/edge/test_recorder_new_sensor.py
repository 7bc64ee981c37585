"""A new sensor without code (issue 33 §5): a folder of a 6-channel IMU's 10 Hz recordings (BasicMotions,
``tests/sensors/data/basicmotions``) -> ``edge-recorder schema`` infers, shows and saves the schema ->
``[sensors] schema`` records rows with it in a real ``edge-recorder`` process, whose status reports it ->
an aggregator ``[[task]] feature_schema`` names the same file and gets the same hash."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud_aggregator.config import TaskConfig
from edge.config import SensorsConfig
from edge.dataset import load_dataset
from edge.recording.base import STATUS_FILE
from ioft_protocol.config import ConfigError, build
from sensors.features.schema import FeatureSchema

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "sensors" / "data" / "basicmotions"
IMU = ["acc_x", "acc_y", "acc_z", "gyr_x", "gyr_y", "gyr_z"]
# The recorder's label vocabulary is still the welder's (tool_m: TC1..TC4); the operator's log maps
# each activity onto one of its four classes.
CLASS = {"standing": "TC1", "walking": "TC2", "running": "TC3", "badminton": "TC4"}


def recorder(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge.recording.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def test_edge_recorder_schema_infers_shows_and_saves_the_imu_schema(tmp_path):
    saved = tmp_path / "schema.json"
    out = recorder("schema", "--from", str(DATA), "--save", str(saved))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    shown = json.loads(out.stdout)
    assert shown["channels"] == IMU and shown["sample_rate"] == 10.0 and shown["level"] == 3
    schema = FeatureSchema.from_json(saved.read_text())
    assert schema.to_json() == out.stdout.strip()
    # one line of what was chosen and why, one of where to use it
    assert "8 recording(s) of 6 channel(s)" in out.stderr and schema.schema_hash() in out.stderr

    bad = recorder("schema", "--from", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("cannot infer a feature schema:")


@pytest.mark.parametrize("setting", ["file", "infer"])
def test_edge_recorder_stores_rows_of_a_10hz_imu_with_the_schema_it_is_given(tmp_path, setting):
    inbox = tmp_path / "imu-export"
    shutil.copytree(DATA, inbox, ignore=shutil.ignore_patterns("*.md"))
    names = sorted(p.stem for p in inbox.glob("*.csv"))
    labels = tmp_path / "activities.jsonl"
    labels.write_text(
        "".join(json.dumps({"weld_id": n, "tool": CLASS[n.split("-")[0]]}) + "\n" for n in names)
    )
    if setting == "file":  # the operator's two steps: save the schema beside device.toml, name it
        assert recorder("schema", "--from", str(inbox), "--save", str(tmp_path / "imu.json")).returncode == 0
        schema_line = 'schema = "imu.json"'  # relative to device.toml's folder
    else:
        schema_line = 'schema = "infer"'
    toml = tmp_path / "device.toml"
    toml.write_text(
        f'[sensors]\nkind = "welder"\nweld_folder = "{inbox}"\nlabel_log = "{labels}"\n'
        f"{schema_line}\nsettle_s = 0\ntest_fraction = 0.0\npoll_s = 0.1\nstatus_every_s = 0.2\n"
    )
    state = tmp_path / "state"
    cmd = ["--device", "imu1", "--config", str(toml), "--state-dir", str(state)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge.recording.cli", *cmd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90  # a guard only: the test waits for rows, not for a time
        rows = 0
        while rows < len(names) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            loaded = load_dataset(state)  # None until the first rows are written
            rows = 0 if loaded is None else len(loaded[0]) + len(loaded[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    train, test, meta = load_dataset(state)
    assert len(train) + len(test) == len(names), err[-3000:]
    want = FeatureSchema.from_json(recorder("schema", "--from", str(DATA)).stdout)
    assert meta["schema_hash"] == want.schema_hash() and train.x.shape[1] == want.n_features == 288
    assert sorted(train.y.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    status = json.loads((state / STATUS_FILE).read_text())["schema"]
    assert status["channels"] == IMU and status["sample_rate"] == 10.0
    assert status["schema_hash"] == want.schema_hash()
    assert status["source"] == {"file": "file", "infer": "inferred"}[setting]


def test_without_a_schema_the_10hz_recordings_are_refused_by_the_weld_reader(tmp_path):
    from edge.recording.welder import WelderRecorder

    inbox = tmp_path / "imu-export"
    shutil.copytree(DATA, inbox, ignore=shutil.ignore_patterns("*.md"))
    cfg = SensorsConfig(kind="welder", weld_folder=str(inbox), label_log=str(tmp_path / "l.csv"), settle_s=0)
    rec = WelderRecorder("imu1", tmp_path / "state", cfg)
    rec.run(until=lambda: rec.steps >= 2)
    assert rec.status()["folder"]["rejected"] == 8 and rec.status()["schema"]["source"] == "default"


def test_a_schema_setting_that_cannot_be_used_is_one_line(tmp_path):
    toml = tmp_path / "device.toml"
    empty = tmp_path / "empty"
    empty.mkdir()
    for setting, said in (('"missing.json"', "missing.json"), ('"infer"', "no recordings")):
        toml.write_text(
            f'[sensors]\nkind = "welder"\nweld_folder = "{empty}"\nlabel_log = "{tmp_path / "l.csv"}"\n'
            f"schema = {setting}\n"
        )
        out = recorder("--device", "imu1", "--config", str(toml), "--state-dir", str(tmp_path / "s"))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert said in out.stderr.strip().splitlines()[-1]
    with pytest.raises(ConfigError, match="for kind = 'welder'"):
        build(SensorsConfig, {"kind": "printer", "schema": "infer"}, "device.toml")


def task(feature_schema: str) -> TaskConfig:
    return TaskConfig(
        name="activity",
        algorithm="fedavg",
        model="mlp",
        model_args={"sizes": [288, 8, 4]},
        feature_schema=feature_schema,
    )


def test_a_task_names_the_schema_by_its_file_or_its_hash(tmp_path):
    saved = tmp_path / "schema.json"
    assert recorder("schema", "--from", str(DATA), "--save", str(saved)).returncode == 0
    digest = FeatureSchema.from_json(saved.read_text()).schema_hash()
    assert task(str(saved)).spec().feature_schema == digest
    assert task(digest).spec().feature_schema == digest
    (tmp_path / "broken.json").write_text('{"name": "something else"}')
    for bad, said in (
        (str(tmp_path / "nowhere.json"), "nowhere.json"),
        (str(tmp_path / "broken.json"), "not a saved feature schema"),
        ("imu-schema", "neither a sha256"),
    ):
        with pytest.raises(ValueError, match=said) as info:
            task(bad)
        assert "\n" not in str(info.value)
    # the aggregator itself: refused at start, one line, before it connects anywhere
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(
        'fleet = "f"\nallow_plaintext = true\n[[task]]\nname = "activity"\nalgorithm = "fedavg"\n'
        f'model = "mlp"\nmodel_args = {{ sizes = [288, 4] }}\nfeature_schema = "{tmp_path / "broken.json"}"\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "not a saved feature schema" in lines[0], out.stderr
