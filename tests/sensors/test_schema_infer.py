"""A feature schema inferred from a new sensor's recordings: names, kinds and ranges of its columns."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sensors.features import DEFAULT_SCHEMA, FeatureInputError, extract_batch
from sensors.features.infer import infer_schema

IMU = ("ax", "ay", "az", "gx", "gy", "gz")


def _signals(n_rec: int, n_ch: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n_ch, n)) for _ in range(n_rec)]


def test_imu_at_10hz_is_refused_by_the_default_schema_and_fits_the_inferred_one(caplog) -> None:
    signals = _signals(3, 6, 100)
    with pytest.raises(FeatureInputError):
        extract_batch(np.stack(signals), DEFAULT_SCHEMA.replace(channels=IMU), sample_rate=10.0)
    with caplog.at_level(logging.INFO, logger="sensors.features.infer"):
        choice = infer_schema(signals, 10.0, IMU)
    s = choice.schema
    assert (s.channels, s.sample_rate, s.level) == (IMU, 10.0, 3)  # the hand-written schema of the issue
    assert s == DEFAULT_SCHEMA.replace(channels=IMU, sample_rate=10, level=3)
    rows = extract_batch(np.stack(signals), s, sample_rate=10.0)
    assert rows.shape == (3, s.n_features) and np.isfinite(rows).all()
    said = [r.getMessage() for r in caplog.records if r.name == "sensors.features.infer"]
    assert len(said) == 1 and "level 3" in said[0] and "10 Hz" in said[0]
    status = choice.status()
    assert (
        status["level"] == 3 and status["channels"] == list(IMU) and status["schema_hash"] == s.schema_hash()
    )
    json.dumps(status)  # plain JSON types for the status file


def test_three_channels_of_4096_at_1khz_get_level_9_and_unnamed_channels() -> None:
    signals = _signals(2, 3, 4096)
    choice = infer_schema(signals, 1000.0)
    s = choice.schema
    assert (s.channels, s.sample_rate, s.level) == (("ch0", "ch1", "ch2"), 1000.0, 9)
    assert s.min_samples <= 4096 < (s.filter_length - 1) * 2 ** (s.level + 1)  # deepest the length allows
    assert np.isfinite(extract_batch(np.stack(signals), s, sample_rate=1000.0)).all()


def test_the_shortest_recording_sets_the_level() -> None:
    signals = [*_signals(1, 2, 4096), *_signals(1, 2, 100)]
    assert infer_schema(signals, 50.0).schema.level == 3


@pytest.mark.parametrize(
    ("signals", "rates", "says"),
    [
        (_signals(1, 3, 10), 10.0, "too short"),
        ([*_signals(1, 3, 100), *_signals(1, 2, 100)], 10.0, "channel counts"),
        (_signals(2, 3, 100), [10.0, 20.0], "different rates"),
        ([], 10.0, "no recordings"),
    ],
)
def test_recordings_that_fit_no_schema_say_why(signals, rates, says) -> None:
    with pytest.raises(FeatureInputError, match=says):
        infer_schema(signals, rates)


def _npy(folder: Path, name: str, data: np.ndarray, rate: float, channels: list[str]) -> Path:
    path = folder / f"{name}.npy"
    np.save(path, data)
    (folder / f"{name}.json").write_text(json.dumps({"channels": channels, "sample_rate": rate}))
    return path


def _cli(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sensors.features.infer", *map(str, files)],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=120,
        check=False,
    )


def test_cli_prints_the_schema_and_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    files = [_npy(tmp_path, f"imu{i}", s, 10.0, list(IMU)) for i, s in enumerate(_signals(2, 6, 100))]
    done = _cli(*files)
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    assert (schema["level"], schema["sample_rate"], schema["channels"]) == (3, 10.0, list(IMU))
    assert "level 3" in done.stderr
    short = _npy(tmp_path, "short", _signals(1, 6, 10)[0], 10.0, list(IMU))
    bad = _cli(short)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "too short" in bad.stderr
