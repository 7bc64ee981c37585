"""What a plant bridge costs: uplinks through a bridged plant mosquitto vs straight to the cloud one.

Both brokers come from ``fleet init`` / ``fleet add-plant`` (TLS, ACLs), on loopback.  One device
identity publishes ``--messages`` QoS 1 uplinks of each size (1 KB, and 600 KB: a 150k-parameter
float32 upload) to the plant broker; the aggregator identity receives them on the cloud broker.
The reference, in the same run: the same messages published straight to the cloud broker.
Figures: messages and MB per second from the first publish to the last delivery, median of
``--repeats``.  Loopback has no WAN latency, so this is the bridge's CPU and queueing cost only.

    python -m benchmarks.bridge_throughput [--messages 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import ssl
import statistics
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho

from benchmarks.common import markdown_table, write_result
from cloud_aggregator.fleet.init import init_fleet
from cloud_aggregator.fleet.plants import add_plant
from cloud_aggregator.local.broker import free_port, start_mosquitto

FLEET = "bench"
SIZES = {"1 KB": 1_000, "600 KB": 600_000}


def _client(port: int, ca: Path, cert: Path, key: Path) -> paho.Client:
    c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    c.tls_set(ca_certs=str(ca), certfile=str(cert), keyfile=str(key), cert_reqs=ssl.CERT_REQUIRED)
    c.max_inflight_messages_set(100)
    up = threading.Event()
    c.on_connect = lambda *_a: up.set()
    c.connect("127.0.0.1", port, keepalive=60)
    c.loop_start()
    if not up.wait(10):
        raise RuntimeError(f"no connection to 127.0.0.1:{port}")
    return c


def _run(pub_port: int, cloud_port: int, layout, n: int, size: int) -> float:
    """Seconds from the first publish (device -> ``pub_port``) to the n-th delivery on the cloud."""
    got = threading.Event()
    count = [0]

    def on_message(*_a) -> None:
        count[0] += 1
        if count[0] == n:
            got.set()

    sub = _client(cloud_port, layout.ca_cert, layout.cert("aggregator"), layout.key("aggregator"))
    sub.on_message = on_message
    subbed = threading.Event()
    sub.on_subscribe = lambda *_a: subbed.set()
    sub.subscribe(f"ioft/v1/{FLEET}/task/+/up/+", qos=1)
    subbed.wait(10)
    pub = _client(pub_port, layout.ca_cert, layout.cert("d1"), layout.key("d1"))
    payload = os.urandom(size)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            pub.publish(f"ioft/v1/{FLEET}/task/t/up/d1", payload, qos=1)
        if not got.wait(300):
            raise RuntimeError(f"only {count[0]} of {n} messages arrived")
        return time.perf_counter() - t0
    finally:
        for c in (pub, sub):
            c.disconnect()
            c.loop_stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ioft-bridge-"))
    brokers = []
    try:
        cloud_port, plant_port = free_port(), free_port()
        layout = init_fleet(
            root / "fleet", FLEET, ["d1"], hosts=["127.0.0.1"], port=cloud_port, bind="127.0.0.1"
        )
        add_plant(layout.root, "p1", ["d1"], hosts=["127.0.0.1"], port=plant_port, bind="127.0.0.1",
                  restart_timeout=(1, 2))  # fmt: skip
        cloud = start_mosquitto(cloud_port, config=layout.mosquitto_conf, tls=True, as_invoker=True)
        brokers.append(cloud)
        plant_conf = layout.root / "plants" / "p1" / "mosquitto.conf"
        brokers.append(start_mosquitto(plant_port, config=plant_conf, tls=True, as_invoker=True))
        time.sleep(2.0)  # the bridge's first connection
        rows = []
        for label, size in SIZES.items():
            n = args.messages if size < 100_000 else max(1, args.messages // 10)
            direct = statistics.median(
                _run(cloud_port, cloud_port, layout, n, size) for _ in range(args.repeats)
            )
            bridged = statistics.median(
                _run(plant_port, cloud_port, layout, n, size) for _ in range(args.repeats)
            )
            rows.append([label, n, f"{n / direct:.0f}", f"{n / bridged:.0f}", f"{n * size / direct / 1e6:.0f}",
                         f"{n * size / bridged / 1e6:.0f}", f"{bridged / direct:.2f}"])  # fmt: skip
        table = markdown_table(
            ["payload", "messages", "direct msg/s", "bridged msg/s", "direct MB/s", "bridged MB/s",
             "bridged / direct time"],
            rows,
        )  # fmt: skip
        print(table)
        write_result(
            "bridge_throughput",
            "Device -> plant mosquitto -> bridge (TLS, QoS 1) -> cloud mosquitto -> aggregator subscriber, "
            "against device -> cloud mosquitto directly, same run, loopback (no WAN latency), median of "
            f"{args.repeats}.\n\n{table}\n",
        )
    finally:
        for b in brokers:
            b.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
