"""From a weld file landing in the watched folder (or a printer layer's row) to its answer at an MQTT subscriber.

Real processes on a real mosquitto: ``edge-recorder`` (welder: the watched folder polled
every 5 ms; printer: ``--simulate printer``) feeds each row to ``edge-trainer``, whose
serving model answers on ``ioft/v1/<fleet>/answer/<device>/<task>``; a paho subscriber here
stamps each answer's arrival.  The serving models are written straight into the devices'
state folders (the tasks' initial parameters: latency does not depend on what was learned).

* weld: from the moment the weld's data file is renamed into the folder (its ``.done`` marker
  follows at once) to the answer received -- folder poll, SHA-256 ledger, file read, the 624
  DWT features, the row feed, the answer, the broker;
* printer layer: from the row's time (the recorder's layer row exists) to the answer received;
  the layer's end is seen by the recorder at its next Moonraker poll (``poll_s``), before that.

Device CPU per answer: CPU seconds of the processes over the run / answers (the recorder's
includes its folder polling while idle, the DWT and the dataset appends). Added RSS: the
serving trainer's resident set minus that of the same trainer with ``[serve] enabled = false``
running beside it on the same rows.  Targets: weld p99 <= 50 ms, layer p99 <= 5 ms, RSS +10 MB.

Several runs (``--runs``, default 3): the table gives each figure's median over the runs and
the spread of their p99, with the load average of each run (this machine is shared).

``--arm64`` (as root, on an x86_64 Debian host) runs the same measurement a second time with
``edge-trainer`` and ``edge-recorder`` inside ``make pi-check``'s arm64 bookworm root under
qemu-user-static (:mod:`deploy.pi_root`; built once, ~10 min), the project installed there
from ``git HEAD`` as ``make pi-check`` installs it; mosquitto and the subscriber stay on the
host.  Its table is labelled **emulated**: qemu translates every instruction on this x86_64
CPU, so its times are neither this machine's nor a Raspberry Pi's.

``--hung-moonraker`` times printer layers only, twice on one mosquitto: a serving model that
advises a speed (``[serve] vibration_budget``), first publishing it only, then applying it
(``apply = "moonraker"``, ``dry_run = false``) to a Moonraker that accepts every connection and
never answers (:class:`sensors.sim.printer_host.HungMoonraker`); the two rows' p99 side by side
(:mod:`benchmarks.serve_latency_hung`; with ``--arm64`` also in the arm64 root, emulated).

    python -m benchmarks.serve_latency [--quick] [--runs N]
    python -m benchmarks.serve_latency --hung-moonraker [--layers N] --no-write
    sudo .venv/bin/python -m benchmarks.serve_latency [--hung-moonraker] --arm64
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho

from benchmarks.common import markdown_table, study_parser, write_result
from cloud_aggregator.local.broker import BrokerProcess, start_mosquitto
from cloud_aggregator.local.fleet import pflda_task
from edge.feed import feed_path
from edge.jsonlog import read_log
from edge.serving.conformal import Calibration
from edge.serving.model import ServingModel
from edge.serving.offers import model_path
from ioft_protocol import topics
from trainer_lite.algorithms import make_client
from trainer_lite.task import TaskSpec

FLEET = "bench"
WELD_TASK = {
    "name": "tool",
    "algorithm": "fedavg",
    "model": "mlp",
    "model_args": {"sizes": [624, 32, 4], "init": "kaiming"},
    "hparams": {"loss": "cross_entropy", "scaling": "local"},
}
TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Answers:
    """A subscriber stamping every answer's arrival (wall clock, as the rows are stamped)."""

    def __init__(self, url: str, device: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.got: dict[str, tuple[float, dict]] = {}
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.c = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2)
        self.c.on_connect = lambda c, *a: c.subscribe(topics.topic_answer_all(FLEET, device), qos=1)
        self.c.on_subscribe = lambda *a: self.ready.set()
        self.c.on_message = self._on
        self.c.connect(host, int(port))
        self.c.loop_start()
        self.ready.wait(10)

    def _on(self, client, userdata, msg) -> None:
        t = time.time()
        if msg.retain:
            return  # an earlier run's latest answer
        body = json.loads(msg.payload)
        with self.lock:
            self.got[body["key"]] = (t, body)

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@dataclass(frozen=True)
class Launcher:
    """How a device process starts: on this host, or in the arm64 root under qemu (``root``)."""

    root: Path | None = None
    python: str = sys.executable
    #: Seconds a process may take to start (imports under qemu are slow) or to drain its rows.
    startup_s: float = 60.0
    env: dict[str, str] = field(default_factory=lambda: {**os.environ, "PYTHONUNBUFFERED": "1"})

    def argv(self, module_args: Sequence[str]) -> list[str]:
        cmd = [self.python, "-m", *module_args]
        return cmd if self.root is None else ["chroot", str(self.root), *cmd]

    def path(self, host_path: Path) -> str:
        """``host_path`` as the device process sees it (inside the root: relative to it)."""
        if self.root is None:
            return str(host_path)
        return "/" + str(Path(host_path).resolve().relative_to(self.root.resolve()))


