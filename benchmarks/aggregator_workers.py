"""Aggregator workers: uploads admitted per second with K = 1, 2, 4 workers sharing the uplink.

``cloud-aggregator serve`` with ``[collect] workers = K`` (K = 1: serve alone, as before) on the
``echo`` task with P float32 parameters, against one mosquitto and a blaster: one MQTT client
that keeps N devices' retained statuses online and, on each round's announcement, publishes
their N uploads at once (identical uploads, so the global never moves and the blaster encodes
the next round's while the aggregator works on this one).  The aggregator is then the
bottleneck: each upload is decoded, checked (shape, finiteness, norm) and folded, O(P) float64 passes, against the
broker's two copies.  Uploads per second = N / the median round time from the store (announce
→ every upload admitted and merged → new global).  CPU seconds per round of the coordinator,
the workers, the broker and the blaster say where the cores went.  ``--repeat R`` runs the K list
R times interleaved and reports each K's median run (a shared machine's load drifts).

``--quick`` (the test suite) never times: N = 24 devices whose uploads differ (each its own
step, per round), P = 1,000, 3 rounds, K = 1 and K = 2; it returns both runs' final globals,
which must be bit-identical (``cloud_aggregator.aggregation.streaming``: merged partial sums change only the
order of compensated additions).
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho

from benchmarks.common import markdown_table, progress, remove_scratch, study_parser, write_result
from benchmarks.fleet_scale import broker_for, children, cpu_s
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import round_messages, topics
from ioft_protocol.mqtt_options import BrokerAddress
from trainer_lite.params import param_hash


class Blaster:
    """N devices' statuses and uploads from one client; ``distinct``: each upload its own step."""

    def __init__(self, broker: str, n: int, distinct: bool) -> None:
        self.names = [f"dev{i:05d}" for i in range(n)]
        self.distinct = distinct
        self.answered: set[tuple[int, str]] = set()
        self._cache: tuple[tuple[int, str], list[tuple[str, bytes]]] | None = None
        self._next: threading.Thread | None = None
        b = BrokerAddress.parse(broker)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="blaster")
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.on_message = self._on_message
        self.client.connect(b.host, b.port, keepalive=60)
        self.client.subscribe(topics.topic_down(FLEET, "bench"), qos=1)
        self.client.subscribe(topics.topic_down(FLEET, "bench") + "/+", qos=1)  # re-send requests
        # serve counts a device live once it answers the roll call (a retained "online" is not enough)
        self.client.subscribe(topics.topic_roll_call(FLEET), qos=1)
        self.sent: dict[int, float] = {}  # round -> when its uploads were all handed to paho
        self.resent = 0
        self._statuses()
        self.client.loop_start()

    def _statuses(self) -> None:
        for name in self.names:
            status = b'{"state": "online", "tasks": {}}'
            self.client.publish(topics.topic_status(FLEET, name), status, qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:
        if msg.topic == topics.topic_roll_call(FLEET):  # every device answers, as edge.daemon does
            self._statuses()
            return
        ann = round_messages.Announcement.decode(bytes(msg.payload), max_bytes=1 << 30)
        if ann.for_device is not None:  # the coordinator asks again: re-send the kept upload, as edge.daemon
            kept = dict(self._cache[1]) if self._cache is not None else {}
            topic = topics.topic_up(FLEET, "bench", ann.for_device)
            if topic in kept:
                client.publish(topic, kept[topic], qos=1)
                self.resent += 1
            return
        if ann.state != "running" or (ann.round, ann.phase) in self.answered:
            return
        self.answered.add((ann.round, ann.phase))
        for topic, payload in self._uploads(ann):
            client.publish(topic, payload, qos=1)
        self.sent[ann.round] = time.time()

    def _uploads(self, ann: round_messages.Announcement) -> list[tuple[str, bytes]]:
        key = (ann.round, ann.global_hash)
        if self._next is not None:
            self._next.join()
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._encode(ann.round, ann.phase, ann.global_hash, ann.params))
        out = self._cache[1]
        if not self.distinct:  # the global will not move: encode the next round's while this one runs
            args = (ann.round + 1, ann.phase, ann.global_hash, ann.params)
            self._next = threading.Thread(target=self._encode_next, args=args, daemon=True)
            self._next.start()
        return out

    def _encode_next(self, round_: int, phase: str, global_hash: str, params) -> None:
        self._cache = ((round_, global_hash), self._encode(round_, phase, global_hash, params))

    def _encode(self, round_: int, phase: str, global_hash: str, params) -> list[tuple[str, bytes]]:
        out = []
        for i, name in enumerate(self.names):
            step = np.float32(1e-3 * (1 + (i * 7919 + round_ * 104729) % 1000 / 1000)) if self.distinct else 0
            mine = {k: (v + step).astype(v.dtype) for k, v in params.items()}
            msg = round_messages.UpdateMessage(FLEET, "bench", name, round_, phase, 1, global_hash, {}, mine)
            out.append((topics.topic_up(FLEET, "bench", name), msg.encode()))
        return out

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def run_case(
    n: int, p: int, k: int, rounds: int, warmup: int, distinct: bool, kill_round: int | None = None
) -> dict:
    """One serve run; with ``kill_round``, one worker is SIGKILLed 20 ms after that round's uploads
    were published (``serve`` starts it again a second later)."""
    work = Path(tempfile.mkdtemp(prefix=f"ioft-workers-{k}-"))
    fleet = LocalFleet.start(work, broker=broker_for(work, n))
    blaster = Blaster(fleet.broker_url, n, distinct)
    try:
        # One more round than measured: serve still runs when the last measured one is stored.
        task = {"name": "bench", "algorithm": "echo", "model": "vector", "rounds": warmup + rounds + 1}
        task["model_args"] = {"size": p}
        toml = aggregator_toml(
            fleet.broker_url,
            work / "aggregator",
            [task],
            expected=blaster.names,
            deadline_s=600,
            startup_wait_s=120,
            settings={"max_payload_bytes": 64 << 20},
        ).replace("[collect]\n", f"[collect]\nworkers = {k}\n")
        agg = fleet.start_aggregator(toml, log_level="WARNING")
        broker_pid = fleet.broker.proc.pid
        snaps: list[dict[str, float]] = []
        killed: float | None = None
        db, monitor = work / "aggregator" / "aggregator.sqlite", None
        while agg.poll() is None:  # CPU counters when the warm-up and the measured rounds are stored
            if monitor is None and db.exists():
                monitor = SqliteStore(db, readonly=True)
            done = monitor.round_count("bench") if monitor is not None else 0
            if len(snaps) < 2 and done >= (warmup, warmup + rounds)[len(snaps)]:
                snaps.append(_cpu(agg.pid, children(agg.pid), broker_pid, blaster))
            if kill_round is not None and killed is None and kill_round in blaster.sent:
                time.sleep(0.02)
                victim = children(agg.pid)[0]
                os.kill(victim, signal.SIGKILL)
                killed = time.time()
            time.sleep(0.005)
        if monitor is not None:
            monitor.close()
        if agg.returncode != 0 or len(snaps) < 2:
            raise RuntimeError(f"serve failed ({agg.returncode}): {fleet.log('aggregator')[-2000:]}")
        store = SqliteStore(db, readonly=True)
        try:
            recs = [r for r in store.rounds("bench") if r.round <= warmup + rounds]
            final = store.get_params(recs[-1].global_hash)
        finally:
            store.close()
        thin = [r.round for r in recs if len(r.participants) != n]
        if thin:
            raise RuntimeError(f"rounds {thin} lacked uploads: the figures would measure a deadline")
        timed = [r.finished - r.started for r in recs if r.round > warmup]
        if kill_round is not None:
            hit = next(r for r in recs if r.round == kill_round)
            asked = [
                line for line in fleet.log("aggregator").splitlines() if "not counted after a worker" in line
            ]
            return {
                "k": k,
                "n": n,
                "p": p,
                "killed": killed is not None,
                "lost": sum(n - len(r.participants) for r in recs),
                "closed": hit.extra.get("closed"),
                "recover_s": hit.finished - killed if killed is not None else float("nan"),
                "round_s": hit.finished - hit.started,
                "median_round_s": statistics.median(
                    r.finished - r.started for r in recs if r.round != kill_round
                ),
                "asked": len(asked),
                "resent": blaster.resent,
            }
        return {
            "k": k,
            "n": n,
            "p": p,
            "round_s": statistics.median(timed),
            "uploads_s": n / statistics.median(timed),
            "final": param_hash(final),
            **{f"cpu_{who}": (snaps[1][who] - snaps[0][who]) / rounds for who in snaps[0]},
        }
    finally:
        blaster.stop()
        fleet.stop_all()
        fleet.stop()
        remove_scratch(work)


