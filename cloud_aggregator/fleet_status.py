"""``cloud-aggregator fleet status``: each device's state, from its retained status message.

Every device keeps a retained JSON status on ``status/<device>`` (its Last Will
turns it offline when it vanishes): online or offline, each task's last round and
metrics, and each model's active version and recent refusals.  This reads them
all and prints one line per device.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from edge import wire
from edge.config import ConfigError
from edge.mqtt import MqttSession

log = logging.getLogger(__name__)
#: Preferred metric to show per task, best first.
METRICS = ("test_accuracy", "test_loss", "train_loss")


def collect_status(
    session: MqttSession, fleet: str, *, quiet_s: float = 0.5, max_s: float = 5.0
) -> dict[str, dict]:
    """Retained statuses of every device, read until ``quiet_s`` passes without a new one."""
    session.subscribe(wire.topic_status_all(fleet))
    statuses: dict[str, dict] = {}
    deadline = time.monotonic() + max_s
    last = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        msg = session.get(0.05)
        if msg is None:
            continue
        try:
            parsed = wire.parse_topic(msg.topic)
            body = json.loads(msg.payload) if msg.payload else None
        except (wire.WireError, ValueError) as exc:
            log.warning("ignoring status on %s: %s", msg.topic, exc)
            continue
        if parsed.kind == "status" and isinstance(body, dict):
            statuses[parsed.device] = body
            last = time.monotonic()
    return statuses


def summarize(statuses: dict[str, dict]) -> list[dict[str, Any]]:
    """One row per device: state, models, last round and metric per task."""
    rows = []
    for device in sorted(statuses):
        body = statuses[device]
        models = body.get("models") or {}
        tasks = body.get("tasks") or {}
        model_cells = []
        for name, m in sorted(models.items()):
            cell = f"{name} v{m.get('active')}" if m.get("active") is not None else f"{name} none"
            if m.get("transfer"):
                t = m["transfer"]
                cell += f" (fetching v{t['version']}: {t['have']}/{t['of']})"
            if m.get("rejected"):
                r = m["rejected"][-1]
                cell += f" [refused v{r.get('version')}: {r.get('reason', '')[:60]}]"
            model_cells.append(cell)
        task_cells = []
        for name, t in sorted(tasks.items()):
            metrics = t.get("metrics") or {}
            key = next((k for k in METRICS if k in metrics), None)
            metric = f" {key}={metrics[key]:.4f}" if key else ""
            task_cells.append(f"{name}: round {t.get('round')}{metric}")
        rows.append(
            {
                "device": device,
                "state": body.get("state", "?"),
                "models": "; ".join(model_cells) or "-",
                "tasks": "; ".join(task_cells) or "-",
                "since": body.get("time"),
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    headers = ("device", "state", "models (active version)", "tasks (last round, last metric)", "status age")
    cells = [
        (
            r["device"],
            r["state"],
            r["models"],
            r["tasks"],
            f"{now - r['since']:.0f} s" if isinstance(r.get("since"), int | float) else "?",
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in [headers, *cells]) for i in range(len(headers))]
    line = lambda c: "  ".join(str(v).ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(c) for c in cells)])


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    from cloud_aggregator.push import add_session_args

    p = fleet_sub.add_parser(
        "status", help="per device: online/offline, active models, last round and metric"
    )
    add_session_args(p)
    p.add_argument("--json", action="store_true", help="print the raw retained statuses as JSON")
    p.add_argument("--wait", type=float, default=0.5, help="seconds without a new status before printing")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from cloud_aggregator.push import operator_session

    try:
        session, fleet = operator_session(args, "status")
    except (ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        statuses = collect_status(session, fleet, quiet_s=args.wait)
    finally:
        session.stop()
    if args.json:
        print(json.dumps(statuses, indent=1, sort_keys=True))
    elif not statuses:
        print(f"no device has reported on fleet {fleet}")
    else:
        print(format_table(summarize(statuses)))
    return 0
