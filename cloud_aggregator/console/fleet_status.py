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
import math
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from cloud_aggregator.operator import add_session_args, fleet_root_of, operator_session, revoked_devices
from ioft_protocol import codec, restate, topics
from ioft_protocol.cli import one_line
from ioft_protocol.config import ConfigError
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message

log = logging.getLogger(__name__)
#: Preferred metric to show per task, best first.
METRICS = ("test_accuracy", "test_loss", "train_loss")


def collect_status(
    session: MqttSession,
    fleet: str,
    *,
    quiet_s: float = 0.5,
    max_s: float = 5.0,
    others: dict[str, dict[str, dict]] | None = None,
) -> dict[str, dict]:
    """Every device's status (retained, or its answer to the roll call), read until ``quiet_s``
    passes without a new one.

    With ``others`` the retained statuses of devices speaking for any other fleet go there
    (``{fleet: {device: status}}``): a device with a wrong ``fleet =`` shows up.  A broker whose
    ACL confines this login to its fleet (as ``fleet init``'s does) refuses that subscription.
    """
    restate.follow_statuses(session, fleet)
    if others is not None:
        session.subscribe(topics.topic_status_all(topics.ANY))
    statuses: dict[str, dict] = {}
    deadline = time.monotonic() + max_s
    last = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        msg = session.get(0.05)
        if msg is None:
            continue
        try:
            elsewhere = topics.parse_topic(msg.topic).fleet != fleet
        except codec.WireError:
            elsewhere = False  # take_status says why it is ignored
        if elsewhere and others is not None:
            if take_status(others.setdefault(topics.parse_topic(msg.topic).fleet, {}), msg):
                last = time.monotonic()
        elif not elsewhere and take_status(statuses, msg):
            last = time.monotonic()
    return statuses


def other_fleets_note(fleet: str, others: dict[str, dict[str, dict]]) -> str | None:
    """One line naming the devices that speak for a fleet other than ``fleet``; ``None`` if none."""
    found = [f"{_text(d)} (fleet {_text(f)!r})" for f, per in sorted(others.items()) for d in sorted(per)]
    if not found:
        return None
    return (
        f"devices speaking for another fleet than {fleet!r}: {', '.join(found)}; if they belong to "
        f'this one, set `fleet = "{fleet}"` in their device.toml'
    )


def take_status(statuses: dict[str, dict], msg: Message) -> bool:
    """Put ``msg``'s status into ``statuses`` (by device); ``True`` if it was a status body.

    A cleared (empty) status is no body; a malformed one is logged and left out.  The
    console keeps a live view with this, ``fleet status`` a one-shot one.
    """
    try:
        parsed = topics.parse_topic(msg.topic)
        body = decode_status(msg.payload)
    except (codec.WireError, ValueError) as exc:
        log.warning("ignoring status on %s: %s", msg.topic, exc)
        return False
    if parsed.kind != "status" or body is None:
        return False
    statuses[parsed.device] = body
    return True


def decode_status(payload: bytes) -> dict | None:
    """A retained status body: a JSON object, ``None`` for an empty payload (a cleared status).

    Raises ``ValueError`` for anything else, nesting too deep for the json module included.
    """
    if not payload:
        return None
    try:
        body = json.loads(payload)
    except RecursionError:
        raise ValueError("status JSON nested too deep") from None
    if not isinstance(body, dict):
        raise ValueError(f"status is not a JSON object: {type(body).__name__}")
    return body


def summarize(
    statuses: dict[str, Any], revoked: Collection[str] = (), *, refusals_in_tasks: bool = True
) -> list[dict[str, Any]]:
    """One row per device: state, kind and tags, models, last round and metric (or refusal) per task.

    A device in ``revoked`` (:func:`cloud_aggregator.operator.revoked_devices`) shows as
    ``revoked`` whatever its last status said: it cannot log in again.  The console shows the
    tasks a device refuses in a column of their own (``refusals_in_tasks=False``).

    Any device can write its own retained status, so every field is checked: a field
    of the wrong type shows as ``?`` in that device's row, never raises, and text is
    cut short and stripped of control characters (no terminal escapes from a device).
    """
    rows = []
    for device in sorted(statuses):
        body = statuses[device]
        if not isinstance(body, dict):
            body = {}
        rows.append(
            {
                "device": _text(device),
                "state": "revoked"
                if device in revoked
                else _text(body.get("state"))
                if isinstance(body.get("state"), str)
                else "?",
                "kind": _kind_cell(body.get("kind"), body.get("tags")),
                "models": _models_cell(body.get("models")),
                "tasks": _tasks_cell(body.get("tasks"), body.get("refused") if refusals_in_tasks else None),
                "data": _data_cell(body.get("data")),
                "since": number(body.get("time")),
            }
        )
    return rows


