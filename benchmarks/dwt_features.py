"""DWT feature extraction time per weld: PyWavelets against the plain-NumPy reference.

One weld is 4 channels x 1 s at 200 kHz (a simulated Cu-Cu weld), turned into the
624-feature vector of ``sensors.features.DEFAULT_SCHEMA``.  The budget is 50 ms per
weld on the machine that runs this.  Rows:

* PyWavelets, one weld at a time (``extract_features``: what the device does), split
  into ``wavedec`` and the band statistics;
* PyWavelets, a batch of welds through one ``wavedec(axis=-1)`` (``extract_batch``),
  per weld;
* the NumPy reference (own filters, own DWT, per-band loop), split likewise;
* optionally the PyWavelets per-weld row again in a child process with glibc's malloc
  thresholds raised, to show how much of the time is page faults on fresh buffers.

Medians over ``--repeats`` runs of wall time (``perf_counter``) and of this process's
CPU time (``process_time``); the load average is recorded because other processes
on a shared machine inflate wall time but not CPU time.

    python -m benchmarks.dwt_features [--repeats 20] [--batch 8] [--quick] [--no-write]
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version

import numpy as np
import pywt

from benchmarks.common import markdown_table, study_parser, write_result
from sensors.features import DEFAULT_SCHEMA, extract_batch, extract_features
from sensors.features.dwt import band_statistics
from sensors.features.reference import extract_features_reference, statistics_reference, wavedec_reference
from sensors.sim.welder import WeldCondition, simulate_weld

log = logging.getLogger("benchmarks.dwt_features")
BUDGET_MS = 50.0


def timed(fn: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``fn`` over ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


_CHILD = """
import json, sys, time, statistics
import numpy as np
from sensors.features import extract_features
from sensors.sim.welder import WeldCondition, simulate_weld
rec = simulate_weld(WeldCondition("new", "new", "clean", "Cu-Cu", 1.0), np.random.default_rng(0))
for _ in range(2): extract_features(rec)
w, c = [], []
for _ in range(int(sys.argv[1])):
    w0, c0 = time.perf_counter(), time.process_time(); extract_features(rec)
    w.append(time.perf_counter() - w0); c.append(time.process_time() - c0)
