"""Home Assistant MQTT discovery on real processes and a real mosquitto: a printer with
``[serve] home_assistant = true`` announces its entities, ``serve`` republishes them rebuilt as
valid retained configs under ``homeassistant/<component>/<fleet>_<device>/``, and the printer's
answer and status topics carry values that the configs' templates render into numbers (as Home
Assistant would)."""

from __future__ import annotations

import json

import pytest

from cloud_aggregator.local.fleet import Sniffer
from ioft_protocol import topics
from tests.e2e.test_serving import answers, record, train
from tests.e2e.test_serving_watch import ADVISING_TASK
from tests.edge.test_home_assistant import TOPIC, check_config, render


@pytest.mark.broker
def test_a_printer_announces_itself_to_home_assistant_and_its_states_render(fleet_procs):
    work, dev = fleet_procs.work, "p1"
    toml = work / "p1.toml"
    # A floor of 0 and enough steps for a real speed: the advice sensor's template needs a value to
    # render (the 5 mm/s floor has its unit test; a negative min_advice is refused at start).
    toml.write_text(
        'kind = "printer"\n[serve]\nhome_assistant = true\nvibration_budget = 1.0\nmin_advice = 0.0\n'
    )
    record(work, dev, "printer", "--layers", "6", "--layer-s", "0.3")
    fleet_procs.start_device(dev, "--config", str(toml), "--log-level", "INFO", simulate=None)
    # A config on p1's topic that names another machine (this broker has no ACL: the fleet's would
    # let only p1 write there): serve republishes it naming p1, under p1's node.
    fleet = fleet_procs.fleet
    forged = {"name": "forged", "state_topic": topics.topic_answer(fleet, dev, "speed"),
              "device": {"identifiers": [f"ioft_{fleet}_p2"], "name": "p2"}, "unique_id": "p2_x"}  # fmt: skip
    liar = Sniffer(fleet_procs.broker_url)
    liar.client.publish(topics.topic_discovery(fleet, dev, "sensor", "forged"), json.dumps(forged), qos=1,
                        retain=True).wait_for_publish(10)  # fmt: skip
    liar.stop()
    train(fleet_procs, dev, ADVISING_TASK, 3)
    sniffer = Sniffer(fleet_procs.broker_url)  # after the round: the configs must be retained
    try:
        fleet_procs.wait_for(
            lambda: len([t for t, _ in list(sniffer.messages) if TOPIC.match(t)]) >= 4, 30, "the configs"
        )
        out = f"homeassistant/sensor/{fleet}_{dev}/forged/config"
        fleet_procs.wait_for(
            lambda: any(t == out for t, _ in list(sniffer.messages)), 30, "serve's rebuilt config"
        )
        rebuilt = json.loads(next(p for t, p in list(sniffer.messages) if t == out))
        assert rebuilt["device"]["identifiers"] == [f"ioft_{fleet}_{dev}"] and rebuilt["unique_id"].endswith(
            f"{dev}_forged"
        )
        # Enough layers for the interval to be calibrated: the advice (its lower edge) has a value.
        record(work, dev, "printer", "--layers", "12", "--layer-s", "0.3")
        fleet_procs.wait_for(lambda: len(answers(sniffer, dev, "speed")) >= 12, 30, "answers")
        status_topic = topics.topic_status(fleet_procs.fleet, dev)
        fleet_procs.wait_for(
            lambda: any(
                t == status_topic and json.loads(p).get("serving", {}).get("field", {}).get("speed")
                for t, p in list(sniffer.messages)
            ),
            60,
            "a status with the field error",
        )
    finally:
        sniffer.stop()
    messages = list(sniffer.messages)
    configs = {t: json.loads(p) for t, p in messages if TOPIC.match(t) and "/forged/" not in t}
    assert {t.split("/")[3] for t in configs} == {
        "speed_expected_speed", "speed_residual", "speed_field_error", "speed_speed_advice"
    }  # fmt: skip
    latest = {t: p for t, p in messages}  # the last message per topic, as Home Assistant keeps it
    for topic, body in configs.items():
        check_config(topic, body, fleet_procs.fleet)
        state = latest[body["state_topic"]]
        value = float(render(body["value_template"], state))  # a number, from a real payload
        assert value == value
        avail = body["availability"][0]
        assert render(avail["value_template"], latest[avail["topic"]]) == "online"
    answer = json.loads(latest[topics.topic_answer(fleet_procs.fleet, dev, "speed")])
    tpl = configs[f"homeassistant/sensor/{fleet_procs.fleet}_{dev}/speed_expected_speed/config"][
        "value_template"
    ]
    got = float(render(tpl, latest[topics.topic_answer(fleet_procs.fleet, dev, "speed")]))
    assert got == pytest.approx(answer["expected_speed"], abs=0.01)
