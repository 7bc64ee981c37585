"""Pushing a model to a fleet: 1 MB and 10 MB ONNX files to 20 `edge-trainer` processes through mosquitto.

Side by side, on loopback with the same 20 receiving processes' worth of fan-out:

* **push**: ``cloud_aggregator.models.push.push_model`` (retained chunks, 512 KiB by default, + a
  signed offer) until every device has fetched its chunks (streamed in on one subscription
  to the version's chunk topics, each written on the network thread as it is read),
  reassembled the file on disk and checked its signed sha256 (``completed_at`` in its status) —
  and, separately, until it has loaded the model in onnxruntime, scored it on its
  holdout and activated it (``activated_at``);
* **raw**: the same bytes published once as a plain QoS 1 message to 20 subscriber
  processes, and as the same chunks with no protocol around them.

Target: push within 2x of the raw single-message time.  Then the CPU a device spends
per MB fetched (its own ``process_time`` from the offer to the verified file, which it
reports as ``last_transfer.cpu_s``; and, from ``/proc``, everything until the model is
active) beside the CPU a raw subscriber process spends receiving the same bytes (its
own ``process_time`` per round) in the same run: target <= 2x, judged against both (one
message, the same chunks), beside a floor (the raw same-chunks receive plus one sha256 pass
and an fsynced write of the bytes: what any device that verifies must spend).  Then the device
daemons' peak RSS (``VmHWM``) with the 10 MB model loaded, after a FedRep round on its
embeddings (target < 150 MB).

``--quick`` (4 devices, one push per size, no FedRep round) returns its figures for the
suite, which checks orderings only (a device's fetch costs at least a raw receive of
the same bytes; more bytes cost more), never times.

    python -m benchmarks.model_push [--devices 20] [--sizes 1 10] [--repeats 5] [--chunk-size BYTES]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import markdown_table, remove_scratch, study_parser, write_result
from ioft_protocol import topics

MB = 1_000_000
FLEET = "bench"


# -- a raw receiver process ---------------------------------------------------------------------
def receiver(url: str, topic: str, counts: list[int]) -> None:
    """Subscribe, print ``ready <cpu>``, then for each round print the time its ``counts[i]``-th message
    landed and this process's CPU time then (``process_time``: all its threads, paho's included)."""
    import paho.mqtt.client as paho

    host, port = url.removeprefix("mqtt://").split(":")
    state = {"round": 0, "got": 0}
    done = threading.Event()

    def on_message(client, userdata, msg) -> None:
        state["got"] += 1
        if state["got"] == counts[state["round"]]:
            print(f"{time.time():.6f} {time.process_time():.6f}", flush=True)
            state["round"] += 1
            state["got"] = 0
            if state["round"] == len(counts):
                done.set()

    client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv311)
    client.on_message = on_message
    client.on_subscribe = lambda *a: print(f"ready {time.process_time():.6f}", flush=True)
    client.on_connect = lambda c, *a: c.subscribe(topic, qos=1)
    client.connect(host, int(port))
    client.loop_start()
    done.wait(600)
    client.disconnect()
    client.loop_stop()


class RawFanout:
    """``n`` subscriber processes and a publisher: the raw transfer of the same bytes, one round at a time.

    The receivers stay up across rounds, so each raw round runs right after its push,
    under the same conditions (the machine's load drifts over a run).  One untimed round
    first: a fresh receiver's first large messages are slower (its buffers grow).  (The
    devices' first push, which imports onnxruntime, is timed like the others.)
    """

    def __init__(self, url: str, n: int, payload: bytes, chunk: int, repeats: int) -> None:
        from ioft_protocol.mqtt import MqttSession
        from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

        self.payload = payload
        self.pieces = [payload[i : i + chunk] for i in range(0, len(payload), chunk)]
        counts = [1, len(self.pieces)] * (repeats + 1)
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.model_push",
                    "--receiver",
                    url,
                    "bench/raw",
                    *map(str, counts),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        self.cpu = []
        for p in self.procs:
            word, _, cpu = p.stdout.readline().strip().partition(" ")
            if word != "ready":
                raise RuntimeError("a raw receiver did not subscribe")
            self.cpu.append(float(cpu))
        self.session = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id="bench-raw"))
        self.session.start()
        self.round()  # warm-up, not timed

    def round(self) -> tuple[float, float, float, float]:
        """Seconds until every receiver got the payload as one message, then as the same chunks;
        and the median receiver's CPU seconds for each."""
        out, cpu = [], []
        for pieces in ([self.payload], self.pieces):
            t0 = time.time()
            for piece in pieces[:-1]:
                self.session.publish("bench/raw", piece, timeout=None)
            self.session.publish("bench/raw", pieces[-1], timeout=60)
            lines = [p.stdout.readline().split() for p in self.procs]
            out.append(max(float(t) for t, _ in lines) - t0)
            now = [float(c) for _, c in lines]
            cpu.append(statistics.median(b - a for a, b in zip(self.cpu, now, strict=True)))
            self.cpu = now
            time.sleep(0.3)
        return out[0], out[1], cpu[0], cpu[1]

    def stop(self) -> None:
        self.session.stop()
        for p in self.procs:
            p.wait(30)


# -- the fleet ---------------------------------------------------------------------------------------
class StatusBoard:
    """Latest retained status of every device."""

    def __init__(self, url: str) -> None:
        from ioft_protocol.mqtt import MqttSession
        from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

        self.status: dict[str, dict] = {}
        self.session = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id="bench-status"))
        self.session.subscribe(topics.topic_status_all(FLEET))
        self.session.start()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            msg = self.session.get(0.1)
            if msg is not None and msg.payload:
                self.status[topics.parse_topic(msg.topic).device] = json.loads(msg.payload)

    def model(self, device: str) -> dict:
        return ((self.status.get(device) or {}).get("models") or {}).get("enc") or {}

    def wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.02)
        raise RuntimeError(f"timed out waiting for {what}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.session.stop()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def hash_and_write_cpu(data: bytes, chunk: int, folder: Path) -> float:
    """CPU seconds to do what any verifying device must on top of receiving: one sha256 pass and
    writing the bytes to a new file (fsynced), chunk by chunk; measured in this process."""
    path = folder / "floor.part"
    started = time.process_time()
    h = hashlib.sha256()
    view = memoryview(data)
    with path.open("wb") as fh:
        for i in range(0, len(data), chunk):
            fh.write(view[i : i + chunk])
            h.update(view[i : i + chunk])
        fh.flush()
        os.fsync(fh.fileno())
    h.hexdigest()
    spent = time.process_time() - started
    path.unlink()
    return spent


def per(seconds: list[float], size: int) -> float:
    """Median milliseconds per MB of ``size`` bytes."""
    return 1000 * statistics.median(seconds) / (size / MB)


def quick_figures(cpu_rows: list[tuple]) -> dict:
    """Per size: median device fetch CPU and raw receive CPU (seconds), for the suite's checks."""
    return {
        "sizes": [
            {"bytes": size, "fetch_cpu": statistics.median(fetch), "raw_chunks_cpu": statistics.median(raw_c),
             "raw_whole_cpu": statistics.median(raw_w), "until_active_cpu": statistics.median(dev)}
            for size, fetch, dev, raw_w, raw_c, _ in cpu_rows
        ]
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int | dict:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        receiver(sys.argv[2], sys.argv[3], [int(c) for c in sys.argv[4:]])
        return 0
    from cloud_aggregator.models.push import DEFAULT_CHUNK_BYTES

    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 10.0], help="model sizes in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_BYTES)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)  # clean disconnects log a warning; not news here
    if args.quick:
        args.devices, args.repeats = min(args.devices, 4), 1

    # Imported here, not at the top: `--receiver` processes (the raw baseline) run this module
    # too and should carry nothing of the fleet's.
    from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
    from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
    from cloud_aggregator.models.push import push_model
    from export.keys import generate_keypair, load_private_key
    from export.synthetic import signed, window_encoder
    from ioft_protocol.mqtt import MqttSession
    from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

    interrupt_on_sigterm()  # `finally` below stops the broker and the devices
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="ioft-push-bench-"))
    fleet = LocalFleet.start(work, broker=start_mosquitto(log_file=work / "mosquitto.log"), fleet=FLEET)
    broker, url = fleet.broker, fleet.broker_url
    priv, pub = generate_keypair(work / "fleet.key")
    key = load_private_key(priv)
    names = [f"printer{i:02d}" for i in range(args.devices)]
    devices = fleet.devices
    board = StatusBoard(url)
    operator = MqttSession(SessionOptions(BrokerAddress.parse(url), client_id="bench-push"))
    operator.start()
    push_rows, raw_rows, cpu_rows = [], [], []
    loads = []  # 1-min load average at each push (the machine is shared)
    version = 0
    try:
        fleet.start_devices(names, "--model-key", str(pub), "--log-level", "WARNING", simulate="printer-raw")
        board.wait(
            lambda: all((board.status.get(d) or {}).get("state") == "online" for d in names), 300, "online"
        )
        print(f"{len(names)} devices online", file=sys.stderr)
        for size_mb in args.sizes:
            size = int(size_mb * MB)
            transfer, activate, publish, cpu_dev, cpu_broker, whole, chunked = [], [], [], [], [], [], []
            cpu_fetch, cpu_raw_whole, cpu_raw_chunked, cpu_floor = [], [], [], []
            raw = None
            for _ in range(args.repeats):
                version += 1
                onnx_path = window_encoder(work / f"v{version}.onnx", pad_bytes=size - 400, seed=version)
                pkg = signed(onnx_path, work / "pkg", key, version=version)
                loads.append(os.getloadavg()[0])
                cpu0 = [cpu_seconds(p.pid) for p in devices.values()], cpu_seconds(broker.proc.pid)
                t0 = time.time()
                report = push_model(operator, FLEET, pkg, chunk_size=args.chunk_size)

                def arrived(v=version) -> bool:
                    return all(
                        board.model(d).get("active") == v and (board.model(d).get("last_transfer") or {}).get("version") == v
                        for d in names
                    )  # fmt: skip

                board.wait(arrived, 300, f"v{version} active everywhere")
                cpu_dev.append(sum(cpu_seconds(p.pid) for p in devices.values()) - sum(cpu0[0]))
                cpu_broker.append(cpu_seconds(broker.proc.pid) - cpu0[1])
                transfer.append(max(board.model(d)["last_transfer"]["completed_at"] for d in names) - t0)
                activate.append(max(board.model(d)["activated_at"] for d in names) - t0)
                publish.append(report.seconds)
                reported = [board.model(d)["last_transfer"].get("cpu_s") for d in names]
                # (None: device code from before last_transfer.cpu_s, as in a baseline run of an older tree)
                cpu_fetch.append(statistics.median(reported) if None not in reported else math.nan)
                time.sleep(0.3)
                if raw is None:
                    raw = RawFanout(
                        url, len(names), pkg.onnx_path.read_bytes(), args.chunk_size, args.repeats
                    )
                w, c, cpu_w, cpu_c = raw.round()  # the same bytes, raw, right after the push
                whole.append(w)
                chunked.append(c)
                cpu_raw_whole.append(cpu_w)
                cpu_raw_chunked.append(cpu_c)
                cpu_floor.append(cpu_c + hash_and_write_cpu(raw.payload, args.chunk_size, work))
                print(
                    f"v{version} {pkg.manifest.size} B: transfer {transfer[-1]:.3f} s, raw {w:.3f} s",
                    file=sys.stderr,
                )
            raw.stop()
            push_rows.append((pkg.manifest.size, transfer, activate, publish, cpu_dev, cpu_broker))
            raw_rows.append((whole, chunked))
            cpu_rows.append(
                (
                    pkg.manifest.size,
                    cpu_fetch,
                    [c / len(names) for c in cpu_dev],
                    cpu_raw_whole,
                    cpu_raw_chunked,
                    cpu_floor,
                )
            )
        rss_loaded = {d: vm_kib(p.pid, "VmHWM") for d, p in devices.items()}
        if args.quick:  # the suite's run: pushes only
            return quick_figures(cpu_rows)
        # A FedRep round on the embeddings of the 10 MB encoder, then peak RSS again.
        agg_dir = work / "aggregator"
        task = {"name": "speed-raw", "algorithm": "fedrep", "model": "mlp", "rounds": 2, "seed": 0,
                "model_args": {"sizes": [2, 8, 1]}, "hparams": {"features": "onnx:enc", "local_steps": 5}}  # fmt: skip
        toml = aggregator_toml(url, agg_dir, [task], fleet=FLEET, expected=names, deadline_s=30.0)
        fleet.start_aggregator(toml, log_level="WARNING")
        rc = fleet.wait_aggregator(300)
        if rc != 0:
            raise RuntimeError(f"aggregator failed: {fleet.log('aggregator')[-2000:]}")
        rss_round = {d: vm_kib(p.pid, "VmHWM") for d, p in devices.items()}
        rounds = {
            d: (board.status.get(d) or {}).get("tasks", {}).get("speed-raw", {}).get("round") for d in names
        }
    finally:
        operator.stop()
        board.stop()
        fleet.stop()
        remove_scratch(work)

    med = statistics.median
    rows = []
    for (size, transfer, activate, publish, *_), (whole, chunked) in zip(push_rows, raw_rows, strict=True):
        ratio = med(transfer) / med(whole)
        rows.append([
            f"{size / MB:.2f}", f"{med(publish):.3f}", f"{med(transfer):.3f}", f"{med(activate):.3f}",
            f"{med(whole):.3f}", f"{med(chunked):.3f}", f"{ratio:.2f}x", "met" if ratio <= 2 else "NOT met",
            f"{size * len(names) / med(transfer) / MB:.0f}",
        ])  # fmt: skip
    table = markdown_table(
        ["model (MB)", "push publish (s)", "push: all verified on disk (s)", "push: all active (s)",
         "raw: one message (s)", "raw: same chunks (s)", "push / raw", "target <= 2x", "push fan-out (MB/s)"],
        rows,
    )  # fmt: skip
    cpu = markdown_table(
        [
            "model (MB)",
            f"devices' CPU per push, all {len(names)} (s)",
            "per device (ms)",
            "broker CPU per push (s)",
        ],
        [
            [f"{size / MB:.2f}", f"{med(dev):.2f}", f"{1000 * med(dev) / len(names):.0f}", f"{med(brk):.3f}"]
            for size, *_, dev, brk in push_rows
        ],
    )
    mib = lambda kib: kib / 1024  # noqa: E731
    rss = markdown_table(
        ["when", "max peak RSS (MiB)", "median (MiB)", "target < 150 MiB"],
        [
            ["after the pushes (10 MB model active)", f"{mib(max(rss_loaded.values())):.1f}",
             f"{mib(med(rss_loaded.values())):.1f}", "met" if mib(max(rss_loaded.values())) < 150 else "NOT met"],
            ["after 2 FedRep rounds on its embeddings", f"{mib(max(rss_round.values())):.1f}",
             f"{mib(med(rss_round.values())):.1f}", "met" if mib(max(rss_round.values())) < 150 else "NOT met"],
        ],
    )  # fmt: skip
    per_mb = markdown_table(
        ["model (MB)", "device: fetch + verify (ms/MB)", "device: until active (ms/MB)",
         "raw receive, same chunks (ms/MB)", "raw receive, one message (ms/MB)",
         "floor: raw chunks + sha256 + write (ms/MB)", "fetch / raw (chunks)", "target <= 2x (chunks)",
         "fetch / raw (one message)", "target <= 2x (one message)", "floor / raw (chunks)", "fetch / floor"],
        [
            [f"{size / MB:.2f}", f"{per(fetch, size):.2f}", f"{per(dev, size):.2f}", f"{per(raw_c, size):.2f}",
             f"{per(raw_w, size):.2f}", f"{per(floor, size):.2f}", f"{med(fetch) / med(raw_c):.2f}x",
             "met" if med(fetch) <= 2 * med(raw_c) else "NOT met", f"{med(fetch) / med(raw_w):.2f}x",
             "met" if med(fetch) <= 2 * med(raw_w) else "NOT met", f"{med(floor) / med(raw_c):.2f}x",
             f"{med(fetch) / med(floor):.2f}x"]
            for size, fetch, dev, raw_w, raw_c, floor in cpu_rows
        ],
    )  # fmt: skip
    load = os.getloadavg()
    cores = os.cpu_count()
    body = (
        f"{len(names)} `edge-trainer` processes (simulated printers with raw vibration windows), mosquitto on "
        f"loopback, chunks of {args.chunk_size // 1024} KiB, each device taking them as they stream in on one "
        f"subscription to the version's chunk topics (written on its network thread, one chunk held at a "
        f"time); median of {args.repeats} pushes per size (times from the start of the push to the "
        f"last device). Raw: the same bytes to {len(names)} subscriber processes, one raw round right after each "
        f"push (medians over as many rounds). Load average (1 min) before "
        f"the run: {load_start[0]:.1f}; at the pushes (the benchmark's own processes included): median "
        f"{statistics.median(loads):.1f}, {min(loads):.1f} to {max(loads):.1f}; at the end: {load[0]:.1f}."
        f"\n\n{table}\n\nCPU time the device daemons and the broker spent per push, from the push until "
        f"the model was active on every device (fetch, verify, onnxruntime load, holdout score, activation), "
        f"median over the pushes (/proc times: {1000 // os.sysconf('SC_CLK_TCK')} ms resolution per process); "
        f"the machine has {cores} cores:\n\n{cpu}\n\n"
        f"CPU per MB fetched, per device (medians over the devices, then over the pushes). "
        f"*fetch + verify*: the device's own process CPU time (`time.process_time`, all its threads: MQTT "
        f"receive, chunk parsing, the file's sha256, writes, fsync) from the offer to the verified file, "
        f"reported in its status as `last_transfer.cpu_s`; *until active*: /proc CPU per device from the push "
        f"until the model was active (adds the onnxruntime load and the holdout score, a cost per model, "
        f"not per MB). *raw receive*: a paho subscriber process's own CPU time receiving the same bytes (as "
        f"the same {args.chunk_size // 1024} KiB chunks, and as one message) in the same run, right after "
        f"each push. *floor*: the raw same-chunks receive plus what a device that verifies must add at "
        f"least (one sha256 pass over the bytes and writing them to a new fsynced file, timed in the "
        f"benchmark's own process on the same bytes):\n\n{per_mb}\n\nDevice daemon peak RSS (VmHWM) "
        f"with the model loaded "
        f"(rounds completed: {sorted(set(rounds.values()))}):\n\n{rss}\n"
    )
    print(body)
    if not args.no_write:
        name = "model_push" + (
            "_quick" if args.quick else "" if args.devices == 20 else f"_{args.devices}dev"
        )
        path = write_result(name, body, command="python -m benchmarks.model_push " + " ".join(sys.argv[1:]))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    result = main()
    if isinstance(result, dict):  # --quick
        print(json.dumps(result, indent=2))
    sys.exit(0 if isinstance(result, dict) else result)