HOST = Launcher()


def spawn(args: list[str], log: Path, launcher: Launcher = HOST) -> subprocess.Popen:
    with log.open("ab") as f:
        return subprocess.Popen(launcher.argv(args), stdout=f, stderr=subprocess.STDOUT, env=launcher.env)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def trainer(
    work: Path, device: str, broker: BrokerProcess, serve: bool, launcher: Launcher = HOST, extra: str = ""
) -> subprocess.Popen:
    state = work / device
    toml = work / f"{device}.toml"
    toml.write_text(f"[serve]\nenabled = {'true' if serve else 'false'}\n{extra}")
    args = ["edge.cli", "--device", device, "--fleet", FLEET, "--broker", broker.url, "--allow-plaintext",
            "--state-dir", launcher.path(state), "--config", launcher.path(toml), "--log-level", "WARNING"]  # fmt: skip
    return spawn(args, work / f"{device}.log", launcher)


def wait_serving(work: Path, device: str, timeout: float = 60) -> None:
    """Until the trainer listens on its wake-up socket (it reads the feed from then on)."""
    sock = work / device / "serving" / "wake.sock"
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{device} never started serving:\n{(work / f'{device}.log').read_text()[-3000:]}"
            )
        time.sleep(0.05)


#: A printer model that advises: speed/50 = 2 sigma_a + 0.5 (85 mm/s at sigma_a 0.6).
ADVISING_TASK = {"name": "speed", "algorithm": "fedavg", "model": "mlp", "model_args": {"sizes": [1, 1]}}
ADVISING_PARAMS = {"fc0.weight": np.array([[2.0]], np.float32), "fc0.bias": np.array([0.5], np.float32)}


def save_model(
    state: Path, device: str, spec: dict, *, width: int, classes=None, schema=None, x=None, shared=None
) -> None:
    algo = make_client(TaskSpec.from_json(json.dumps({**spec, "name": spec["name"]})))
    rng = np.random.default_rng(0)
    mean = std = None
    if x is not None:
        mean, std = x.mean(axis=0), np.where(x.std(axis=0) > 1e-12, x.std(axis=0), 1.0)
    model = ServingModel(
        device=device,
        task=spec["name"],
        spec_json=algo.spec.to_json(),
        round=1,
        shared=algo.init_global(rng) if shared is None else shared,
        local=algo.init_local(rng),
        width=width,
        schema_hash=schema,
        classes=classes,
        scale_mean=mean,
        scale_std=std,
    )
    if shared is not None:  # the advising model: calibrated (20 rows it fits), so it advises from the start
        model.calibration = Calibration([0.0] * 20)
    model_path(state, spec["name"]).parent.mkdir(parents=True, exist_ok=True)
    model.save(model_path(state, spec["name"]))


