"""A device's retained status as a fresh subscriber reads it (what the aggregator sees on connect)."""

from __future__ import annotations

import json
import time

import paho.mqtt.client as paho

from cloud_aggregator.local.fleet import FLEET
from ioft_protocol import topics


def retained_status(url: str, device: str, timeout: float = 10.0, fleet: str = FLEET) -> dict:
    """The retained status of ``device`` on the loopback broker at ``url`` (``mqtt://host:port``);
    ``{}`` when there is none within ``timeout``."""
    host, port = url.removeprefix("mqtt://").split(":")
    got: list[bytes] = []
    client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2)
    client.on_connect = lambda c, *a: c.subscribe(topics.topic_status(fleet, device), qos=1)
    client.on_message = lambda c, u, m: got.append(m.payload)
    client.connect(host, int(port))
    client.loop_start()
    try:
        deadline = time.monotonic() + timeout
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    return json.loads(got[-1]) if got else {}
