"""Inputs the fuzzer (checks.fuzz_decoders) found that once escaped their decoder's documented error type."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pytest

from sensors.welding.formats import read_weld_file, write_weld_file
from sensors.welding.labels import LabelLog, LabelLogError
from sensors.welding.recording import WeldDataError, WeldRecording


@pytest.fixture
def npy_weld(tmp_path):
    rec = WeldRecording(
        data=np.ones((2, 32)), channels=("power", "lvdt"), sample_rate=1000.0, weld_id="W1",
        started_at=datetime(2024, 5, 1, tzinfo=UTC), source="t", meta={}, min_sample_rate=1.0,
    )  # fmt: skip
    return write_weld_file(rec, tmp_path / "w.npy")


@pytest.mark.parametrize(
    "change",
    [{"channels": 1.5}, {"sample_rate": "x"}, {"sample_rate": {}}, {"scale": {"power": {}}}, {"scale": 3}],
)
def test_sidecar_fields_of_the_wrong_type_are_weld_data_errors(npy_weld, change):
    side = npy_weld.with_suffix(".json")
    side.write_text(json.dumps({**json.loads(side.read_text()), **change}))
    with pytest.raises(WeldDataError):
        read_weld_file(npy_weld, min_sample_rate=1.0)


def test_corrupt_npy_header_and_complex_arrays_are_weld_data_errors(npy_weld):
    raw = npy_weld.read_bytes()
    npy_weld.write_bytes(raw[:10] + b"{'descr': '<f8', (" + raw[28:])  # tokenize.TokenError in numpy
    with pytest.raises(WeldDataError):
        read_weld_file(npy_weld, min_sample_rate=1.0)
    np.save(npy_weld, np.ones((2, 8), np.complex64))
    with pytest.raises(WeldDataError, match="complex"):
        read_weld_file(npy_weld, min_sample_rate=1.0)


def test_non_utf8_files_are_documented_errors(npy_weld, tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_bytes(b"power,lvdt\n1,\xff2\n")
    with pytest.raises(WeldDataError, match="UTF-8"):
        read_weld_file(csv, min_sample_rate=1.0)
    npy_weld.with_suffix(".json").write_bytes(b'{"channels": "\xff"}')
    with pytest.raises(WeldDataError, match="UTF-8"):
        read_weld_file(npy_weld, min_sample_rate=1.0)
    for suffix in (".csv", ".jsonl"):
        log = tmp_path / f"labels{suffix}"
        log.write_bytes(b"time,tool\n2024-05-01T08:00:00Z,n\xe4w\n")
        with pytest.raises(LabelLogError, match="UTF-8"):
            LabelLog.load(log)


def klipper_source():
    from sensors.accel.klipper import KlipperAccelSource

    src = KlipperAccelSource("/nonexistent/klippy_uds", "adxl345", clock=lambda: 100.0)
    src._sub_id = 1  # as after connecting
    return src


@pytest.mark.parametrize(
    "frame",
    [
        b"[1]",  # JSON, not an object
        b'{"ioft_accel": "adxl345", "params": {"data": [], "errors": 3}}',  # counters only, no rows
        b'{"ioft_accel": "adxl345", "params": {"data": [[1, 2], [3]]}}',  # ragged
        b'{"ioft_accel": "adxl345", "params": {"data": [[1, 2, 3, 4]], "errors": "x"}}',
        b'{"ioft_accel": "adxl345", "params": {"data": [[' + b"9" * 400 + b", 2, 3, 4]]}}",  # past float
        b'{"ioft_accel": "adxl345", "params": {"data": [1, 2, 3, 4, 5, 6, 7, 8]}}',  # flat
    ],
)
def test_klipper_frames_that_once_raised_are_skipped_and_the_stream_goes_on(frame):
    from sensors.accel.klipper import TERMINATOR

    src = klipper_source()
    good = b'{"ioft_accel": "adxl345", "params": {"data": [[5.0, 1000, 0, 9806.65]]}}'
    batch = src.decode(frame + TERMINATOR + good + TERMINATOR)
    assert len(batch.t) == 1 and batch.xyz[0, 0] == pytest.approx(1.0)  # mm/s² -> m/s²
    if b"errors" not in frame:
        assert src.status()["malformed_frames"] == 1