def summary(lat_s: list[float]) -> tuple[float, float, float]:
    ms = np.asarray(lat_s) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max())


def bench_welds(work: Path, broker: BrokerProcess, n: int, gap_s: float, launcher: Launcher = HOST) -> dict:
    from sensors.features.pipeline import labelled_rows
    from sensors.features.schema import DEFAULT_SCHEMA
    from sensors.sim.welder import GROUP_M_CLASSES, WeldCondition, simulate_weld
    from sensors.welding.formats import write_weld_file
    from trainer_lite.client import derive_rng

    dev, off = "w1", "w1off"
    inbox, staging = work / "inbox", work / "staging"
    for d in (inbox, staging, work / dev, work / off):
        d.mkdir(parents=True, exist_ok=True)
    labels, files, recs = [], [], []
    for i in range(n):
        name, (horn, anvil) = GROUP_M_CLASSES[i % 4]
        rec = simulate_weld(WeldCondition(horn, anvil, "clean", "Cu-Cu", 0.9), derive_rng(0, "bench", i),
                            time_scale=0.3, weld_id=f"w-{i:04d}")  # fmt: skip
        recs.append(rec)
        files.append(write_weld_file(rec, staging / f"{rec.weld_id}.npy"))
        labels.append(json.dumps({"weld_id": rec.weld_id, "tool": name, "surface": "clean"}))
    (work / "maintenance.jsonl").write_text("\n".join(labels) + "\n")
    x = np.stack([r.features for r in labelled_rows(recs[: min(n, 16)])])
    classes = [c for c, _ in GROUP_M_CLASSES]
    for d in (dev, off):
        save_model(
            work / d, d, WELD_TASK, width=624, classes=classes, schema=DEFAULT_SCHEMA.schema_hash(), x=x
        )
    rec_toml = work / "recorder.toml"
    rec_toml.write_text(
        f'[sensors]\nkind = "welder"\nweld_folder = "{launcher.path(inbox)}"\n'
        f'label_log = "{launcher.path(work / "maintenance.jsonl")}"\n'
        "poll_s = 0.005\nsettle_s = 60\n"
    )
    on, idle = trainer(work, dev, broker, True, launcher), trainer(work, off, broker, False, launcher)
    recorder = None
    sub = Answers(broker.url, dev)
    try:
        wait_serving(work, dev, launcher.startup_s)
        recorder = spawn(["edge.recording.cli", "--device", dev, "--config", launcher.path(rec_toml), "--state-dir",
                          launcher.path(work / dev), "--log-level", "WARNING"], work / "recorder.log", launcher)  # fmt: skip
        time.sleep(2.0 if launcher.root is None else 30.0)  # the recorder's imports and first folder scan
        cpu0 = {p.pid: cpu_s(p.pid) for p in (on, recorder)}
        appeared: dict[str, float] = {}
        for path in files:
            side = path.with_suffix(".json")
            if side.exists():
                shutil.move(side, inbox / side.name)
            t0 = time.time()
            os.replace(path, inbox / path.name)
            (inbox / (path.name + ".done")).touch()
            appeared[path.stem] = t0
            time.sleep(gap_s)
        sub.wait(n, launcher.startup_s)
        cpu = {p.pid: cpu_s(p.pid) - cpu0[p.pid] for p in (on, recorder)}
        rss_on, rss_off = rss_kib(on.pid), rss_kib(idle.pid)
    finally:
        sub.close()
        stop(*(p for p in (recorder, on, idle) if p is not None))
    lat = [sub.got[k][0] - t for k, t in appeared.items() if k in sub.got]
    served = [sub.got[k][1]["latency_s"] for k in appeared if k in sub.got]
    found = [sub.got[k][1]["row_time"] - t for k, t in appeared.items() if k in sub.got]
    answered = len(lat)
    return {
        "kind": "weld (624 DWT features)",
        "rows": n,
        "answered": answered,
        "e2e": summary(lat) if lat else (float("nan"),) * 3,
        "serve": summary(served) if served else (float("nan"),) * 3,
        "found": summary(found) if found else (float("nan"),) * 3,
        "cpu_trainer_ms": 1000 * cpu[on.pid] / max(answered, 1),
        "cpu_recorder_ms": 1000 * cpu[recorder.pid] / max(answered, 1),
        "rss_added_mib": (rss_on - rss_off) / 1024,
        "target_ms": 50.0,
    }


