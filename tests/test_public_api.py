"""The stable names scripts import (`ioft`), and old module paths that keep working for a version.

Moving `cloud_aggregator.simulation` into `rounds/` once broke every script outside the repository
that ran a simulation.  These tests pin the public surface: a name leaving it, or a move that
breaks an old path, fails here first.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest

import ioft

#: The public surface, as docs/api.md lists it.  Adding a name is a decision; removing one breaks users.
PINNED = {
    "ClientAlgorithm", "ClientData", "DEFAULT_SCHEMA", "Dataset", "DeviceConfig", "FeatureSchema",
    "MemoryStore", "RoundEngine", "ServingModel", "SimulatedFleet", "Simulation", "Strategy", "TaskSpec",
    "build_model", "extract_features", "extract_many", "make_client", "make_strategy", "mean_test_loss",
    "model_names", "schema_hash", "simulate",
}  # fmt: skip


def test_the_public_names_are_the_pinned_ones_and_each_resolves():
    assert set(ioft.__all__) == PINNED
    for name in PINNED:
        assert getattr(ioft, name) is not None, name
    with pytest.raises(AttributeError, match="its names"):
        ioft.NoSuchThing  # noqa: B018


def test_a_public_name_is_the_object_its_module_defines():
    from cloud_aggregator.rounds.simulation import Simulation
    from edge.serving.model import ServingModel

    assert ioft.Simulation is Simulation and ioft.ServingModel is ServingModel


def test_the_api_page_lists_every_public_name():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [name for name in PINNED if f"`{name}`" not in page]
    assert not missing, f"docs/api.md does not name {missing}"


def test_a_device_takes_its_names_without_the_cloud_or_torch():
    script = (
        "import sys, json, ioft\n"
        "ioft.ServingModel, ioft.DeviceConfig, ioft.TaskSpec, ioft.FeatureSchema, ioft.make_client\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cloud_aggregator'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("cloud_aggregator.simulation", "cloud_aggregator.rounds.simulation", "Simulation"),
        ("cloud_aggregator.aggregate", "cloud_aggregator.aggregation.mean", None),
        ("cloud_aggregator.strategies.fedavg", "cloud_aggregator.aggregation.strategies.fedavg", None),
        ("edge.onnx_model", "edge.models.onnx", None),
        ("edge.serving.feed", "edge.feed", None),
        ("edge.serving.jsonlog", "edge.jsonlog", None),
        ("sensors.welding.pipeline", "sensors.features.pipeline", None),
    ],
)
def test_a_moved_module_still_imports_from_its_old_path_with_a_warning(old, new, name):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module: classes and registries stay one
    assert module.__spec__.name == new  # the module keeps its own identity
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(new in s and "0.2.0" in s for s in said), said
    if name is not None:
        assert getattr(module, name) is getattr(ioft, name)


def test_a_moved_name_still_imports_from_the_module_it_left():
    from edge.feed import STATUS_FILE
    from edge.recording.base import STATUS_FILE as RECORDER_STATUS
    from edge.rows import Row
    from edge.serving.records import Row as ServingRow

    assert ServingRow is Row and RECORDER_STATUS == STATUS_FILE


def test_the_mqtt_sessions_words_still_import_from_the_session_module():
    import ioft_protocol.mqtt as old
    from ioft_protocol import mqtt_inbound, mqtt_options, mqtt_tls

    for home in (mqtt_inbound, mqtt_options, mqtt_tls):
        for name in set(old.__all__) & set(vars(home)):
            assert getattr(old, name) is getattr(home, name), name
    assert {"Message", "MqttError", "SessionOptions", "TlsConfig", "check_options"} <= set(old.__all__)


def test_an_unmoved_missing_module_still_fails_as_usual():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cloud_aggregator.no_such_module")
