"""Config schemas list every failing field at once."""

from __future__ import annotations

import pytest

from cloud_aggregator.config import AggregatorConfig
from edge.cli import config_from_args, parse_args
from edge.config import ConfigError, DeviceConfig, build, load_toml


def test_every_error_is_listed():
    with pytest.raises(ConfigError) as info:
        build(DeviceConfig, {"device": "printer1", "keepalive": "x", "bogus": 1, "data": {"source": "zz"}})
    text = str(info.value)
    assert "keepalive: expected int" in text and "bogus: unknown field" in text and "data.source" in text
    assert len(info.value.errors) == 3


def test_cli_overrides_toml(tmp_path):
    cfg = tmp_path / "d.toml"
    cfg.write_text('fleet = "plant"\nbroker = "mqtt://a:1"\n[data]\nseed = 4\n')
    args = parse_args(
        ["--device", "printer3", "--config", str(cfg), "--broker", "mqtt://b:2", "--simulate", "printer"]
    )
    c = config_from_args(args)
    assert (c.device, c.fleet, c.broker, c.data.source, c.data.seed) == (
        "printer3",
        "plant",
        "mqtt://b:2",
        "simulate-printer",
        4,
    )
    assert c.state_dir == "/var/lib/ioft/printer3" and c.allow_plaintext is False


def test_bad_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("fleet = \n")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_toml(bad)


def test_aggregator_tasks_are_validated_at_start():
    with pytest.raises(ConfigError, match="task name"):
        build(
            AggregatorConfig, {"task": [{"name": "Bad Name", "algorithm": "pflda", "model": "sigmoid_glm"}]}
        )
    with pytest.raises(ConfigError, match="unique"):
        t = {"name": "a", "algorithm": "pflda", "model": "sigmoid_glm"}
        build(AggregatorConfig, {"task": [t, t]})