def bench_layers(
    work: Path,
    broker: BrokerProcess,
    n: int,
    layer_s: float,
    launcher: Launcher = HOST,
    advice: str | None = None,
) -> dict:
    """``layer_s`` stays above the recorder's Moonraker poll (0.25 s), or layers pass unseen.

    ``advice``: ``None``, the fleet's PFL-DA model as initialized; else a model that advises, whose
    advice goes to the Moonraker at that URL (``""``: published only)."""
    dev, off = "p1", "p1off"
    spec = pflda_task("speed") if advice is None else ADVISING_TASK
    shared = None if advice is None else ADVISING_PARAMS
    for d in (dev, off):
        (work / d).mkdir(parents=True, exist_ok=True)
        save_model(work / d, d, spec, width=1, shared=shared)
    extra = "" if advice is None else "vibration_budget = 0.6\n"
    if advice:
        extra += f'apply = "moonraker"\ndry_run = false\nmoonraker_url = "{advice}"\n'
    on = trainer(work, dev, broker, True, launcher, extra)
    idle = trainer(work, off, broker, False, launcher)
    sub = Answers(broker.url, dev)
    try:
        wait_serving(work, dev, launcher.startup_s)
        cpu0 = cpu_s(on.pid)
        rec = subprocess.run(
            launcher.argv(["edge.recording.cli", "--simulate", "printer", "--device", dev, "--state-dir",
                           launcher.path(work / dev), "--layers", str(n), "--layer-s", str(layer_s), "--log-level", "WARNING"]),
            capture_output=True, text=True, timeout=1800, env=launcher.env,
        )  # fmt: skip
        if rec.returncode != 0:
            raise RuntimeError(f"edge-recorder --simulate printer failed:\n{rec.stderr[-3000:]}")
        sub.wait(len(read_log(feed_path(work / dev))[0]), launcher.startup_s / 2)
        cpu = cpu_s(on.pid) - cpu0
        rss_on, rss_off = rss_kib(on.pid), rss_kib(idle.pid)
    finally:
        sub.close()
        stop(on, idle)
    fed = len(read_log(feed_path(work / dev))[0])  # layers the recorder stored (a layer cut short is dropped)
    lat = [t - body["row_time"] for t, body in sub.got.values()]
    served = [body["latency_s"] for _, body in sub.got.values()]
    kind = "printer layer"
    if advice is not None:
        kind += ", advice to a Moonraker that never answers" if advice else ", advice published only"
    return {
        "kind": kind,
        "rows": fed,
        "answered": len(lat),
        "e2e": summary(lat) if lat else (float("nan"),) * 3,
        "serve": summary(served) if served else (float("nan"),) * 3,
        "found": (float("nan"),) * 3,
        "cpu_trainer_ms": 1000 * cpu / max(len(lat), 1),
        "cpu_recorder_ms": float("nan"),
        "rss_added_mib": (rss_on - rss_off) / 1024,
        "target_ms": 5.0,
    }


def scratch(launcher: Launcher = HOST) -> tempfile.TemporaryDirectory:
    """A temp folder for a run: inside the arm64 root for a root ``launcher``, which sees only it."""
    base = None if launcher.root is None else launcher.root / "var" / "tmp"
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="ioft-serve-bench-", dir=base)


