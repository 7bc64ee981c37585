"""Label intake from operator/maintenance logs, and labelled feature rows end to end."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pytest

from sensors.features import DEFAULT_SCHEMA, FeatureSchema
from sensors.features.pipeline import labelled_rows
from sensors.sim.welder import WeldCondition, simulate_weld
from sensors.welding import FolderSourceConfig, LabelLog, LabelLogError, WatchedFolderSource, write_weld_file

LOG_CSV = """# maintenance log of welder L20-3
time,weld_id,tool,horn,anvil,surface,note
2024-05-01T08:00:00Z,,TC1,,,clean,new horn and anvil fitted
2024-05-01T10:00:00Z,,,,worn,,anvil knurl worn
,W0077,,,,contam,coupon dropped in cutting fluid
2024-05-01T13:00:00+02:00,,,damaged,,,crack seen on horn
"""


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_csv_log_labels_by_time_and_by_weld_id(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text(LOG_CSV)
    log = LabelLog.load(path)
    before = log.label("W0001", at("2024-05-01T07:59:59Z"))
    assert (before.horn, before.anvil, before.surface) == (None, None, None) and before.tool_class_m is None
    morning = log.label("W0002", at("2024-05-01T09:00:00Z"))
    assert (morning.tool_class_m, morning.tool_class_s, morning.surface) == ("TC1", "New", "clean")
    noon = log.label("W0003", at("2024-05-01T10:30:00Z"))
    assert noon.tool_class_m == "TC2" and noon.tool_class_s is None
    oily = log.label("W0077", at("2024-05-01T10:31:00Z"))
    assert oily.surface == "contaminated" and oily.tool_class_m == "TC2"
    # 13:00+02:00 is 11:00 UTC: horn damaged, anvil still worn
    late = log.label("W0004", at("2024-05-01T11:00:00Z"))
    assert (late.horn, late.anvil, late.complete) == ("damaged", "worn", True)


def test_jsonl_log_and_naive_times_in_a_given_zone(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [
        {"timestamp": "2024-05-01 08:00", "tool": "New", "surface": "polished"},
        {"timestamp": "2024-05-01 09:00", "horn": "worn", "anvil": "worn"},
        {"weld_id": "X9", "tool": "DMGD"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n# comment\n\n")
    log = LabelLog.load(path, assume_tz=timezone(timedelta(hours=-5)))
    assert log.label("a", at("2024-05-01T13:30:00Z")).tool_class_s == "New"  # 08:30 local
    assert log.label("b", at("2024-05-01T14:30:00Z")).tool_class_s == "Worn"
    assert log.label("X9", at("2024-05-01T13:30:00Z")).tool_class_s == "DMGD"


def test_invalid_entries_are_all_reported_with_line_numbers(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "time,tool,surface,horn\n"
        "2024-05-01T08:00:00Z,rusty,clean,\n"
        "yesterday,new,clean,\n"
        "2024-05-01T08:00:00Z,,,\n"
        "2024-05-01T08:00:00Z,new,,TC2\n"
        ",new,clean,\n"
    )
    with pytest.raises(LabelLogError) as err:
        LabelLog.load(path)
    text = str(err.value)
    assert text.startswith("5 invalid label entries")
    assert "line 2: unknown tool condition 'rusty'; use one of new, worn, damaged" in text
    assert "line 3: time 'yesterday' is not an ISO 8601 time" in text
    assert "line 4:" in text and "tool, horn, anvil, surface" in text
    assert "line 5: horn takes one state" in text
    assert "line 6:" in text and "weld_id" in text


def test_contradicting_weld_entries_and_bad_files(tmp_path):
    with pytest.raises(LabelLogError, match=r"W1 surface=polished .*surface=clean"):
        LabelLog.from_records(
            [{"weld_id": "W1", "surface": "clean"}, {"weld_id": "W1", "surface": "polished"}]
        )
    (tmp_path / "x.jsonl").write_text('{"weld_id": "W1", "tool": "new"}\n{oops\n[1, 2]\n')
    with pytest.raises(LabelLogError, match=r"line 2: .*JSON.*\n.*line 3: .*object"):
        LabelLog.load(tmp_path / "x.jsonl")
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(LabelLogError, match=r"use \.csv or \.jsonl"):
        LabelLog.load(tmp_path / "x.txt")


def test_folder_to_labelled_rows_end_to_end(tmp_path):
    """Exported welds + a maintenance log -> labelled 624-feature rows with the schema hash."""
    export = tmp_path / "export"
    export.mkdir()
    start = datetime(2024, 5, 1, 9, 0, tzinfo=UTC)
    conditions = [
        WeldCondition("new", "new", "clean", "Cu-Cu", 0.5),
        WeldCondition("new", "worn", "clean", "Cu-Cu", 0.5),
    ]
    for i, cond in enumerate(conditions):
        rec = simulate_weld(
            cond,
            np.random.default_rng(i),
            time_scale=0.3,
            weld_id=f"L20-{i}",
            started_at=start + timedelta(minutes=90 * i),
        )
        write_weld_file(rec, export / f"weld_{i}.npy")
        (export / f"weld_{i}.done").touch()
    (tmp_path / "log.csv").write_text(LOG_CSV)
    blip = simulate_weld(
        WeldCondition(weld_time=0.1), np.random.default_rng(9), time_scale=0.3, weld_id="blip"
    )
    with WatchedFolderSource(FolderSourceConfig(export, state_dir=tmp_path / "state")) as src:
        recs = src.read_all()
    rows = list(labelled_rows([*recs, blip], LabelLog.load(tmp_path / "log.csv")))
    assert [r.weld_id for r in rows] == ["L20-0", "L20-1"]  # the 30 ms blip is too short: skipped
    assert [r.target("tool_m") for r in rows] == ["TC1", "TC2"]
    assert [r.target("surface") for r in rows] == ["clean", "clean"]
    assert all(r.features.shape == (624,) and r.schema_hash == DEFAULT_SCHEMA.schema_hash() for r in rows)
    with pytest.raises(ValueError, match="outside the schema"):
        list(labelled_rows([blip], None, on_error="raise"))
    other = FeatureSchema(level=8)
    (row,) = labelled_rows(recs[:1], None, other)
    assert row.features.shape == (other.n_features,) and row.label.horn is None
