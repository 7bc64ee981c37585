"""One device floods retained statuses; the others' rounds go on.

N ``edge-trainer`` processes run the zero-compute ``echo`` task as fast as rounds go; a
``flooder`` client, enrolled as one more device, publishes retained QoS 1 statuses as fast as
it can, each with a new ``connected_at`` (a new connection, as far as the aggregator can
tell).  Measured: the rounds per minute of the N devices in a window before the flood and
during it, ``serve``'s RSS before and after, and what the flood made the aggregator send the
flooder (restated announcements, at most one per announcement) against the announcements it
published on the task's broadcast topic meanwhile.

``--quick`` (the test suite) asserts bounds and orderings only, never times: ``serve`` still
runs, rounds completed during the flood, restatements to the flooder <= announcements + 1,
far fewer than the statuses sent, RSS within 1.5x.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho

from benchmarks.common import markdown_table, remove_scratch, study_parser, write_result
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml
from ioft_protocol import topics

FLOODER = "flooder"
TASK = "bench"
#: Messages the flooder's client holds unacknowledged before it waits for the broker.
FLOOD_BACKLOG = 1_000


class Flooder:
    """An enrolled device's client sending retained statuses, each from a "new connection", and
    counting what comes back on its downlink and what the task's broadcast carries live."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.sent = self.restated = self.announced = 0
        self._stop = threading.Event()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311, client_id=FLOODER
        )
        self.client.max_inflight_messages_set(100)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        self._thread = threading.Thread(target=self._flood, daemon=True)

    def _on_connect(self, client: paho.Client, *args: object) -> None:
        client.subscribe(topics.topic_down_device(FLEET, TASK, FLOODER), qos=1)
        client.subscribe(topics.topic_down(FLEET, TASK), qos=1)

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        if msg.retain:  # the copy a new subscription gets: not something the flood caused
            return
        if msg.topic.endswith(f"/{FLOODER}"):
            self.restated += 1
        else:
            self.announced += 1

    def start(self) -> None:
        self._thread.start()

    def _flood(self) -> None:
        topic = topics.topic_status(FLEET, FLOODER)
        pending: list[paho.MQTTMessageInfo] = []
        while not self._stop.is_set():
            body = {"device": FLOODER, "state": "online", "connected_at": time.time() + self.sent}
            pending.append(self.client.publish(topic, json.dumps(body).encode(), qos=1, retain=True))
            self.sent += 1
            if len(pending) >= FLOOD_BACKLOG:  # as fast as the broker takes them, no faster
                pending[0].wait_for_publish(10)
                pending = [p for p in pending if not p.is_published()]

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        self.client.disconnect()
        self.client.loop_stop()


def rss_mib(pid: int) -> float:
    """A process's resident set size now, in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_s(pid) for name, pid in pids.items()}


def completed_between(fleet: LocalFleet, start: float, end: float) -> int:
    return sum(1 for r in fleet.rounds(TASK) if r.status == "completed" and start <= r.finished < end)


def run_case(n: int, window_s: float, flood_s: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ioft-status-flood-"))
    broker = start_mosquitto(log_file=work / "broker.log")
    fleet = LocalFleet(work, broker.url)
    flooder = None
    try:
        names = [f"dev{i}" for i in range(n)]
        fleet.start_devices(names, "--log-level", "WARNING", simulate="printer")
        task = {"name": TASK, "algorithm": "echo", "model": "vector", "rounds": 1_000_000}
        task["model_args"] = {"size": 1_000}
        toml = aggregator_toml(
            broker.url, work / "aggregator", [task], expected=names, min_participants=n, deadline_s=10
        )
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        fleet.wait_for(lambda: len(fleet.rounds(TASK)) >= 3, 120, "three warm-up rounds")
        pids = {"serve": agg.pid, "mosquitto": broker.proc.pid, "flooder": os.getpid()}
        pids |= {d: p.pid for d, p in fleet.devices.items()}
        start, cpu0 = time.time(), cpu_split(pids)
        time.sleep(window_s)  # the measurement window itself
        before, cpu1 = completed_between(fleet, start, time.time()), cpu_split(pids)
        rss_before = rss_mib(agg.pid)
        flooder = Flooder(broker.url)
        flooder.start()
        flood_start = time.time()
        time.sleep(flood_s)
        during, cpu2 = completed_between(fleet, flood_start, time.time()), cpu_split(pids)
        rss_after = rss_mib(agg.pid)
        flooder.stop()
        alive = agg.poll() is None
        return {
            "devices": n,
            "window_s": window_s,
            "flood_s": flood_s,
            "rounds_per_min_before": before * 60.0 / window_s,
            "rounds_per_min_flood": during * 60.0 / flood_s,
            "rounds_flood": during,
            "rss_before_mib": rss_before,
            "rss_after_mib": rss_after,
            "statuses_sent": flooder.sent,
            "restated": flooder.restated,
            "announced": flooder.announced,
            "cpu_before": {k: (cpu1[k] - cpu0[k]) / window_s for k in pids},
            "cpu_flood": {k: (cpu2[k] - cpu1[k]) / flood_s for k in pids},
            "serve_alive": alive,
            "traceback": "Traceback" in fleet.log("aggregator"),
        }
    finally:
        if flooder is not None:
            flooder.stop()
        fleet.stop_all()
        broker.stop()
        remove_scratch(work)


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=3, help="devices whose rounds are measured")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured before the flood")
    parser.add_argument("--flood", type=float, default=60.0, help="seconds of flood")
    args = parser.parse_args(argv)
    interrupt_on_sigterm()  # the case's `finally` stops the broker and the processes
    if args.quick:
        args.devices, args.window, args.flood = 2, 8.0, 10.0
    r = run_case(args.devices, args.window, args.flood)
    if args.quick:
        assert r["serve_alive"] and not r["traceback"], "serve died under the flood"
        assert r["rounds_flood"] >= 1, "no round completed during the flood"
        assert r["restated"] <= r["announced"] + 1, r  # at most one restatement per announcement
        assert r["statuses_sent"] > 10 * (r["restated"] + 1), r  # the flood is not amplified
        assert r["rss_after_mib"] <= 1.5 * r["rss_before_mib"], r
    rows = [
        ["rounds/min without flood", f"{r['rounds_per_min_before']:.0f}"],
        ["rounds/min during the flood", f"{r['rounds_per_min_flood']:.0f}"],
        ["throughput kept", f"{r['rounds_per_min_flood'] / max(r['rounds_per_min_before'], 1e-9):.0%}"],
        ["serve RSS before / after", f"{r['rss_before_mib']:.1f} / {r['rss_after_mib']:.1f} MiB"],
        ["statuses flooded", f"{r['statuses_sent']:,}"],
        ["restatements to the flooder / announcements", f"{r['restated']} / {r['announced']}"],
        ["serve still running", "yes" if r["serve_alive"] else "NO"],
        *[
            [f"CPU share of {k}, before / during", f"{r['cpu_before'][k]:.0%} / {r['cpu_flood'][k]:.0%}"]
            for k in r["cpu_before"]
        ],
    ]
    table = markdown_table(["figure", "value"], rows)
    print(table)
    if not args.no_write:
        command = f"python -m benchmarks.status_flood --devices {args.devices} --window {args.window:g} --flood {args.flood:g}"
        write_result("status_flood", __doc__ + "\n" + table, command=command)
    return r


if __name__ == "__main__":
    main()