def run(
    welds: int,
    layers: int,
    work: Path | None = None,
    launcher: Launcher = HOST,
    weld_gap_s: float = 0.1,
    layer_s: float = 0.5,
) -> list[dict]:
    """Both measurements on one mosquitto; ``work`` keeps the folders and logs (default: a temp folder;
    inside the arm64 root for a root ``launcher``)."""
    with scratch(launcher) as tmp:
        work = work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        broker = start_mosquitto(log_file=work / "mosquitto.log")
        try:
            load0 = os.getloadavg()[0]
            rows = [
                bench_welds(work / "welder", broker, welds, weld_gap_s, launcher),
                bench_layers(work / "printer", broker, layers, layer_s, launcher),
            ]
        finally:
            broker.stop()
        for r in rows:
            r["load"] = (load0 + os.getloadavg()[0]) / 2
        return rows


def median_of(runs: list[dict], pick) -> float:
    vals = [pick(r) for r in runs if r["answered"]]
    return float(statistics.median(vals)) if vals else float("nan")


def table(runs: list[list[dict]]) -> str:
    """One row per kind of row: each figure's median over the runs, and the spread of the runs' p99."""
    out = []
    for i, kind in enumerate(runs[0]):
        rs = [run[i] for run in runs]
        p99s = [r["e2e"][1] for r in rs]
        p99 = median_of(rs, lambda r: r["e2e"][1])
        out.append([
            kind["kind"], sum(r["rows"] for r in rs), sum(r["answered"] for r in rs),
            f"{median_of(rs, lambda r: r['e2e'][0]):.2f}", f"{p99:.2f}", f"{min(p99s):.2f}-{max(p99s):.2f}",
            f"<= {kind['target_ms']:.0f} ms", "yes" if p99 <= kind["target_ms"] else "NO",
            "n/a" if kind["found"][0] != kind["found"][0] else
            f"{median_of(rs, lambda r: r['found'][0]):.2f} / {median_of(rs, lambda r: r['found'][1]):.2f}",
            f"{median_of(rs, lambda r: r['serve'][0]):.2f} / {median_of(rs, lambda r: r['serve'][1]):.2f}",
            f"{median_of(rs, lambda r: r['cpu_trainer_ms']):.2f}",
            "n/a" if kind["cpu_recorder_ms"] != kind["cpu_recorder_ms"] else f"{median_of(rs, lambda r: r['cpu_recorder_ms']):.2f}",
            f"{median_of(rs, lambda r: r['rss_added_mib']):+.1f}",
            " ".join(f"{r['e2e'][1]:.2f}@{r['load']:.1f}" for r in rs),
        ])  # fmt: skip
    return markdown_table(
        ["row", "rows", "answered", "p50 (ms)", "p99 (ms)", "p99 spread (ms)", "target p99", "met",
         "recorder: file to row p50/p99 (ms)", "trainer: row to answer p50/p99 (ms)", "trainer CPU/answer (ms)",
         "recorder CPU/answer (ms)", "RSS added (MiB)", "each run: p99 @ load"],
        out,
    )  # fmt: skip


@contextlib.contextmanager
def arm64(root: Path, work: Path) -> Iterator[tuple[Launcher, str]]:
    """A launcher for the arm64 root (built once, reused), the project from ``git HEAD`` installed there
    as ``make pi-check`` installs it, with /proc and /dev/shm mounted meanwhile; and a line saying what ran."""
    # The arm64 root is the deployment check's (deploy/ sits above the benchmarks): borrowed only here.
    from deploy import pi_root
    from deploy.pi_check import build_wheel, install_device

    work.mkdir(parents=True, exist_ok=True)
    log = work / "serve-arm64.log"
    log.write_text("")
    pi_root.ensure_host_tools(log)
    binfmt = pi_root.ensure_binfmt(log)
    pi_root.ensure_root(root, log)
    with pi_root.mounted(root, log):  # /proc and /dev/shm, never /sys (see pi_root.mounted)
        pi_root.configure_root(root, log)
        _, wheel, commit = build_wheel(work, log)
        install_device(root, wheel, log)
        python = f"{pi_root.VENV}/bin/python"
        version = pi_root.run_logged(
            "python -V (root)", pi_root.in_root(root, [python, "-V"]), log, env=pi_root.ROOT_ENV
        ).strip()
        env = {**pi_root.ROOT_ENV, "PYTHONUNBUFFERED": "1"}
        yield (
            Launcher(root=root, python=python, env=env, startup_s=600.0),
            f"aarch64 {version} in {root} (Debian bookworm) under qemu-aarch64 ({binfmt}), ioft {commit}",
        )


