"""``fleet status``: one device's malformed retained status never breaks the others' rows."""

from __future__ import annotations

import json

import pytest

from cloud_aggregator.console.fleet_status import decode_status, format_table, summarize

GOOD = {
    "device": "printer1",
    "state": "online",
    "time": 1000.0,
    "tasks": {"speed": {"round": 4, "metrics": {"test_loss": 0.25, "train_loss": 0.5}}},
    "models": {
        "enc": {
            "active": 3,
            "transfer": {"version": 4, "have": 2, "of": 9},
            "rejected": [{"version": 2, "reason": "bad signature", "time": 1.0}],
        }
    },
}


def test_a_good_status_reads_as_before():
    (row,) = summarize({"printer1": GOOD})
    assert row == {
        "device": "printer1",
        "state": "online",
        "kind": "-",
        "models": "enc v3 (fetching v4: 2/9) [refused v2: bad signature]",
        "tasks": "speed: round 4 test_loss=0.2500",
        "data": "-",
        "since": 1000.0,
    }
    assert "10 s" in format_table([row], now=1010.0)


BAD = [
    {"models": [1]},
    {"models": {"x": 5}},
    {"models": "enc"},
    {"models": {"x": {"active": [1], "transfer": 7, "rejected": {"a": 1}}}},
    {"models": {"x": {"transfer": {"version": "v", "have": None}, "rejected": [1]}}},
    {"models": {"x": {"rejected": [{"reason": 5, "version": {}}]}}},
    {"tasks": [1, 2]},
    {"tasks": {"speed": 5}},
    {"tasks": {"speed": {"metrics": {"test_loss": "0.1"}}}},
    {"tasks": {"speed": {"metrics": {"test_loss": None, "train_loss": 1}}}},
    {"tasks": {"speed": {"metrics": {"test_loss": 10**400}}}},
    {"tasks": {"speed": {"metrics": [1], "round": "x"}}},
    {"state": {"a": 1}, "time": "yesterday"},
    {"time": 10**400},
    {"time": float("nan")},
    {"state": "\x1b[2Jonline\x07"},
    {"data": [1]},
    {"data": {"train": "many", "sensor": 5}},
    {"data": {"sensor": {"state": ["x"], "running": "no"}}},
    {"refused": ["tool"]},
    {"refused": {"tool": 5}, "tasks": "x"},
    [1, 2],
    "online",
    None,
]


@pytest.mark.parametrize("bad", BAD, ids=[json.dumps(b, default=str)[:40] for b in BAD])
def test_a_malformed_status_shows_question_marks_and_spares_the_other_rows(bad):
    rows = summarize({"printer0": bad, "printer1": GOOD})
    assert [r["device"] for r in rows] == ["printer0", "printer1"]
    assert rows[1]["models"].startswith("enc v3") and rows[1]["tasks"].startswith("speed: round 4")
    table = format_table(rows, now=2000.0)
    assert "\x1b" not in table and "\x07" not in table
    assert rows[0]["since"] is None or isinstance(rows[0]["since"], float)


def test_what_the_question_marks_stand_for():
    rows = summarize(
        {
            "a": {"models": [1], "tasks": {"speed": 5}, "state": 3},
            "b": {"models": {"x": 5}, "tasks": {"speed": {"round": 2, "metrics": {"test_loss": "low"}}}},
        }
    )
    assert (rows[0]["models"], rows[0]["tasks"], rows[0]["state"]) == ("?", "speed: ?", "?")
    assert (rows[1]["models"], rows[1]["tasks"]) == ("x ?", "speed: round 2 test_loss=?")


@pytest.mark.parametrize("payload", [b"[" * 100_000, b"[1]", b'"online"', b"\xff", b"{"])
def test_decode_status_refuses_what_is_not_an_object_with_value_error(payload):
    """collect_status skips such a status with a warning; deep nesting was RecursionError."""
    with pytest.raises(ValueError):
        decode_status(payload)


def test_decode_status_reads_objects_and_empty_payloads():
    assert decode_status(b"") is None and decode_status(json.dumps(GOOD).encode()) == GOOD


def test_local_data_and_refused_tasks_are_shown():
    (row,) = summarize(
        {
            "welder2": {
                **GOOD,
                "refused": {"tool": "feature schema 0123abcd differs from this device's"},
                "data": {"train": 40, "test": 8, "source": "record-welder", "sensor": {"state": "fault"}},
            }
        }
    )
    assert (
        row["tasks"].startswith("tool: refused (feature schema 0123abcd") and "speed: round 4" in row["tasks"]
    )
    assert row["data"] == "40/8 rows, sensor fault"
    stopped = summarize({"p": {"data": {"train": 3, "test": 1, "sensor": {"state": "ok", "running": False}}}})
    assert stopped[0]["data"] == "3/1 rows, sensor ok (recorder stopped)"
    assert "local data" in format_table([row], now=1010.0)


def test_a_long_reason_is_shown_whole_or_cut_between_words():
    """A refusal reason once came out cut mid-word at 60 characters ("...the mod"): a sentence gets
    room, and anything cut ends at a word boundary with an ellipsis."""
    reason = "feature schema 0123abcd differs from this device's 89ef4567; re-record with the task's schema"
    (row,) = summarize({"welder2": {**GOOD, "refused": {"tool": reason}}})
    assert f"tool: refused ({reason})" in row["tasks"]
    long = " ".join(["word"] * 80)  # 399 characters
    (row,) = summarize({"welder2": {**GOOD, "refused": {"tool": long}}})
    shown = row["tasks"].split("refused (", 1)[1].split(")", 1)[0]
    assert shown.endswith("…") and len(shown) <= 200
    assert all(w == "word" for w in shown.removesuffix("…").split())
