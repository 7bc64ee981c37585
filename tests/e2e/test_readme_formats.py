"""The README's format and task-option examples work as written: each
fenced block headed ``# README example: NAME`` is read by the code that reads it on a device
or on the aggregator."""

from __future__ import annotations

import re
import tomllib
from datetime import UTC, datetime
from pathlib import Path

from cloud_aggregator.config import AggregatorConfig
from edge.config import DeviceConfig
from ioft_protocol.config import build
from sensors.welding.formats import read_weld_file
from sensors.welding.labels import LabelLog

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = (DOCS / "formats.md", DOCS / "watching.md")  # moved from README.md


def example(name: str) -> str:
    text = "".join(page.read_text() for page in PAGES)
    blocks = re.findall(r"```[a-z]*\n# (?:README )?example: (\S+)\n(.*?)```", text, re.S)
    found = {n: body for n, body in blocks}
    assert name in found, sorted(found)
    return found[name]


def test_the_device_toml_example_limits_tasks_and_algorithms():
    cfg = build(DeviceConfig, tomllib.loads(example("device.toml")), "README device.toml")
    assert cfg.tasks == ["tool", "tool-head"] and cfg.algorithms == ["fedavg"]


def test_the_serve_example_is_a_device_config():
    cfg = build(
        DeviceConfig, {"device": "welder2", **tomllib.loads(example("serve.toml"))}, "README serve.toml"
    )
    assert cfg.serve.tasks == ["tool"] and cfg.serve.margin == 0.05


def test_the_alerts_example_is_a_device_config():
    cfg = build(
        DeviceConfig, {"device": "welder2", **tomllib.loads(example("alerts.toml"))}, "README alerts.toml"
    )
    assert [r.name for r in cfg.serve.alerts] == ["worn_tool", "shaky_layers"]
    assert cfg.serve.vibration_budget == 0.8 and cfg.serve.alerts[0].clear_at == 0.5


def test_the_head_task_example_validates_on_the_aggregator():
    text = 'fleet = "plant-a"\nallow_plaintext = true\n' + example("head-task.toml")
    cfg = build(AggregatorConfig, tomllib.loads(text), "README head task")
    (task,) = cfg.task
    assert task.spec().hparams["features"] == "onnx:weld-base"


def test_the_weld_csv_example_reads(tmp_path):
    path = tmp_path / "L20-000123.csv"
    path.write_text(example("L20-000123.csv"))
    weld = read_weld_file(path)
    assert weld.weld_id == "L20-000123" and weld.sample_rate == 200_000
    assert list(weld.channels) == ["power", "lvdt", "ae", "mic"]


def test_the_label_log_example_labels_welds(tmp_path):
    path = tmp_path / "maintenance.csv"
    path.write_text(example("maintenance.csv"))
    log = LabelLog.load(path)
    early = log.label("L20-000001", datetime(2024, 5, 1, 9, 0, tzinfo=UTC))
    assert (early.horn, early.anvil, early.surface) == ("new", "new", "clean")
    later = log.label("L20-000002", datetime(2024, 5, 1, 11, 30, tzinfo=UTC))
    assert (later.horn, later.anvil, later.surface) == ("worn", "new", "contaminated")
    own = log.label("L20-000123", datetime(2024, 5, 1, 11, 30, tzinfo=UTC))
    assert own.surface == "polished" and own.tool_class_m == "TC3"
