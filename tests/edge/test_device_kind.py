"""A device's ``kind`` and ``tags`` (``device.toml``), and the model input width it checks."""

from __future__ import annotations

import pytest

from edge.config import DataConfig, DeviceConfig
from ioft_protocol.config import ConfigError, build
from trainer_lite.models import build_model


def test_kind_defaults_from_the_simulated_machine_or_sensors():
    assert DeviceConfig("p1").machine_kind is None
    assert DeviceConfig("w1", data=DataConfig(source="simulate-welder")).machine_kind == "welder"
    assert DeviceConfig("p1", data=DataConfig(source="simulate-printer-raw")).machine_kind == "printer"
    assert DeviceConfig("x", kind="welder", tags=["line-a"]).machine_kind == "welder"


def test_a_bad_kind_or_tag_is_listed():
    with pytest.raises(ConfigError) as err:
        build(DeviceConfig, {"device": "p1", "kind": "laser"})
    assert "kind must be one of ['printer', 'welder']" in str(err.value)
    with pytest.raises(ConfigError):
        build(DeviceConfig, {"device": "p1", "tags": ["Line A"]})


@pytest.mark.parametrize(
    ("model", "args", "width"),
    [
        ("sigmoid_glm", {}, 1),
        ("mlp", {"sizes": [624, 8, 4]}, 624),
        ("linear_rep", {}, 20),
        ("vector", {}, None),
    ],
)
def test_input_width(model, args, width):
    assert build_model(model, **args).input_width() == width