def measure_arm64(root: Path, work: Path, welds: int, layers: int) -> tuple[list[dict], str]:
    """Both measurements with the device processes in the arm64 root (:func:`arm64`)."""
    with arm64(root, work) as (launcher, what):
        return run(welds, layers, None, launcher, weld_gap_s=1.0, layer_s=1.0), what


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--welds", type=int, default=None, help="welds to time (default 200, quick 20)")
    parser.add_argument(
        "--layers", type=int, default=None, help="printer layers to time (default 100, quick 15)"
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="runs of both measurements (default 3, quick 1)"
    )
    parser.add_argument(
        "--work", type=Path, help="keep the processes' folders and logs here (default: a temp folder)"
    )
    parser.add_argument(
        "--arm64", action="store_true", help="also measure in the arm64 root under qemu (emulated; as root)"
    )
    parser.add_argument("--root", type=Path, default=Path("/var/tmp/ioft-pi-root"), help="the arm64 root")
    parser.add_argument(
        "--hung-moonraker",
        action="store_true",
        help="printer layers only: an advising model, without and with a Moonraker that never answers",
    )
    args = parser.parse_args(argv)
    welds = args.welds or (20 if args.quick else 200)
    layers = args.layers or (15 if args.quick else 100)
    n_runs = args.runs or (1 if args.quick else 3)
    if args.arm64 and os.geteuid() != 0:
        print(
            "serve_latency: --arm64 needs root (debootstrap, chroot, mount): run it with sudo",
            file=sys.stderr,
        )
        return 2
    if args.hung_moonraker:
        from benchmarks.serve_latency_hung import main_hung

        return main_hung(args, args.layers or 30, n_runs)
    runs = [run(welds, layers, args.work) for _ in range(n_runs)]
    body = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {n_runs} runs, "
        "other work shares this machine (load average of each run in the last column). p50/p99/max: from the "
        "weld file renamed into the watched folder (weld) or the row's time (layer) to the answer at the "
        "subscriber, median over the runs; 'p99 spread': the runs' lowest and highest p99; 'recorder': from "
        "the file to the row handed to the trainer (poll, ledger, read, DWT); 'trainer': row to answer inside "
        "edge-trainer (the answer's latency_s). RSS added: serving trainer minus the same trainer with "
        "[serve] enabled = false.\n\n" + table(runs) + "\n"
    )
    if args.arm64:
        from deploy.pi_root import PiCheckError

        w, n = max(10, welds // 10), max(10, layers // 5)
        try:
            emulated, what = measure_arm64(args.root, Path("/var/tmp/ioft-serve-arm64"), w, n)
        except PiCheckError as exc:
            print(f"serve_latency: {exc}", file=sys.stderr)
            return 1
        body += (
            f"\n### arm64, emulated (qemu-user-static on this x86_64 host: not a Raspberry Pi's timings)\n\n"
            f"{what}: edge-trainer and edge-recorder in the root, mosquitto and the subscriber on the host; "
            f"{w} welds 1 s apart, {n} layers of 1 s (fewer and slower than above: the emulated DWT takes "
            "longer than the host's gap). Every instruction of the device processes is translated by qemu "
            "on this CPU: these times say that the path works on arm64 and how it scales under emulation, "
            "not what a Pi measures.\n\n" + table([emulated]) + "\n"
        )
    print(body)
    if not args.no_write:
        path = write_result("serve_latency" + ("_quick" if args.quick else ""), body)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
