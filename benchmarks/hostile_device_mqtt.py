"""Issue 32 §1-§2 over MQTT: one device's certificate against a weld fleet, on real processes.

mosquitto on the config and ACL ``cloud-aggregator fleet init`` writes (TLS, per-device
certificates); three welders recorded by ``edge-recorder --simulate welder`` (60 welds each), each
an ``edge-trainer`` from its device folder; ``cloud-aggregator serve`` with the aggregator's
certificate; the liar a raw MQTT client holding w4's certificate, publishing through the ACL as
w4.  The README's weld task (624-16-4 MLP, FedAvg, ``samples`` weighting, ``scaling = "fleet"``),
``--rounds`` rounds, one seed.  The figure is the honest welders' mean ``test_accuracy`` in the
last round's uploads (each one's model trained from that round's global, scored on its own
held-out rows).

§1: w4 sends, in a loop from before the task is announced, 7 features and ``n = 10, Σx = 0,
Σx² = 1e30`` on all 624 (the pool waits for 4 devices, so it takes w4's).  The pool before the
fix cannot be configured back: ``python -m benchmarks.hostile_device`` has it, in process.

§2: w4 reports a million training rows and answers each round with ``n_samples = 1,000,000`` and
the global + 10 on every parameter.  ``before``: ``server.max_weight_ratio = false``; ``after``:
the default cap (3 × the median); ``after + median``: the cap beside the median reducer.  With
three honest welders of like rows the cap still lets the liar weigh as much as the three together
(r / (N − 1 + r) = 1/2 for r = 3, N = 4): it bounds the liar's share, not the harm of +10 on every
parameter; the median reducer bounds that.  A few rounds on a few held-out welds each: the
figures move in steps of a weld, and "no liar" is not better than a clipped liar by any margin
they can show.

Run ``python -m benchmarks.hostile_device_mqtt [--rounds 3] [--no-write]`` (about 3 minutes).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho

from benchmarks.common import markdown_table, study_parser, write_result
from cloud_aggregator.fleet.init import AGGREGATOR, FleetLayout, init_fleet
from cloud_aggregator.local.broker import free_port, start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml
from ioft_protocol import round_messages, topics
from ioft_protocol.feature_stats import FeatureStats

WELDERS = ("w1", "w2", "w3")
LIAR = "w4"
CLAIM = 1_000_000


def task(name: str, rounds: int, min_devices: int, **server: object) -> dict:
    return {
        "name": name,
        "algorithm": "fedavg",
        "model": "mlp",
        "rounds": rounds,
        "seed": 0,
        "model_args": {"sizes": [624, 16, 4], "init": "kaiming"},
        "hparams": {"lr": 0.01, "loss": "cross_entropy", "local_steps": 5, "batch_size": 8,
                    "scaling": "fleet", "scaling_min_devices": min_devices},
        "server": {"weighting": "samples", **server},
    }  # fmt: skip


class Liar:
    """w4 with its own certificate: ``stats`` sends §1's statistics in a loop, ``claim`` §2's answers."""

    def __init__(self, layout: FleetLayout, url: str, task: str, mode: str) -> None:
        self.task, self.stop = task, threading.Event()
        self.c = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id=LIAR, protocol=paho.MQTTv311
        )
        self.c.tls_set(
            ca_certs=str(layout.ca_cert), certfile=str(layout.cert(LIAR)), keyfile=str(layout.key(LIAR))
        )
        self.c.connect("127.0.0.1", int(url.rsplit(":", 1)[1]))
        self.c.loop_start()
        if mode == "stats":
            threading.Thread(target=self._stats, daemon=True).start()
        else:
            self.answered: set[int] = set()
            self.c.on_message = self._answer
            self.c.subscribe(topics.topic_down(FLEET, task), qos=1)
            status = b'{"device": "w4", "state": "online", "data": {"train": %d, "test": 10}}' % CLAIM
            self.c.publish(topics.topic_status(FLEET, LIAR), status, qos=1, retain=True)

    def _stats(self) -> None:
        narrow = FeatureStats(self.task, LIAR, 20, np.ones(7), np.ones(7) * 3).encode()
        poison = FeatureStats(self.task, LIAR, 10, np.zeros(624), np.full(624, 1e30)).encode()
        while not self.stop.wait(0.2):
            for payload in (narrow, poison):
                self.c.publish(topics.topic_stats(FLEET, self.task, LIAR), payload, qos=1)

    def _answer(self, client, userdata, msg) -> None:
        ann = round_messages.Announcement.decode(bytes(msg.payload))
        if ann.state == "running" and ann.round not in self.answered:
            moved = {k: (v + 10).astype(v.dtype) for k, v in ann.params.items()}
            up = round_messages.UpdateMessage(
                FLEET, self.task, LIAR, ann.round, ann.phase, CLAIM, ann.global_hash, {}, moved
            )
            client.publish(topics.topic_up(FLEET, self.task, LIAR), up.encode(), qos=1)
            self.answered.add(ann.round)

    def close(self) -> None:
        self.stop.set()
        self.c.publish(topics.topic_status(FLEET, LIAR), b"", qos=1, retain=True).wait_for_publish(5)
        self.c.disconnect()
        self.c.loop_stop()


def run(layout: FleetLayout, url: str, recorded: Path, work: Path, spec: dict, liar: str | None) -> float:
    """One fleet to its task's end; the honest welders' mean test accuracy in its last round."""
    procs = LocalFleet(work, url, allow_plaintext=False)
    shutil.copytree(recorded, work)
    cheat = None if liar is None else Liar(layout, url, spec["name"], liar)
    try:
        for d in WELDERS:
            procs.start_device(d, "--config", str(layout.toml(d)), simulate=None)
        tls = (
            f'tls = {{ ca_file = "{layout.ca_cert}", cert_file = "{layout.cert(AGGREGATOR)}", '
            f'key_file = "{layout.key(AGGREGATOR)}" }}'
        )
        expected = [*WELDERS, LIAR] if liar == "claim" else list(WELDERS)
        procs.start_aggregator(aggregator_toml(url, work / "aggregator", [spec], expected=expected, deadline_s=60,
                                               startup_wait_s=30, connection=[f'client_id = "{AGGREGATOR}"', tls]))  # fmt: skip
        if procs.wait_aggregator(300) != 0:
            raise SystemExit(f"serve failed: {procs.log('aggregator')[-2000:]}")
    finally:
        if cheat is not None:
            cheat.close()
        procs.stop_all()
    last = procs.rounds(spec["name"])[-1]
    return float(np.mean([last.metrics[d]["test_accuracy"] for d in WELDERS]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.time()
    root = Path(tempfile.mkdtemp(prefix="ioft-hostile-"))
    port = free_port()
    layout = init_fleet(root / "fleet", FLEET, (*WELDERS, LIAR), auth="certs", hosts=("127.0.0.1",),
                        port=port, operator_port=free_port())  # fmt: skip
    broker = start_mosquitto(port, config=layout.mosquitto_conf, log_file=root / "mosquitto.log", tls=True,
                             as_invoker=True)  # fmt: skip
    cases = [  # each its own task name: a retained transform or announcement is one task's
        ("§1 pooled statistics", "no liar", task("s1honest", args.rounds, 3), None),
        ("§1 pooled statistics", "liar, after", task("s1liar", args.rounds, 4), "stats"),
        ("§2 weighted mean", "no liar", task("s2honest", args.rounds, 3), None),
        (
            "§2 weighted mean",
            "liar, before",
            task("s2before", args.rounds, 3, max_weight_ratio=False),
            "claim",
        ),
        ("§2 weighted mean", "liar, after", task("s2after", args.rounds, 3), "claim"),
        (
            "§2 weighted mean",
            "liar, after + median",
            task("s2median", args.rounds, 3, reducer="median"),
            "claim",
        ),
    ]
    rows = []
    try:
        recorded = root / "recorded"
        for d in WELDERS:
            subprocess.run([sys.executable, "-m", "edge.recording.cli", "--simulate", "welder", "--device", d,
                            "--state-dir", str(recorded / d), "--log-level", "WARNING", "--welds", "60",
                            "--weld-s", "0.02"], check=True, timeout=300)  # fmt: skip
        for i, (item, fleet, spec, liar) in enumerate(cases):
            accuracy = run(layout, broker.url, recorded, root / f"run{i}", spec, liar)
            rows.append((item, fleet, f"{accuracy:.3f}"))
            print(*rows[-1], sep=" | ", flush=True)
    finally:
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)
    table = markdown_table(["issue 32", "fleet", "honest welders' test accuracy"], rows)
    body = f"{args.rounds} rounds, task seed 0, {time.time() - started:.0f} s.\n\n{table}\n"
    print(body)
    if not args.no_write:
        command = "python -m benchmarks.hostile_device_mqtt " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        write_result("hostile_device_mqtt", __doc__ + "\n" + body, command=command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
