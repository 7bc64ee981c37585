"""Home Assistant MQTT discovery (``edge.serving.home_assistant``) checked against Home Assistant's
documented keys, and its templates rendered (as Home Assistant does, in a sandboxed Jinja) on the
answers, status and alerts a real ``Server`` publishes."""

from __future__ import annotations

import json
import re

import pytest

from cloud_aggregator.serve.home_assistant import discovery_topic, rebuild
from edge.config import DeviceConfig
from edge.config_serve import AlertRule, ServeConfig
from edge.serving.model import ServingModel
from edge.serving.records import Row
from edge.serving.server import Server
from ioft_protocol import topics
from ioft_protocol.config import ConfigError, build
from tests.edge.test_serving import layer, linear, offer
from tests.edge.test_serving_watch import WELD_SPEC, linear_2x2

jinja2_sandbox = pytest.importorskip("jinja2.sandbox")

# The keys Home Assistant documents, copied from its pages (home-assistant/home-assistant.io,
# source/_integrations/): sensor.mqtt.markdown (https://www.home-assistant.io/integrations/sensor.mqtt/)
# minus `platform`, which is "only allowed and required in MQTT auto discovery device messages" (we
# send single-component ones); binary_sensor.mqtt.markdown
# (https://www.home-assistant.io/integrations/binary_sensor.mqtt/); the `device` and `availability`
# maps as both pages document them; `origin` from mqtt.markdown ("Adding information about the origin
# of a discovery message": name, sw_version, support_url), recommended for every discovery payload.
SENSOR_KEYS = {
    "availability", "availability_mode", "availability_template", "availability_topic", "device",
    "device_class", "enabled_by_default", "encoding", "entity_category", "entity_picture", "expire_after",
    "force_update", "icon", "json_attributes_template", "json_attributes_topic", "last_reset_value_template",
    "name", "object_id", "options", "payload_available", "payload_not_available",
    "suggested_display_precision", "qos", "state_class", "state_topic", "unique_id", "unit_of_measurement",
    "value_template", "origin",
}  # fmt: skip
BINARY_SENSOR_KEYS = {
    "availability", "availability_mode", "availability_topic", "device", "device_class", "enabled_by_default",
    "expire_after", "force_update", "icon", "json_attributes_template", "json_attributes_topic", "name",
    "off_delay", "payload_available", "payload_not_available", "payload_off", "payload_on", "qos",
    "state_topic", "unique_id", "value_template", "origin",
}  # fmt: skip
REQUIRED = {"state_topic"}  # both pages: the only required key of a single-component config
DEVICE_KEYS = {
    "configuration_url", "connections", "hw_version", "identifiers", "manufacturer", "model", "model_id",
    "name", "serial_number", "suggested_area", "sw_version", "via_device",
}  # fmt: skip
AVAILABILITY_KEYS = {"payload_available", "payload_not_available", "topic", "value_template"}
ORIGIN_KEYS = {"name", "sw_version", "support_url"}
# Some of mqtt.markdown's "Supported abbreviations": we spell keys out, so none of these may appear.
ABBREVIATIONS = {"avty", "avty_t", "dev", "dev_cla", "o", "stat_t", "val_tpl", "uniq_id", "unit_of_meas",
                 "stat_cla", "pl_on", "pl_off", "ids", "mf", "mdl", "sw", "pl_avail", "pl_not_avail", "t", "p",
                 "cmps", "sug_dsp_prc", "ops"}  # fmt: skip
ALLOWED = {"sensor": SENSOR_KEYS, "binary_sensor": BINARY_SENSOR_KEYS}
TOPIC = re.compile(r"^homeassistant/(sensor|binary_sensor)/([a-zA-Z0-9_-]+)/([a-zA-Z0-9_-]+)/config$")

WORN = AlertRule(name="worn_tool", task="tool", value="p:TC4", above=0.8, k=1, n=1)


def ha_server(tmp_path, published: list, device: str = "p1", kind: str = "printer", **serve) -> Server:
    cfg = ServeConfig(home_assistant=True, **serve)
    config = DeviceConfig(device=device, fleet="plant", state_dir=str(tmp_path), serve=cfg, kind=kind)
    return Server(config, tmp_path, lambda topic, payload: published.append((topic, payload)))


def welder(tmp_path, published: list) -> Server:
    srv = ha_server(tmp_path, published, "w1", "welder", alerts=[WORN])
    srv.models["tool"] = ServingModel("w1", "tool", WELD_SPEC, 1, linear_2x2(), {}, width=2,
                                      classes=["TC1", "TC4"], metric=1.0, reference=1.0)  # fmt: skip
    return srv


