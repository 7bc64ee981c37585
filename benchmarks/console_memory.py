"""The console's memory under a stream of answers: does it stay bounded whatever the fleet sends?

A real mosquitto and a real ``cloud-aggregator console``; a publisher plays D devices each
answering A rows (a printer layer's answer, ~300 bytes, QoS 1) on their answer topics.  After
each step the console's RSS (``/proc/<pid>/status``: VmRSS) is read once it has taken every
answer of the step (its ``/api/view`` shows each device's last key).  The ring keeps
``machines_feed.RING`` answers per device, so RSS should grow with the devices, not with the
answers.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as paho

from benchmarks.common import markdown_table, study_parser, write_result
from cloud_aggregator import console
from cloud_aggregator.console.machines_feed import MAX_DEVICES, RING
from cloud_aggregator.local.broker import free_port, start_mosquitto
from ioft_protocol import topics

FLEET = "memory"
#: Rows per device published before waiting for their acknowledgements.
BATCH = 20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def answer(device: str, i: int) -> bytes:
    body = {"device": device, "task": "speed", "kind": "layer", "key": f"part.gcode#1/{i}",
            "row_time": 1e9 + i, "answered_at": 1e9 + i + 0.01, "latency_s": 0.004,
            "model": {"task": "speed", "round": 5, "digest": "0123456789ab"},
            "expected_speed": 60.0 + i % 7, "commanded": 60.0, "residual": float(i % 7),
            "advice": {"speed": 70.0, "vibration_budget": 0.8}}  # fmt: skip
    return json.dumps(body).encode()


def wait_taken(url: str, devices: list[str], last: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = json.loads(urllib.request.urlopen(url + "api/view", timeout=30).read())
        keys = {
            m["device"]: (m["tasks"][0]["latest"] or {}).get("key") for m in view["machines"] if m["tasks"]
        }
        if all(keys.get(d) == last for d in devices):
            return
        time.sleep(2.0)
    raise TimeoutError("the console did not take every answer")


def main() -> None:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 200, 1000, 5000])
    args = parser.parse_args()
    steps = [0, 200, 1000] if args.quick else args.steps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        conf = work / "mosquitto.conf"  # no cap on the console's queue: it takes every answer, however late
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n")
        broker = start_mosquitto(port, config=conf, log_file=work / "mosquitto.log")
        (work / "console.toml").write_text(
            f'fleet = "{FLEET}"\nbroker = "{broker.url}"\nstate_dir = "{work}"\nallow_plaintext = true\n'
        )
        proc, url = console.launch(work / "console.toml", work / "console.log", port=0, refresh=1.0)
        pub = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
        pub.connect("127.0.0.1", broker.port)
        pub.loop_start()
        try:
            devices = [f"printer{d}" for d in range(args.devices)]
            time.sleep(2.0)  # the console subscribed
            sent = 0
            for step in steps:
                for start in range(sent, step, BATCH):  # BATCH rows on every device, then their acks
                    rows_ = range(start, min(step, start + BATCH))
                    infos = [
                        pub.publish(topics.topic_answer(FLEET, d, "speed"), answer(d, i), qos=1)
                        for i in rows_
                        for d in devices
                    ]
                    for info in infos:
                        info.wait_for_publish(60)
                if step > sent:
                    wait_taken(url, devices, f"part.gcode#1/{step - 1}")
                sent = max(sent, step)
                rows.append([args.devices, step, args.devices * step, f"{rss_mib(proc.pid):.1f}"])
                print(rows[-1], flush=True)
        finally:
            pub.disconnect()
            pub.loop_stop()
            proc.terminate()
            proc.wait(10)
            broker.stop()
    table = markdown_table(["devices", "answers per device", "answers streamed", "console RSS (MiB)"], rows)
    full = next((r for r in rows if r[1] >= RING), None)
    per = (
        (float(full[3]) - float(rows[0][3])) * 2**20 / (args.devices * RING)
        if full and rows[0][1] == 0
        else None
    )
    bound = (
        ""
        if per is None
        else (
            f"A full ring costs ~{per:.0f} bytes per answer kept: at most ~{per * RING * MAX_DEVICES / 2**20:.0f} MiB "
            f"over the idle console for {MAX_DEVICES} devices (`machines_feed.MAX_DEVICES`), however many answers stream.\n"
        )
    )
    body = f"Ring: the last {RING} answers per device.\n\n{table}\n\n{bound}"
    print(body)
    if not args.no_write:
        write_result("console_memory", body)


if __name__ == "__main__":
    main()
