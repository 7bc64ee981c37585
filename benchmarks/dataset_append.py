"""Bytes written per appended row: the old whole-file rewrite against append-only segments.

Two kinds of row: a printer layer row (``x = sigma_a``, ``y = speed / 50``: 2 float64,
16 bytes) and a weld row (624 float64 DWT features + an int64 class: 5,000 bytes).  For
each, a dataset of 1k, 10k and 20k rows is written first (not counted), then rows are
appended one per flush, as the recorders do when rows come one at a time, and every byte
the process hands to ``write()`` is counted: ``wchar`` of ``/proc/self/io`` read before
and after each append (this counts the data written through the page cache, before the
file system's own block rounding and journal, which neither method controls).

* **old**: the recorder before segments, reproduced as it was: the buffered rows are
  concatenated to the dataset held in memory and the whole file is written again with
  ``ioft_protocol.state.save_arrays`` (temp file, fsync, rename; the previous copy kept
  as ``.prev``) -- what ``save_dataset`` did.
* **new**: :class:`edge.recording.base.DatasetAppender` on :mod:`edge.segments`: one
  segment per append, compaction included (the mean is over a whole number of merge
  cycles of the first level; the printer's rarer higher-level merges are counted when
  they fall in the window).

Beside the writes, the bytes the trainer reads to pick the append up (``rchar``): the
whole file again (old) or the new segment (new, ``DatasetReader.refresh``).  Target: at
most twice the row's own bytes plus 4 KB per append.

    python -m benchmarks.dataset_append [--quick] [--no-write]
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import markdown_table, study_parser, write_result
from edge.dataset import FILE, save_dataset
from edge.recording.base import DatasetAppender
from edge.segments import DatasetReader
from ioft_protocol.state import load_arrays, save_arrays
from trainer_lite.data import Dataset

log = logging.getLogger("benchmarks.dataset_append")
SLACK_BYTES = 4096

KINDS: dict[str, dict[str, Any]] = {
    "printer layer": {
        "x_dim": 1,
        "y_dtype": np.float64,
        "y_1d": False,
        "meta": {
            "source": "record-printer",
            "columns": {"x": ["sigma_a"], "y": ["speed/50"]},
            "split": "run",
            "test_fraction": 0.25,
            "accel": "adxl345",
            "accel_hz": 200.0,
            "context": "moonraker",
            "run": {"job": "bracket_v3.gcode", "n": 41, "last_layer": 112, "split": "train"},
            "runs": 41,
            "dropped_layers": {"gap": 3, "accel_fault": 1},
        },
    },
    "weld": {
        "x_dim": 624,
        "y_dtype": np.int64,
        "y_1d": True,
        "meta": {
            "source": "record-welder",
            "schema_hash": "3f" * 32,
            "target": "tool_m",
            "classes": ["TC1", "TC2", "TC3", "TC4"],
            "split": "weld",
            "test_fraction": 0.25,
            "last_weld_ids": ["welder2-000123"],
        },
    },
}


def io_counter(field: str) -> int:
    """``field`` (``wchar``, ``rchar``) of ``/proc/self/io``: bytes passed to write()/read() so far."""
    with open("/proc/self/io") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name == field:
                return int(value)
    raise SystemExit(f"/proc/self/io has no {field!r}: this benchmark needs Linux")


def counted(fn: Callable[[], object], field: str = "wchar") -> int:
    before = io_counter(field)
    fn()
    return io_counter(field) - before


def row_bytes(kind: dict) -> int:
    return 8 * kind["x_dim"] + np.dtype(kind["y_dtype"]).itemsize


def make_rows(kind: dict, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=(n, kind["x_dim"]))
    y = rng.integers(0, 4, size=n) if kind["y_1d"] else rng.uniform(0.4, 3.0, size=(n, 1))
    return x, y.astype(kind["y_dtype"])


def split_of(i: int) -> str:
    return "test" if i % 4 == 3 else "train"


def initial(kind: dict, n: int, rng: np.random.Generator) -> tuple[Dataset, Dataset]:
    x, y = make_rows(kind, n, rng)
    test = np.array([split_of(i) == "test" for i in range(n)])
    return Dataset(x[~test], y[~test]), Dataset(x[test], y[test])


# -- the old method, as DatasetAppender.flush + save_dataset were --------------------------------------
def old_append(state: Path, data: dict[str, Dataset], meta: dict, split: str, x, y, max_rows: int) -> dict:
    d = data[split]
    nx = np.concatenate([d.x, x[None]])
    ny = np.concatenate([d.y, np.asarray(y)[None].astype(d.y.dtype)])
    if len(nx) > max_rows:
        nx, ny = nx[-max_rows:], ny[-max_rows:]
    new = {**data, split: Dataset(nx, ny)}
    meta = {**meta, "rows": {s: len(v) for s, v in new.items()}}
    meta["updated_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    arrays = {
        "train_x": new["train"].x,
        "train_y": new["train"].y,
        "test_x": new["test"].x,
        "test_y": new["test"].y,
    }
    save_arrays(state / FILE, arrays, meta)
    return new


def measure_old(work: Path, kind: dict, n: int, appends: int, rng: np.random.Generator) -> dict:
    state = work / "old"
    train, test = initial(kind, n, rng)
    arrays = {"train_x": train.x, "train_y": train.y, "test_x": test.x, "test_y": test.y}
    save_arrays(state / FILE, arrays, kind["meta"])
    data = {"train": train, "test": test}
    x, y = make_rows(kind, appends, rng)
    written, read = [], []
    for i in range(appends):
        before = io_counter("wchar")
        data = old_append(state, data, kind["meta"], split_of(n + i), x[i], y[i], 10**9)
        written.append(io_counter("wchar") - before)
        read.append(counted(lambda: load_arrays(state / FILE), "rchar"))  # the trainer's reload
    shutil.rmtree(state)
    return {"mean": float(np.mean(written)), "max": max(written), "read": float(np.mean(read))}


def measure_new(work: Path, kind: dict, n: int, appends: int, rng: np.random.Generator) -> dict:
    state = work / "new"
    train, test = initial(kind, n, rng)
    save_dataset(state, train, test, kind["meta"])
    rec = DatasetAppender(
        state,
        source=kind["meta"]["source"],
        x_dim=kind["x_dim"],
        y_dtype=kind["y_dtype"],
        y_1d=kind["y_1d"],
        meta=kind["meta"],
        max_rows=10**9,
    )
    trainer = DatasetReader(state)
    trainer.load()
    x, y = make_rows(kind, appends, rng)
    written, read = [], []
    for i in range(appends):
        rec.add(split_of(n + i), x[i], y[i])
        written.append(counted(rec.flush))
        read.append(counted(trainer.refresh, "rchar"))
    assert len(trainer.train) + len(trainer.test) == n + appends  # the trainer holds every row
    merges = rec.store.merges
    segments = len(list((state / "dataset.segments").iterdir()))
    shutil.rmtree(state)
    return {
        "mean": float(np.mean(written)),
        "max": max(written),
        "read": float(np.mean(read)),
        "merges": merges,
        "files": segments,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = study_parser(__doc__.splitlines()[0], default_seeds=(0,))
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000, 10_000, 20_000], help="rows in the dataset"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [1_000] if args.quick else args.sizes
    old_appends = 2 if args.quick else 5
    # Whole merge cycles: a weld segment is sealed by its first merge (32 appends); printer
    # rows merge at 32 and 1,024 appends.
    new_appends = {"printer layer": 64 if args.quick else 1024, "weld": 64 if args.quick else 256}
    rng = np.random.default_rng(args.seeds[0])
    results = []
    with tempfile.TemporaryDirectory(prefix="dataset-append-") as tmp:
        work = Path(tmp)
        for name, kind in KINDS.items():
            for n in sizes:
                log.info("%s rows, %d in the dataset ...", name, n)
                old = measure_old(work, kind, n, old_appends, rng)
                new = measure_new(work, kind, n, new_appends[name], rng)
                rb = row_bytes(kind)
                results.append(
                    {
                        "kind": name,
                        "row_bytes": rb,
                        "n": n,
                        "old": old,
                        "new": new,
                        "bound": 2 * rb + SLACK_BYTES,
                    }
                )
    table = markdown_table(
        [
            "row",
            "row bytes",
            "rows in dataset",
            "old: written / append",
            "new: written / append (mean)",
            "new: largest append (with a merge)",
            "target 2×row + 4 KB",
            "new within",
            "old: trainer reads",
            "new: trainer reads",
            "new: merges, files",
        ],
        [
            [
                r["kind"],
                r["row_bytes"],
                f"{r['n']:,}",
                f"{r['old']['mean']:,.0f}",
                f"{r['new']['mean']:,.0f}",
                f"{r['new']['max']:,}",
                f"{r['bound']:,}",
                "yes" if r["new"]["mean"] <= r["bound"] else "NO",
                f"{r['old']['read']:,.0f}",
                f"{r['new']['read']:,.0f}",
                f"{r['new']['merges']}, {r['new']['files']}",
            ]
            for r in results
        ],
    )
    body = f"""
Bytes handed to write() per appended row (``wchar`` of /proc/self/io around each flush), one
row per append; old: {old_appends} appends per case, new: {new_appends["printer layer"]} (printer) and
{new_appends["weld"]} (weld) appends per case, compaction included. "trainer reads": bytes read
(``rchar``) to take the append in. Files: segment files after the run (the initial
dataset is one base segment).

{table}

- Old: every append rewrites the whole dataset, so its cost grows with the dataset
  (a 20k-row welder: ~100 MB written, and read again by the trainer, per append).
- New: one segment per append (the row, a ~0.5-1 KB safetensors header and the dataset's
  metadata), plus its share of one merge into a sealed segment; independent of the rows
  already stored.  The largest single append is the one that also writes a merge.
"""
    print(body.strip())
    if not args.no_write:
        path = write_result("dataset_append", body)
        log.info("wrote %s", path)
    return {"results": results}


if __name__ == "__main__":
    main()
