"""Does the fleet console slow the round loop?  Round time with and without a browser on it.

A real fleet (mosquitto, N ``edge-trainer --simulate printer`` processes, ``serve``)
runs PFL-DA on the sigmoid GLM (~20 ms rounds here: the cheapest rounds, so any
interference shows most) in blocks of R rounds, alternating (ABBA): *off* (no console) and *on*
(``cloud-aggregator console`` up and a headless Debian Chromium showing its page, live over
server-sent events, redrawing every round's news).  Each block is its own task and its own
``serve`` run; blocks alternate so that drift in the machine's load hits both alike.
A warm-up block runs first and is not counted.  Reported: the median round time (record's finished - started) of each mode, the ratio
on/off, and the same per pair of neighbouring blocks.  The *off* median is the reference.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from playwright.sync_api import Browser, sync_playwright

from benchmarks.common import markdown_table, study_parser, write_result
from cloud_aggregator.console import cli as console
from cloud_aggregator.local.broker import interrupt_on_sigterm, start_mosquitto
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml, pflda_task

#: Chromium without a sandbox (root in a container), a GPU, or any traffic of its own
#: (the browser test launches it the same way).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def run_block(fleet: LocalFleet, task: str, devices: list[str], rounds: int) -> list[float]:
    """One ``serve`` run of a fresh task; the round times of its records."""
    toml = aggregator_toml(
        fleet.broker_url, fleet.work / "aggregator", [pflda_task(task, rounds=rounds)], expected=devices
    )
    fleet.start_aggregator(toml, log_level="WARNING")
    if fleet.wait_aggregator(600) != 0:
        raise RuntimeError(f"aggregator failed: {fleet.log('aggregator')[-2000:]}")
    records = fleet.rounds(task)
    thin = [r.round for r in records if len(r.participants) != len(devices)]
    if thin:  # a round that waited for its deadline measures the deadline, not the console
        raise RuntimeError(f"task {task}: rounds {thin} lacked uploads")
    return [r.finished - r.started for r in records]


def with_console(
    fleet: LocalFleet, browser: Browser, task: str, devices: list[str], rounds: int, refresh: float
) -> list[float]:
    """:func:`run_block` with the console up and a Chromium page on it, following every round."""
    # The console reads the TOML the previous serve ran on (broker, fleet, state_dir).
    proc, url = console.launch(
        fleet.work / "aggregator.toml", fleet.work / "console.log", port=0, refresh=refresh
    )
    page = browser.new_page()
    try:
        page.goto(url + "learning")  # the learning view: devices, curves
        for d in devices:
            page.wait_for_selector(f'#devices tr[data-device="{d}"]', timeout=30_000)
        got = run_block(fleet, task, devices, rounds)
        mean = f'svg[data-task="{task}"] path[data-series="fleet mean"][data-points="{rounds}"]'
        page.wait_for_selector(mean, timeout=30_000)  # the page followed the block to its end
        return got
    finally:
        page.close()
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40, help="rounds per block")
    parser.add_argument("--pairs", type=int, default=3, help="off/on block pairs")
    parser.add_argument("--refresh", type=float, default=1.0, help="the console's --refresh (seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        args.devices, args.rounds, args.pairs = 2, 15, 1
    interrupt_on_sigterm()
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="ioft-console-bench-"))
    devices = [f"printer{i}" for i in range(1, args.devices + 1)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    pairs: list[tuple[float, float]] = []
    with LocalFleet.start(work, broker=start_mosquitto()) as fleet, sync_playwright() as pw:
        fleet.start_devices(devices, "--log-level", "WARNING")
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            run_block(fleet, "warmup", devices, args.rounds)  # first rounds load code on every device
            for i in range(args.pairs):
                # ABBA: off-on, then on-off, so that whatever the order does falls on both modes.
                medians = {}
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    if mode == "off":
                        got = run_block(fleet, f"off{i}", devices, args.rounds)
                    else:
                        got = with_console(fleet, browser, f"on{i}", devices, args.rounds, args.refresh)
                    times[mode] += got
                    medians[mode] = statistics.median(got)
                pairs.append((medians["off"], medians["on"]))
        finally:
            browser.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        ["off (reference: no console)", len(times["off"]), f"{1000 * med['off']:.1f} ms", "1.000"],
        ["on (console + Chromium, live)", len(times["on"]), f"{1000 * med['on']:.1f} ms", f"{med['on'] / med['off']:.3f}"],
    ]  # fmt: skip
    per_pair = [
        [i + 1, f"{1000 * a:.1f} ms", f"{1000 * b:.1f} ms", f"{b / a:.3f}"] for i, (a, b) in enumerate(pairs)
    ]
    body = (
        f"{args.devices} simulated printers, PFL-DA sigmoid GLM, {args.rounds} rounds per block, "
        f"{args.pairs} off/on pairs, console --refresh {args.refresh} s; 1-minute load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (a shared machine).\n\n"
        + markdown_table(["mode", "rounds", "median round", "ratio to off"], rows)
        + "\n\nPer pair of neighbouring blocks:\n\n"
        + markdown_table(["pair", "off median", "on median", "on/off"], per_pair)
    )
    print(body)
    if not args.no_write:
        write_result("console_overhead", body)
    return {"off_s": med["off"], "on_s": med["on"], "ratio": med["on"] / med["off"], "pairs": pairs}


if __name__ == "__main__":
    main()
