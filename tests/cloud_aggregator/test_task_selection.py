"""A task's ``devices`` selection: validated at config time, one rule on both sides of the wire."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cloud_aggregator.config import TaskConfig
from cloud_aggregator.serve.mqtt_fleet import DeviceRoster
from ioft_protocol.round_messages import Announcement, DeviceSelection

TASK = {"name": "tool", "algorithm": "fedavg", "model": "mlp", "model_args": {"sizes": [624, 4]}}


def test_an_unknown_kind_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "aggregator.toml"
    cfg.write_text(
        'fleet = "f"\nallow_plaintext = true\n[[task]]\nname = "tool"\nalgorithm = "fedavg"\n'
        'model = "mlp"\nmodel_args = { sizes = [624, 4] }\ndevices = { kind = "laser" }\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "cloud_aggregator.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "devices.kind" in lines[0] and "'printer', 'welder'" in lines[0]


@pytest.mark.parametrize("bad", [{"kind": "laser"}, {"tags": ["Line A"]}, {"ids": ["welder 1"]}])
def test_a_bad_selection_is_refused_at_config_time(bad):
    with pytest.raises(ValueError):
        TaskConfig(**TASK, devices=DeviceSelection(**bad))


def test_selection_rules():
    sel = DeviceSelection("welder", ("line-a",), ())
    assert sel.refusal("w1", "welder", ["line-a", "x"]) is None
    assert "kind 'welder'" in sel.refusal("p1", "printer", ["line-a"])
    assert "no kind" in sel.refusal("d1", None, [])
    assert "lacks ['line-a']" in sel.refusal("w2", "welder", [])
    assert "only" in DeviceSelection(ids=("w1",)).refusal("w2", "welder", [])


def test_the_selection_travels_in_the_announcement_and_is_left_out_when_none():
    base = dict(fleet="f", task="tool", round=1, phase="train", spec="{}", deadline=1.0, global_hash="h")
    sel = DeviceSelection("welder", ("line-a",), ("w1",))
    assert Announcement.decode(Announcement(**base, devices=sel).encode()).devices == sel
    assert Announcement.decode(Announcement(**base).encode()).devices is None


def test_the_fleet_view_judges_from_the_status():
    view = DeviceRoster()
    view.status = {
        "p1": {"state": "online", "kind": "printer", "tags": []},
        "w1": {"state": "online", "kind": "welder", "refused": {"speed": "624 features"}},
        "w2": {"state": "online", "kind": "welder", "tags": "junk"},
    }
    sel = DeviceSelection("welder")
    assert view.refusal("p1", "tool", sel).startswith("task runs on kind")
    assert view.refusal("w1", "tool", sel) is None and view.refusal("w2", "tool", sel) is None
    assert view.refusal("w1", "speed", None) == "624 features"


# -- held-out devices ([[task]] holdout) -----------------------------------------------------------
def test_a_bad_holdout_id_is_refused_at_config_time():
    with pytest.raises(ValueError, match="holdout"):
        TaskConfig(**TASK, holdout=("welder 1",))


def test_held_out_devices_travel_in_the_announcement_and_never_take_part():
    ann = Announcement("f", "tool", 3, "train", "{}", 0.0, "h" * 64, holdout=("w2",))
    back = Announcement.decode(ann.encode())
    assert back.holdout == ("w2",)
    assert not back.takes_part("w2") and back.takes_part("w1")
    assert (
        Announcement.decode(Announcement("f", "tool", 3, "train", "{}", 0.0, "h" * 64).encode()).holdout == ()
    )


@pytest.mark.parametrize(
    "junk", [None, [], "x", {"round": "3"}, {"round": 3, "phase": "train", "global_hash": "h", "metrics": 1}]
)
def test_a_malformed_holdout_score_in_a_status_is_no_score(junk):
    from cloud_aggregator.rounds.types import CollectRequest
    from trainer_lite.task import TaskSpec

    view = DeviceRoster(status={"w2": {"state": "online", "holdout": {"tool": junk}}})
    req = CollectRequest(TaskSpec("tool", "fedavg", "mlp"), 3, "train", {}, "h", {}, {})
    assert view.holdout_score("w2", "tool", req) is None


def test_only_a_score_of_the_rounds_own_global_counts():
    from cloud_aggregator.rounds.types import CollectRequest
    from ioft_protocol.round_messages import HoldoutScore
    from trainer_lite.task import TaskSpec

    score = HoldoutScore(3, "train", "h", {"loss": 0.5, "note": "x"}).to_json()  # type: ignore[dict-item]
    view = DeviceRoster(status={"w2": {"state": "online", "holdout": {"tool": score}}})
    spec = TaskSpec("tool", "fedavg", "mlp")
    assert view.holdout_score("w2", "tool", CollectRequest(spec, 3, "train", {}, "h", {}, {})) == {
        "loss": 0.5
    }
    assert view.holdout_score("w2", "tool", CollectRequest(spec, 4, "train", {}, "h", {}, {})) is None
    assert view.holdout_score("w2", "tool", CollectRequest(spec, 3, "train", {}, "other", {}, {})) is None