def configs(messages: list, fleet: str = "plant") -> dict[str, dict]:
    """The configs Home Assistant gets from a device's messages: ``serve`` republishes each one
    rebuilt (``cloud_aggregator.serve.home_assistant``) under ``homeassistant/``."""
    out = {}
    for t, p in messages:
        parts = t.split("/")
        if t.startswith(f"{topics.fleet_root(fleet)}/ha/") and p:
            device, component, object_id = parts[4:7]
            config = rebuild(fleet, device, component, object_id, p)
            out[discovery_topic(fleet, device, component, object_id)] = config
        elif TOPIC.match(t) and p:
            out[t] = json.loads(p)
    return out


def render(template: str, payload: bytes) -> str:
    """As Home Assistant renders a ``value_template``: ``value`` and ``value_json``, sandboxed."""
    env = jinja2_sandbox.ImmutableSandboxedEnvironment()
    return env.from_string(template).render(value=payload.decode(), value_json=json.loads(payload))


def check_config(topic: str, body: dict, fleet: str = "plant") -> None:
    component, node, object_id = TOPIC.match(topic).groups()
    assert node.startswith(f"{fleet}_"), topic  # the node id carries the fleet: fleets do not collide
    device = node.removeprefix(f"{fleet}_")
    words = body["name"].split()
    assert len(set(words)) == len(words), f"{topic}: the name says a word twice: {body['name']!r}"
    assert set(body) <= ALLOWED[component], f"{topic}: undocumented keys {set(body) - ALLOWED[component]}"
    assert set(body) >= REQUIRED, topic
    assert not set(body) & ABBREVIATIONS and not set(body["device"]) & ABBREVIATIONS
    # `device` "only works when unique_id is set"; "at least one of identifiers or connections".
    assert body["unique_id"].endswith(object_id) and device in body["unique_id"]
    assert set(body["device"]) <= DEVICE_KEYS and body["device"]["identifiers"]
    assert body["device"]["name"] == device and body["device"]["manufacturer"] == "ioft"
    assert set(body["origin"]) <= ORIGIN_KEYS and body["origin"]["name"] == "ioft"
    for entry in body["availability"]:
        assert set(entry) <= AVAILABILITY_KEYS and "topic" in entry
        assert entry["topic"] == topics.topic_status(fleet, device)
    if body.get("device_class") == "enum":  # "options ... cannot be used together with state_class or unit"
        assert body["options"] and "state_class" not in body and "unit_of_measurement" not in body


def test_a_printer_shows_up_with_its_answer_advice_and_field_error(tmp_path):
    published: list = []
    srv = ha_server(tmp_path, published, vibration_budget=0.6)
    assert srv.discovery() == []  # no serving model yet: nothing to show
    offer(srv, linear(2.0, 0.5), 1)  # the first model announces its sensors at once
    announced = configs(published)
    assert set(announced) == {f"homeassistant/sensor/plant_p1/speed_{what}/config"
                              for what in ("expected_speed", "residual", "field_error", "speed_advice")}  # fmt: skip
    for topic, body in announced.items():
        check_config(topic, body)
        assert body["device"]["model"] == "printer"
    assert configs(srv.discovery()) == announced  # the same again on every connect
    assert len({b["unique_id"] for b in announced.values()}) == len(announced)

    srv.answer(layer("job#1/0", 0.2, commanded=40.0))
    answer = next(p for t, p in published if t == topics.topic_answer("plant", "p1", "speed"))
    got = {t.split("/")[3]: render(b["value_template"], answer) for t, b in announced.items()
           if b["state_topic"] == topics.topic_answer("plant", "p1", "speed")}  # fmt: skip
    body = json.loads(answer)
    assert float(got["speed_expected_speed"]) == pytest.approx(body["expected_speed"], abs=0.01)
    assert float(got["speed_residual"]) == pytest.approx(body["residual"], abs=0.01)
    assert float(got["speed_speed_advice"]) == pytest.approx(85.0)
    status = json.dumps({"state": "online", "serving": srv.status()}).encode()
    field = announced["homeassistant/sensor/plant_p1/speed_field_error/config"]
    assert float(render(field["value_template"], status)) == pytest.approx(abs(body["residual"]), abs=0.01)
    avail = field["availability"][0]
    assert render(avail["value_template"], status) == avail["payload_available"]
    # Before any score (another device's first status) the field sensor is unknown, not an error.
    assert render(field["value_template"], b'{"state": "online", "serving": {"field": {}}}') == "None"