#: A reason (a refusal, a rejected model) is a sentence: it gets room, and is cut between words.
REASON_LIMIT = 200


def _text(value: Any, limit: int = 60) -> str:
    """``value`` as printable text (control characters as ``?``), at most ``limit`` characters.

    A longer text is cut at its last space within the limit (inside a word only when it has no
    space in the limit's second half) and ends with ``…``, so a reader never takes a cut word
    for the whole one.
    """
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    return (head[:space] if space >= limit // 2 else head).rstrip() + "…"


def number(value: Any) -> float | None:
    """``value`` if it is a finite int or float (not a bool), else ``None`` (a status is never trusted)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _version(value: Any) -> str:
    """A version or count as the device reported it: an int, else ``?``."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _models_cell(models: Any) -> str:
    if models is None or models == {}:
        return "-"
    if not isinstance(models, dict):
        return "?"
    cells = []
    for name, m in sorted(models.items()):
        if not isinstance(m, dict):
            cells.append(f"{_text(name)} ?")
            continue
        active = m.get("active")
        cell = f"{_text(name)} none" if active is None else f"{_text(name)} v{_version(active)}"
        t = m.get("transfer")
        if t:
            if isinstance(t, dict):
                cell += f" (fetching v{_version(t.get('version'))}: {_version(t.get('have'))}/{_version(t.get('of'))})"
            else:
                cell += " (fetching ?)"
        rejected = m.get("rejected")
        if rejected:
            r = rejected[-1] if isinstance(rejected, list) else None
            if isinstance(r, dict):
                reason = r.get("reason", "")
                reason = _text(reason, REASON_LIMIT) if isinstance(reason, str) else "?"
                cell += f" [refused v{_version(r.get('version'))}: {reason}]"
            else:
                cell += " [refused ?]"
        cells.append(cell)
    return "; ".join(cells) or "-"


def _kind_cell(kind: Any, tags: Any) -> str:
    """``kind [tag, ...]`` as the device declared them (``-``: none declared)."""
    cell = "-" if kind is None else (_text(kind, 20) if isinstance(kind, str) else "?")
    if isinstance(tags, list) and tags:
        cell += " [" + ", ".join(_text(t, 20) if isinstance(t, str) else "?" for t in tags[:8]) + "]"
    elif tags not in (None, []):
        cell += " [?]"
    return cell


def _data_cell(data: Any) -> str:
    """``train/test rows``, and the recorder's sensor state where one runs (``sensor fault``)."""
    if data is None:
        return "-"
    if not isinstance(data, dict):
        return "?"
    cell = f"{_version(data.get('train'))}/{_version(data.get('test'))} rows"
    sensor = data.get("sensor")
    if isinstance(sensor, dict):
        state = sensor.get("state")
        state = _text(state, 12) if isinstance(state, str) else "?"
        cell += f", sensor {state}" + ("" if sensor.get("running") is not False else " (recorder stopped)")
    elif sensor is not None:
        cell += ", sensor ?"
    return cell


def _tasks_cell(tasks: Any, refused: Any = None) -> str:
    cells = []
    if isinstance(refused, dict):
        for name, why in sorted(refused.items()):
            cells.append(
                f"{_text(name)}: refused ({_text(why, REASON_LIMIT) if isinstance(why, str) else '?'})"
            )
    elif refused:
        cells.append("refused ?")
    if tasks is None or tasks == {}:
        return "; ".join(cells) or "-"
    if not isinstance(tasks, dict):
        return "; ".join([*cells, "?"])
    for name, t in sorted(tasks.items()):
        if not isinstance(t, dict):
            cells.append(f"{_text(name)}: ?")
            continue
        round_ = t.get("round")
        cell = f"{_text(name)}: " + ("no round yet" if round_ is None else f"round {_version(round_)}")
        metrics = t.get("metrics")
        if isinstance(metrics, dict):
            key = next((k for k in METRICS if k in metrics), None)
            if key is not None:
                value = metrics[key]
                number = isinstance(value, int | float) and not isinstance(value, bool)
                cell += f" {key}={_fmt(value) if number else '?'}"
        elif metrics:
            cell += " metrics=?"
        cells.append(cell)
    return "; ".join(cells) or "-"


def _fmt(value: int | float) -> str:
    try:
        return f"{float(value):.4f}"
    except OverflowError:
        return "?"


def format_table(rows: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    headers = (
        "device",
        "state",
        "kind [tags]",
        "models (active version)",
        "tasks (last round, last metric)",
        "local data",
        "status age",
    )
    cells = [
        (
            r["device"],
            r["state"],
            r.get("kind", "-"),
            r["models"],
            r["tasks"],
            r.get("data", "-"),
            f"{now - r['since']:.0f} s" if isinstance(r.get("since"), int | float) else "?",
        )
        for r in rows
    ]
    widths = [max(len(str(c[i])) for c in [headers, *cells]) for i in range(len(headers))]
    line = lambda c: "  ".join(str(v).ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(c) for c in cells)])


