"""Round time on three brokers, same fleet: mosquitto, one RabbitMQ node (MQTT plugin), and a
two-node RabbitMQ cluster with the devices on node A and the aggregator on node B.

N ``edge-trainer`` processes run the zero-compute ``echo`` algorithm with P float32 shared
parameters (as ``benchmarks.round_overhead``); per broker the median and the largest round
time (``finished - started`` in the aggregator's store) over the measured rounds after a
warm-up.  Every round must have all N uploads and no refusal, or the case fails: a round that
waited for its deadline would measure the deadline.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from benchmarks.common import markdown_table, progress, remove_scratch, study_parser, write_result
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.local.rabbitmq import start_cluster
from cloud_aggregator.store.sqlite import SqliteStore

BROKERS = ("mosquitto", "rabbitmq", "rabbitmq-cluster")


def run_case(broker: str, n: int, p: int, rounds: int, warmup: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ioft-broker-rounds-{broker}-"))
    cluster = mosquitto = None
    if broker == "mosquitto":
        mosquitto = start_mosquitto()
        devices_url = aggregator_url = mosquitto.url
    else:
        cluster = start_cluster(work / "rabbitmq", 2 if broker == "rabbitmq-cluster" else 1)
        devices_url, aggregator_url = cluster.nodes[0].url, cluster.nodes[-1].url
    fleet = LocalFleet(work, devices_url)
    try:
        names = [f"dev{i}" for i in range(n)]
        fleet.start_devices(names, "--log-level", "WARNING", simulate="printer")
        task = {"name": "bench", "algorithm": "echo", "model": "vector", "rounds": warmup + rounds}
        task["model_args"] = {"size": p}
        toml = aggregator_toml(aggregator_url, work / "aggregator", [task], expected=names, deadline_s=60)
        fleet.start_aggregator(toml, log_level="WARNING")
        if fleet.wait_aggregator(600) != 0:
            raise RuntimeError(f"aggregator failed: {fleet.log('aggregator')[-2000:]}")
        store = SqliteStore(work / "aggregator" / "aggregator.sqlite", readonly=True)
        recs = [r for r in store.rounds("bench") if warmup < r.round <= warmup + rounds]
        refused = store.rejection_counts("bench")
        store.close()
        thin = [r.round for r in recs if len(r.participants) != n]
        if thin or refused or len(recs) != rounds:
            raise RuntimeError(f"{broker}: rounds {thin} lacked uploads; refused per device: {refused}")
        times = [r.finished - r.started for r in recs]
        return {"broker": broker, "n": n, "p": p, "median_s": statistics.median(times), "max_s": max(times)}
    finally:
        fleet.stop_all()
        if mosquitto is not None:
            mosquitto.stop()
        if cluster is not None:
            cluster.stop()
        remove_scratch(work)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--brokers", nargs="+", choices=BROKERS, default=list(BROKERS))
    parser.add_argument("--devices", type=int, nargs="+", default=[10])
    parser.add_argument("--params", type=int, nargs="+", default=[1_000, 150_000])
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    interrupt_on_sigterm()  # each case's `finally` stops its brokers and devices
    if args.quick:
        args.devices, args.params, args.rounds = [3], [1_000], 3
    cases = [(b, n, p) for n in args.devices for p in args.params for b in args.brokers]
    results = [run_case(b, n, p, args.rounds, args.warmup) for b, n, p in progress(cases, "cases")]
    rows = [
        [r["broker"], r["n"], f"{r['p']:,}", f"{r['median_s'] * 1000:.0f} ms", f"{r['max_s'] * 1000:.0f} ms"]
        for r in results
    ]
    table = markdown_table(["broker", "devices", "parameters", "median round", "largest round"], rows)
    print(table)
    if not args.no_write:
        write_result("broker_rounds", __doc__ + "\n" + table)
    return results


if __name__ == "__main__":
    main()
