"""What the broker does with a killed shared-subscription member's unacknowledged QoS 1 messages.

Two members subscribe to ``$share/g/t/#`` at QoS 1 with paho (MQTT 3.1.1 or 5, clean or persistent
sessions); member A never acknowledges (paho's manual ack, never called) and is SIGKILLed after 10
messages, then 10 more are published.  Printed per setting: what A got, what B got, and the
messages nobody acknowledged (lost).  On mosquitto 2.0.11: clean sessions lose A's 5; persistent
ones keep them for A's session and go on giving it every other new message
(eclipse-mosquitto/mosquitto#2662).  ``--member`` runs one member (internal).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_aggregator.local.broker import free_port, start_mosquitto


def member(port: int, client_id: str, clean: bool, v5: bool, ack: bool, seconds: float) -> None:
    kwargs = {"client_id": client_id, "protocol": paho.MQTTv5 if v5 else paho.MQTTv311, "manual_ack": not ack}
    if not v5:
        kwargs["clean_session"] = clean
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, **kwargs)
    c.on_message = lambda cl, u, m: print("got", m.payload.decode(), flush=True)
    c.on_connect = lambda cl, u, f, rc, p: cl.subscribe("$share/g/t/#", 1)
    if v5:
        props = Properties(PacketTypes.CONNECT)
        if not clean:
            props.SessionExpiryInterval = 3600
        c.connect("127.0.0.1", port, clean_start=clean, properties=props)
    else:
        c.connect("127.0.0.1", port)
    c.loop_start()
    print("ready", flush=True)
    time.sleep(seconds)


def trial(clean: bool, v5: bool) -> str:
    broker = start_mosquitto(free_port())
    port = int(broker.url.rsplit(":", 1)[1])
    cmd = [sys.executable, "-m", "benchmarks.shared_sub_probe", "--member", str(port)]
    flags = ["--clean" if clean else "--persistent", "--v5" if v5 else "--v311"]
    try:
        a = subprocess.Popen(
            [*cmd, "A", *flags, "--no-ack", "--seconds", "100"], stdout=subprocess.PIPE, text=True
        )
        b = subprocess.Popen([*cmd, "B", *flags, "--seconds", "6"], stdout=subprocess.PIPE, text=True)
        a.stdout.readline(), b.stdout.readline()
        time.sleep(0.5)
        pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="pub")
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        for i in range(10):
            pub.publish("t/x", str(i), qos=1).wait_for_publish()
        time.sleep(0.5)
        a.kill()
        time.sleep(0.5)
        for i in range(10, 20):
            pub.publish("t/x", str(i), qos=1).wait_for_publish()
        b.wait()
        pub.loop_stop()
        got_a = [line.split()[1] for line in a.stdout.read().splitlines() if line.startswith("got")]
        got_b = [line.split()[1] for line in b.stdout.read().splitlines() if line.startswith("got")]
        lost = sorted(set(map(str, range(20))) - set(got_b), key=int)
        session = "clean" if clean else "persistent"
        return f"MQTT {'5' if v5 else '3.1.1'}, {session} sessions: A (killed, never acked) got {got_a}; B got {got_b}; lost {lost}"
    finally:
        broker.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--member", nargs=2, metavar=("PORT", "ID"), help=argparse.SUPPRESS)
    p.add_argument("--clean", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--persistent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--v5", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--v311", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-ack", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.member:
        member(int(args.member[0]), args.member[1], args.clean, args.v5, not args.no_ack, args.seconds)
        return
    for clean in (True, False):
        for v5 in (False, True):
            print(trial(clean, v5), flush=True)


if __name__ == "__main__":
    main()