print(json.dumps([1e3 * statistics.median(w), 1e3 * statistics.median(c)]))
"""


def malloc_tuned(repeats: int) -> tuple[float, float] | None:
    """The per-weld PyWavelets timing in a child with glibc malloc thresholds raised."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(repeats)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("malloc-tuned child failed: %s", exc)
        return None
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per row (median reported)")
    parser.add_argument("--batch", type=int, default=8, help="welds per extract_batch call")
    parser.add_argument("--seconds", type=float, default=1.0, help="weld length in seconds (at 200 kHz)")
    parser.add_argument("--no-malloc-row", action="store_true", help="skip the child run with malloc tuned")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    repeats = 5 if args.quick else args.repeats
    ref_repeats = max(3, repeats // 2)
    schema = DEFAULT_SCHEMA
    rng = np.random.default_rng(args.seeds[0])
    rec = simulate_weld(WeldCondition("new", "new", "clean", "Cu-Cu", args.seconds), rng)
    x = rec.select(schema.channels)
    batch = np.stack([x] * args.batch)
    load_before = os.getloadavg()

    # Parity first: a benchmark of two implementations that disagree would be meaningless.
    ours = extract_features(rec, schema)
    ref = extract_features_reference(x, schema, sample_rate=rec.sample_rate)
    max_rel = float(np.max(np.abs(ours - ref) / np.maximum(np.abs(ref), 1e-9)))
    if not np.allclose(ours, ref, rtol=1e-9, atol=1e-9):
        log.error("PyWavelets and reference features differ (max rel %.3g); fix that first", max_rel)
        return 1

    log.info("timing PyWavelets ...")
    coeffs = pywt.wavedec(x, schema.wavelet, mode=schema.mode, level=schema.level, axis=-1)
    rows: list[tuple[str, float, float]] = []
    py_weld = timed(lambda: extract_features(rec, schema), repeats)
    rows.append(("PyWavelets, per weld (extract_features)", *py_weld))
    rows.append(
        (
            "  of which wavedec",
            *timed(
                lambda: pywt.wavedec(x, schema.wavelet, mode=schema.mode, level=schema.level, axis=-1),
                repeats,
            ),
        )
    )
    rows.append(("  of which band statistics", *timed(lambda: band_statistics(coeffs), repeats)))
    bw, bc = timed(lambda: extract_batch(batch, schema, sample_rate=rec.sample_rate), max(3, repeats // 2))
    rows.append(
        (f"PyWavelets, batch of {args.batch} (extract_batch), per weld", bw / args.batch, bc / args.batch)
    )
    # Short welds are where batching pays: Python overhead is a larger share.
    short = simulate_weld(WeldCondition("new", "new", "clean", "Cu-Cu", 0.5), rng, time_scale=0.3)
    short_batch = np.stack([short.select(schema.channels)] * args.batch)
    sw = timed(lambda: extract_features(short, schema), repeats)
    rows.append((f"PyWavelets, per weld, short weld ({short.duration:g} s)", *sw))
    sbw, sbc = timed(lambda: extract_batch(short_batch, schema, sample_rate=rec.sample_rate), repeats)
    rows.append(
        (
            f"PyWavelets, batch of {args.batch}, per weld, short weld ({short.duration:g} s)",
            sbw / args.batch,
            sbc / args.batch,
        )
    )
    log.info("timing the NumPy reference ...")
    ref_weld = timed(
        lambda: extract_features_reference(x, schema, sample_rate=rec.sample_rate), ref_repeats, 1
    )
    rows.append(("NumPy reference, per weld", *ref_weld))
    ref_coeffs = wavedec_reference(x, schema.wavelet, schema.level)
    rows.append(
        (
            "  of which DWT (hand-written filter bank)",
            *timed(lambda: wavedec_reference(x, schema.wavelet, schema.level), ref_repeats, 1),
        )
    )
    rows.append(
        (
            "  of which band statistics (per-band loop)",
            *timed(lambda: statistics_reference(ref_coeffs, schema), ref_repeats, 1),
        )
    )
    tuned = None if args.no_malloc_row else malloc_tuned(repeats)
    if tuned is not None:
        rows.append(("PyWavelets, per weld, child with MALLOC_MMAP/TRIM_THRESHOLD_=1 GiB", *tuned))
    load_after = os.getloadavg()

    table = markdown_table(
        ["what", "wall ms (median)", "CPU ms (median)", "vs 50 ms budget (wall)"],
        [(name, f"{w:.1f}", f"{c:.1f}", f"{w / BUDGET_MS:.2f}x") for name, w, c in rows],
    )
    verdict = "within" if py_weld[0] <= BUDGET_MS else "OVER"
    body = f"""
One weld = {len(schema.channels)} channels x {args.seconds:g} s at {rec.sample_rate:g} Hz = {x.size:,} samples ->
{schema.n_features} features ({schema.describe()}).
PyWavelets {version("PyWavelets")}, {repeats} repeats (reference: {ref_repeats}).
Load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs.

{table}

- **Per weld, PyWavelets: {py_weld[0]:.1f} ms wall, {py_weld[1]:.1f} ms CPU — {verdict} the {BUDGET_MS:.0f} ms budget.**
- NumPy reference / PyWavelets: {ref_weld[0] / py_weld[0]:.1f}x wall, {ref_weld[1] / py_weld[1]:.1f}x CPU.
- Batch / per weld: {bw / args.batch / py_weld[0]:.2f}x wall per weld for {args.seconds:g} s welds (batches
  are cut to ~1 M samples, so a 1 s weld goes alone), {sbw / args.batch / sw[0]:.2f}x for {short.duration:g} s welds.
- Parity on this weld: max relative difference {max_rel:.2g} (the parity test allows rtol 1e-9 + atol 1e-9).
"""
    print(body.strip())
    if not args.no_write:
        path = write_result("dwt_features", body)
        log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
