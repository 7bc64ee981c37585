"""``cloud-aggregator fleet privacy``: each DP task's spent ε at its δ, from the aggregator's store.

Reads ``<state_dir>/aggregator.sqlite`` read-only (no broker, no lock), so it runs beside a
live ``serve``.  Every completed round of a DP task keeps the ledger's summary in its
record (``extra["dp"]``: ε, δ, rounds composed, sampling rate, budget, and ``stop`` once
the budget is reached); this prints the last one per task, or every round with ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol.config import ConfigError, load_toml


def privacy_rows(store: SqliteStore, *, every_round: bool = False) -> list[dict[str, Any]]:
    """One row per DP task (its last round with a ledger), or per round with ``every_round``."""
    rows = []
    for task, spec_json in sorted(store.tasks().items()):
        dp = json.loads(spec_json).get("dp")
        if dp is None:
            continue
        kept = [r for r in store.rounds(task) if "dp" in r.extra]
        if not every_round:
            kept = kept[-1:]
        if not kept:
            rows.append({"task": task, "mode": dp.get("mode", "central"), "round": None, "epsilon": 0.0})
        for rec in kept:
            rows.append({"task": task, "round": rec.round, "status": rec.status, **rec.extra["dp"]})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["task", "mode", "round", "rounds", "epsilon", "delta", "budget", "state"]
    cells = [
        [
            r["task"],
            r.get("mode", ""),
            "-" if r.get("round") is None else str(r["round"]),
            str(r.get("rounds", 0)),
            f"{r.get('epsilon', 0.0):.3f}",
            f"{r['delta']:g}" if "delta" in r else "-",
            f"{r['budget']:g}" if "budget" in r else "none",
            "stopped: budget reached" if r.get("stop") else "within budget",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [headers, *cells]) for i in range(len(headers))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip() for c in [headers, *cells]
    )


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    p = fleet_sub.add_parser("privacy", help="each DP task's spent ε at its δ (from the aggregator's store)")
    p.add_argument("--config", type=Path, help="the aggregator's TOML (its state_dir is read)")
    p.add_argument("--state-dir", type=Path, help="the aggregator's state folder (default: --config's)")
    p.add_argument("--rounds", action="store_true", help="every round's ε, not only the last")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    state_dir = args.state_dir
    if state_dir is None and args.config is not None:
        try:
            state_dir = load_toml(args.config).get("state_dir")
        except ConfigError as exc:
            print(f"{args.config}: {'; '.join(exc.errors)}", file=sys.stderr)
            return 2
    if not state_dir:
        print(
            "fleet privacy needs --state-dir, or --config naming the aggregator's state_dir", file=sys.stderr
        )
        return 2
    db = Path(state_dir) / "aggregator.sqlite"
    if not db.exists():
        print(
            f"no aggregator store at {db}; has `cloud-aggregator serve` run with this state_dir?",
            file=sys.stderr,
        )
        return 2
    store = SqliteStore(db, readonly=True)
    try:
        rows = privacy_rows(store, every_round=args.rounds)
    finally:
        store.close()
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
    elif not rows:
        print("no task with dp in this store")
    else:
        print(format_rows(rows))
    return 0
