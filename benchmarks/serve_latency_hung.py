"""``serve_latency --hung-moonraker``: printer layers answered by an advising model, published only
vs applied to a Moonraker that accepts every connection and never answers.

Both rows on one mosquitto (:func:`run_hung`), ``--runs`` times; the layer p99 target (5 ms) should
hold beside the hung Moonraker.  With ``--arm64`` the same comparison runs again with
``edge-trainer`` and ``edge-recorder`` in ``make pi-check``'s arm64 root under qemu-user-static
(:func:`benchmarks.serve_latency.arm64`), fewer and slower layers, the Moonraker, mosquitto and
the subscriber staying on the host; both sections go into one results file.

    python -m benchmarks.serve_latency --hung-moonraker [--layers N] [--runs N] [--no-write]
    sudo .venv/bin/python -m benchmarks.serve_latency --hung-moonraker --arm64 --layers 100
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.serve_latency import HOST, Launcher, arm64, bench_layers, scratch, table
from cloud_aggregator.local.broker import start_mosquitto

#: Under qemu: a fifth of the host's layers (at least 10), each 1 s long instead of 0.5 s.
ARM64_LAYER_S = 1.0


def arm64_layers(layers: int) -> int:
    return max(10, layers // 5)


def run_hung(
    layers: int, work: Path | None = None, layer_s: float = 0.5, launcher: Launcher = HOST
) -> list[dict]:
    """Printer layers answered by an advising model, without and with a hung Moonraker, on one mosquitto
    (the Moonraker, mosquitto and the subscriber on the host; the device processes per ``launcher``)."""
    from sensors.sim.printer_host import HungMoonraker

    with scratch(launcher) as tmp:
        work = work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        broker = start_mosquitto(log_file=work / "mosquitto.log")
        hung = HungMoonraker()
        try:
            load0 = os.getloadavg()[0]
            rows = [
                bench_layers(work / "advice", broker, layers, layer_s, launcher, advice=""),
                bench_layers(work / "hung", broker, layers, layer_s, launcher, advice=hung.url),
            ]
        finally:
            hung.close()
            broker.stop()
        for r in rows:
            r["load"] = (load0 + os.getloadavg()[0]) / 2
        return rows


def runs(rows: list[list[dict]]) -> str:
    return f"{len(rows)} run" + ("s" if len(rows) != 1 else "")


def report(
    host: list[list[dict]], emulated: list[list[dict]] | None = None, what: str = "", layers: int = 0
) -> str:
    """The results file's body: the host's table, then (``emulated``) the arm64 root's, ``layers`` each."""
    body = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; {runs(host)}. "
        "Printer layers answered by a model that advises a speed: published only, then applied "
        "(apply = 'moonraker', dry_run = false) to a Moonraker that accepts connections and never "
        "answers. p50/p99: the row's time to the answer at the subscriber; the last column: each run's "
        "p99 @ its 1-minute load average, the mean of the run's start and end (this machine is shared)."
        f"\n\n{table(host)}\n"
    )
    if emulated is None:
        return body
    return body + (
        "\n### arm64, emulated (qemu-user-static on this x86_64 host: not a Raspberry Pi's timings)\n\n"
        f"{what}: edge-trainer and edge-recorder in the root; the hung Moonraker, mosquitto and the "
        f"subscriber on the host. Same run as above, {runs(emulated)} of {layers} layers of "
        f"{ARM64_LAYER_S:g} s (fewer and slower than the host's: every instruction of the device "
        "processes is translated by qemu on this CPU). These times say whether the hung Moonraker "
        "delays answers on arm64 under emulation, not what a Pi measures.\n\n" + table(emulated) + "\n"
    )


def main_hung(args: argparse.Namespace, layers: int, n_runs: int) -> int:
    """The ``--hung-moonraker`` branch of :func:`benchmarks.serve_latency.main`."""
    host = [run_hung(layers, args.work) for _ in range(n_runs)]
    emulated, what, n = None, "", arm64_layers(layers)
    if args.arm64:
        from deploy.pi_root import PiCheckError

        try:
            with arm64(args.root, Path("/var/tmp/ioft-serve-arm64")) as (launcher, what):
                emulated = [run_hung(n, None, ARM64_LAYER_S, launcher) for _ in range(n_runs)]
        except PiCheckError as exc:
            print(f"serve_latency: {exc}", file=sys.stderr)
            return 1
    body = report(host, emulated, what, n)
    print(body)
    if not args.no_write:
        print(f"wrote {write_result('serve_latency_hung_moonraker', body)}", file=sys.stderr)
    return 0