def _clock(t: float, now: float) -> str:
    ago = max(0.0, now - t)
    span = f"{ago:.0f} s" if ago < 90 else f"{ago / 60:.0f} min" if ago < 5400 else f"{ago / 3600:.1f} h"
    return f"{time.strftime('%H:%M:%S', time.localtime(t))} ({span} ago)"


def _said(value: Any) -> str:
    """A device's string, printable (anything else: ``?``)."""
    return _text(value) if isinstance(value, str) else "?"


def alert_lines(statuses: dict[str, Any], now: float | None = None) -> tuple[list[str], list[str]]:
    """The open alerts (each with what to do), and the rules that cannot fire: one line each, by device.

    From each status's ``alerts`` and ``serving.rules`` (``edge.serving``); every field checked.
    """
    now = time.time() if now is None else now
    lines: list[str] = []
    silent: list[str] = []
    for device in sorted(statuses):
        body = statuses[device] if isinstance(statuses[device], dict) else {}
        opened = body.get("alerts") if isinstance(body.get("alerts"), list) else []
        for a in [a for a in opened if isinstance(a, dict)][:64]:
            meaning = f" — {_text(a['meaning'], REASON_LIMIT)}" if isinstance(a.get("meaning"), str) else ""
            since = number(a.get("since"))
            line = (
                f"{_text(device)}: {_said(a.get('rule'))} (task {_said(a.get('task'))}{meaning}) open since "
                f"{_clock(since, now) if since is not None else '?'}: {_version(a.get('votes'))} of the last "
                f"{_version(a.get('n'))} over {a['threshold'] if number(a.get('threshold')) is not None else '?'}"
            )
            if isinstance(a.get("action"), str):
                line += f"; what to do: {_text(a['action'], REASON_LIMIT)}"
            lines.append(line)
        serving = body.get("serving") if isinstance(body.get("serving"), dict) else {}
        rules = serving.get("rules") if isinstance(serving.get("rules"), dict) else {}
        for name, r in sorted(rules.items())[:64]:
            if isinstance(r, dict) and isinstance(r.get("silent"), str):
                silent.append(
                    f"{_text(device)}: rule {_text(name)} cannot fire: {_text(r['silent'], REASON_LIMIT)}"
                )
    return lines, silent


def add_parser(fleet_sub: argparse._SubParsersAction) -> None:
    p = fleet_sub.add_parser(
        "status", help="per device: online/offline, active models, last round and metric"
    )
    add_session_args(p)
    p.add_argument("--json", action="store_true", help="print the raw retained statuses as JSON")
    p.add_argument("--wait", type=float, default=0.5, help="seconds without a new status before printing")
    p.add_argument(
        "--fleet-dir",
        type=Path,
        help="the `fleet init` folder, to show revoked devices as such (default: the one --config is in)",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        session, fleet = operator_session(args, "status")
    except (ConfigError, ValueError) as exc:
        print(f"cloud-aggregator: {one_line(exc)}", file=sys.stderr)
        return 2
    others: dict[str, dict[str, dict]] = {}
    try:
        statuses = collect_status(session, fleet, quiet_s=args.wait, others=others)
    finally:
        session.stop()
    note = other_fleets_note(fleet, others)
    root = args.fleet_dir or fleet_root_of(args.config)
    revoked = revoked_devices(root) if root is not None else set()
    if args.json:
        for device in revoked & set(statuses):  # its last status said online or offline
            statuses[device] = {**statuses[device], "state": "revoked"}
        print(json.dumps(statuses, indent=1, sort_keys=True))
    elif not statuses:
        print(f"no device has reported on fleet {fleet}")
    else:
        print(format_table(summarize(statuses, revoked)))
        opened, silent = alert_lines({d: s for d, s in statuses.items() if d not in revoked})
        # A blank line ends the table: what follows is about the fleet's alerts, not a device's row.
        print(f"\nopen alerts: {len(opened) or 'none'}" + "".join(f"\n  {line}" for line in opened))
        if silent:
            print("alert rules that cannot fire:" + "".join(f"\n  {line}" for line in silent))
    if note is not None and not args.json:
        print(note)
    return 0