def test_a_welder_shows_its_class_probability_field_accuracy_and_alert(tmp_path):
    published: list = []
    srv = welder(tmp_path, published)
    announced = configs(srv.discovery())
    assert set(announced) == {
        "homeassistant/binary_sensor/plant_w1/alert_worn_tool/config",
        *(
            f"homeassistant/sensor/plant_w1/tool_{w}/config"
            for w in ("class", "probability", "field_accuracy")
        ),
    }
    for topic, body in announced.items():
        check_config(topic, body)
        assert body["device"]["model"] == "welder"
    srv.answer(Row("weld", "w0", 1.0, (0.0, 3.0)))
    answer = next(p for t, p in published if t == topics.topic_answer("plant", "w1", "tool"))
    cls = announced["homeassistant/sensor/plant_w1/tool_class/config"]
    assert render(cls["value_template"], answer) == "TC4" and cls["options"] == ["TC1", "TC4"]
    assert "value_json.predicted" in cls["value_template"]  # not "label", which goes in 0.2.0
    prob = render(
        announced["homeassistant/sensor/plant_w1/tool_probability/config"]["value_template"], answer
    )
    assert float(prob) == pytest.approx(100 * max(json.loads(answer)["probabilities"]), abs=0.01)
    srv.label({"kind": "label", "key": "w0", "label": "TC4"})  # the maintenance log: it was worn
    status = json.dumps({"state": "online", "serving": srv.status()}).encode()
    acc = announced["homeassistant/sensor/plant_w1/tool_field_accuracy/config"]
    assert float(render(acc["value_template"], status)) == pytest.approx(100.0)
    alert = announced["homeassistant/binary_sensor/plant_w1/alert_worn_tool/config"]
    event = next(p for t, p in published if t == alert["state_topic"])  # P(TC4) 0.95 > 0.8: raised
    assert render(alert["value_template"], event) == alert["payload_on"]
    assert alert["device_class"] == "problem" and alert["payload_off"] == "cleared"


def test_discovery_is_off_unless_asked_and_the_prefix_is_checked(tmp_path):
    published: list = []
    config = DeviceConfig(device="p1", state_dir=str(tmp_path), serve=ServeConfig(vibration_budget=0.6))
    srv = Server(config, tmp_path, lambda topic, payload: published.append((topic, payload)))
    offer(srv, linear(2.0, 0.5), 1)
    assert srv.discovery() == [] and not [t for t, _ in published if t.startswith("homeassistant/")]
    # The device writes its configs on its own fleet topic whatever the prefix: serve republishes
    # them under Home Assistant's (a device may not write there).
    other = ha_server(tmp_path / "b", published := [], discovery_prefix="ha/test")
    offer(other, linear(2.0, 0.5), 1)
    mine = topics.topic_discovery_all("plant", "p1").removesuffix("/+/+")
    assert configs(published) and not [t for t, _ in published if t.startswith(("ha/test", "homeassistant"))]
    assert all(t.startswith(mine) for t, _ in published if "/sensor/" in t)
    with pytest.raises(ConfigError, match="discovery_prefix"):
        build(DeviceConfig, {"device": "p1", "serve": {"discovery_prefix": "homeassistant/#"}}, "device.toml")


def test_a_rule_removed_from_the_config_is_removed_from_home_assistant(tmp_path):
    """Issue 33 item 2: the next start publishes an empty retained config for each entity announced
    before and gone now (serve republishes it empty too, and Home Assistant removes the entity)."""
    before = welder(tmp_path, [])
    announced = {t for t, _ in before.discovery()}
    alert = topics.topic_discovery("plant", "w1", "binary_sensor", "alert_worn_tool")
    assert alert in announced
    after = ha_server(tmp_path, [], "w1", "welder")  # the same state folder, the rule gone
    after.models = before.models
    got = dict(after.discovery())
    assert got[alert] == b"" and all(got[t] for t in announced - {alert})
    assert b"" not in dict(after.discovery()).values()  # said once: the next connect has nothing to remove
    off = Server(DeviceConfig(device="w1", fleet="plant", state_dir=str(tmp_path), serve=ServeConfig()),
                 tmp_path, lambda topic, payload: None)  # fmt: skip
    assert dict(off.discovery()) == dict.fromkeys(announced - {alert}, b"")  # discovery turned off: all go
