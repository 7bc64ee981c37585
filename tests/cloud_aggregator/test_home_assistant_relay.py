"""What ``serve`` republishes to Home Assistant from a device's discovery config
(``cloud_aggregator.serve.home_assistant.rebuild``): the identity is the publishing device's,
the topics it reads must be that device's own, and nothing but a read-only entity's keys pass."""

from __future__ import annotations

import json

import pytest

from cloud_aggregator.serve.home_assistant import MAX_CONFIG_BYTES, discovery_topic, rebuild
from ioft_protocol import topics


def _payload(**over) -> bytes:
    body = {
        "name": "speed advice", "state_topic": topics.topic_answer("plant", "p1", "speed"),
        "value_template": "{{ value_json.advice.speed }}", "unique_id": "ioft_plant_p2_x",
        "device": {"identifiers": ["ioft_plant_p2"], "name": "p2", "model": "printer"},
        "availability": [{"topic": topics.topic_status("plant", "p1"), "payload_available": "online"}],
    }  # fmt: skip
    return json.dumps(body | over).encode()


def test_the_identity_is_the_publishing_devices_whatever_the_payload_says():
    config = rebuild(
        "plant", "p1", "sensor", "speed_advice", _payload(command_topic="ioft/v1/plant/task/x/down")
    )
    assert config["device"] == {"identifiers": ["ioft_plant_p1"], "name": "p1", "manufacturer": "ioft",
                                "model": "printer"}  # fmt: skip
    assert config["unique_id"] == "ioft_plant_p1_speed_advice"
    assert "command_topic" not in config  # a read-only entity's keys only
    assert discovery_topic("plant", "p1", "sensor", "x") == "homeassistant/sensor/plant_p1/x/config"


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (_payload(state_topic=topics.topic_answer("plant", "p2", "speed")), "not p1's own"),
        (_payload(availability=[{"topic": topics.topic_status("plant", "p2")}]), "not p1's own"),
        (_payload(state_topic=topics.topic_up("plant", "speed", "p1")), "not p1's own"),  # its upload
        (_payload(state_topic=topics.topic_answer("other", "p1", "speed")), "not p1's own"),  # other fleet
        (_payload(json_attributes_topic="$SYS/broker/clients"), "not p1's own"),
        (_payload(state_topic=None), "no state topic"),
        (_payload(name="x" * 101), "name"),
        (_payload(availability="online"), "availability"),
        (b"[1, 2]", "not a JSON object"),
        (b"{", "Expecting"),
        (b" " * (MAX_CONFIG_BYTES + 1), "bytes, over"),
    ],
)
def test_a_config_that_reads_another_devices_topics_or_is_malformed_is_refused(payload, why):
    with pytest.raises(ValueError, match=why):
        rebuild("plant", "p1", "sensor", "x", payload)