def _cpu(agg: int, workers: list[int], broker: int, blaster: Blaster) -> dict[str, float]:
    """CPU seconds so far: serve, its workers, the broker, and this process (the blaster)."""
    out = {"coordinator": cpu_s(agg), "broker": cpu_s(broker), "blaster": cpu_s(os.getpid())}
    out["workers"] = sum(cpu_s(w) for w in workers if Path(f"/proc/{w}").exists())
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=400)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the K list this many times, interleaved (a shared machine's load drifts)",
    )
    parser.add_argument(
        "--kill",
        action="store_true",
        help="K = 2, one worker SIGKILLed mid-round: uploads lost, time to recover",
    )
    args = parser.parse_args(argv)
    if args.kill:
        r = run_case(args.devices, args.params, 2, args.rounds, args.warmup, True, kill_round=args.warmup + 1)
        print(
            f"N = {r['n']}, P = {r['p']:,}, K = 2, a worker SIGKILLed 20 ms after round {args.warmup + 1}'s "
            f"uploads were published: uploads lost {r['lost']} (all rounds), round closed {r['closed']!r}, "
            f"{r['recover_s']:.2f} s from the kill to the round's end (that round {r['round_s']:.2f} s, the others' "
            f"median {r['median_round_s']:.2f} s); re-send requests {r['asked']}, uploads re-sent {r['resent']}"
        )
        return r
    if args.quick:
        args.devices, args.params, args.workers, args.rounds, args.warmup = 24, 1_000, [1, 2], 3, 0
    results, load_before = [], os.getloadavg()
    for k in progress([k for _ in range(args.repeat) for k in args.workers], "runs"):
        results.append(run_case(args.devices, args.params, k, args.rounds, args.warmup, distinct=args.quick))
    if args.quick:  # correctness only: the split run's model is the single aggregator's
        return {"results": results}
    by_k = {k: [r for r in results if r["k"] == k] for k in args.workers}
    # Each K's median run (by uploads/s) stands in the table; the others are listed beside it.
    runs = {k: sorted(rs, key=lambda r: r["uploads_s"])[len(rs) // 2] for k, rs in by_k.items()}
    base = runs[args.workers[0]]["uploads_s"]
    rows = [
        [
            r["k"],
            f"{r['n']:,}",
            f"{r['p']:,}",
            f"{r['round_s']:.3f} s",
            f"{r['uploads_s']:.0f}",
            " / ".join(f"{x['uploads_s']:.0f}" for x in by_k[r["k"]]),
            f"{r['uploads_s'] / base:.2f}×",
            *(f"{r['cpu_' + who]:.2f} s" for who in ("coordinator", "workers", "broker", "blaster")),
        ]
        for r in runs.values()
    ]
    headers = ["workers K", "N", "P", "median round", "uploads/s admitted", "each run", "vs K = 1"]
    headers += ["coordinator CPU/round", "workers CPU/round", "broker CPU/round", "blaster CPU/round"]
    table = markdown_table(headers, rows)
    # The machine is shared: other processes' load says how many of its cores these runs had.
    load = f"Load average (1 min) before: {load_before[0]:.1f}, after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    print(table + "\n\n" + load)
    if not args.no_write:
        write_result("aggregator_workers", table + "\n\n" + load)
    return {"results": results, "table": table}


if __name__ == "__main__":
    main()
