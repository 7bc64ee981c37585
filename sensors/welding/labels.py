"""Label intake: tool and surface condition for each weld, from an operator or maintenance log.

A log is CSV (header row) or JSON lines, one entry per line, with these fields
(case-insensitive; unknown fields are kept as notes):

``time``/``timestamp``
    ISO 8601.  An entry with a time and no ``weld_id`` is a **state change**: it holds
    from that time until a later entry changes the same field ("new horn fitted
    08:02", "batch of contaminated coupons from 10:15").
``weld_id``
    An entry for one weld; its fields override the state at that weld's time.
``tool``
    Both tools at once: ``new``/``worn``/``damaged`` or a FTL-TP class
    ``TC1``..``TC4`` (horn/anvil new/new, new/worn, worn/new, worn/worn), ``New``,
    ``Worn``, ``DMGD``.
``horn``, ``anvil``
    One tool each: ``new``/``worn``/``damaged``.
``surface``
    ``clean``/``polished``/``contaminated`` (``contam`` accepted).

A field left empty leaves that part of the state unchanged.  A weld before any entry
that sets a field has ``None`` for it (unlabelled for that task).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, tzinfo
from pathlib import Path
from typing import Any

from sensors.welding.recording import WeldDataError, WeldRecording, parse_timestamp

TOOL_STATES = ("new", "worn", "damaged")
SURFACES = ("clean", "polished", "contaminated")
#: FTL-TP domain group M tool classes: (horn, anvil).
TOOL_CLASSES_M = {
    "TC1": ("new", "new"),
    "TC2": ("new", "worn"),
    "TC3": ("worn", "new"),
    "TC4": ("worn", "worn"),
}
#: FTL-TP domain groups S/T tool classes: both tools in the same state.
TOOL_CLASSES_S = {"New": ("new", "new"), "Worn": ("worn", "worn"), "DMGD": ("damaged", "damaged")}
_TOOL_ALIASES = {"dmgd": "damaged", "damage": "damaged", "broken": "damaged", "ok": "new", "fresh": "new"}
_SURFACE_ALIASES = {
    "contam": "contaminated",
    "contaminate": "contaminated",
    "oily": "contaminated",
    "polish": "polished",
    "sanded": "polished",
}
_FIELD_ALIASES = {
    "timestamp": "time",
    "datetime": "time",
    "weld": "weld_id",
    "id": "weld_id",
    "tool_condition": "tool",
    "surface_condition": "surface",
}
_LABEL_FIELDS = ("horn", "anvil", "surface")


class LabelLogError(WeldDataError):
    """A label log has invalid entries; the message lists each with its line number."""


@dataclass(frozen=True)
class WeldLabel:
    """The known conditions of one weld (``None`` = not known).

    Attributes
    ----------
    weld_id
        The weld.
    horn, anvil
        ``"new"``, ``"worn"`` or ``"damaged"``.
    surface
        ``"clean"``, ``"polished"`` or ``"contaminated"``.
    """

    weld_id: str
    horn: str | None = None
    anvil: str | None = None
    surface: str | None = None

    @property
    def tool_class_m(self) -> str | None:
        """FTL-TP domain group M class ``TC1``..``TC4``, or ``None`` if not one of them."""
        return _class_of(self.horn, self.anvil, TOOL_CLASSES_M)

    @property
    def tool_class_s(self) -> str | None:
        """FTL-TP domain groups S/T class ``New``/``Worn``/``DMGD``, or ``None``."""
        return _class_of(self.horn, self.anvil, TOOL_CLASSES_S)

    @property
    def complete(self) -> bool:
        """All three conditions known."""
        return None not in (self.horn, self.anvil, self.surface)


def _class_of(horn: str | None, anvil: str | None, table: Mapping[str, tuple[str, str]]) -> str | None:
    for name, pair in table.items():
        if pair == (horn, anvil):
            return name
    return None


@dataclass(frozen=True)
class LogEntry:
    """One validated log line."""

    line: int
    time: datetime | None
    weld_id: str | None
    values: Mapping[str, str]
    note: str = ""


def _norm_tool(value: str) -> tuple[str, str] | str:
    """``(horn, anvil)`` for a tool class, a single state for a state word."""
    text = value.strip()
    word = _TOOL_ALIASES.get(text.lower(), text.lower())
    if word in TOOL_STATES:  # before the class names: "Worn" is both
        return word
    for table in (TOOL_CLASSES_M, TOOL_CLASSES_S):
        for name, pair in table.items():
            if text.lower() == name.lower():
                return pair
    if word not in TOOL_STATES:
        raise ValueError(
            f"unknown tool condition {value!r}; use one of {', '.join(TOOL_STATES)} or a class "
            f"{', '.join([*TOOL_CLASSES_M, *TOOL_CLASSES_S])}"
        )
    return word


def _norm_surface(value: str) -> str:
    word = _SURFACE_ALIASES.get(value.strip().lower(), value.strip().lower())
    if word not in SURFACES:
        raise ValueError(f"unknown surface condition {value!r}; use one of {', '.join(SURFACES)}")
    return word


def parse_entry(raw: Mapping[str, Any], line: int, *, assume_tz: tzinfo = UTC) -> LogEntry:
    """Validate one raw log record (a CSV row or a JSON object).

    Raises
    ------
    ValueError
        Naming the first invalid field and the valid choices.
    """
    rec = {_FIELD_ALIASES.get(str(k).strip().lower(), str(k).strip().lower()): v for k, v in raw.items()}
    text = {k: ("" if v is None else str(v)).strip() for k, v in rec.items()}
    stamp = parse_timestamp(text["time"], what="time", assume_tz=assume_tz) if text.get("time") else None
    weld_id = text.get("weld_id") or None
    if stamp is None and weld_id is None:
        raise ValueError("entry has neither a time nor a weld_id")
    values: dict[str, str] = {}
    if text.get("tool"):
        tool = _norm_tool(text["tool"])
        values["horn"], values["anvil"] = tool if isinstance(tool, tuple) else (tool, tool)
    for part in ("horn", "anvil"):
        if text.get(part):
            word = _norm_tool(text[part])
            if isinstance(word, tuple):
                raise ValueError(
                    f"{part} takes one state ({', '.join(TOOL_STATES)}), not class {text[part]!r}"
                )
            if part in values and values[part] != word:
                raise ValueError(f"tool={text['tool']!r} contradicts {part}={text[part]!r}")
            values[part] = word
    if text.get("surface"):
        values["surface"] = _norm_surface(text["surface"])
    if not values:
        raise ValueError("entry sets none of tool, horn, anvil, surface")
    known = {"time", "weld_id", "tool", "horn", "anvil", "surface"}
    note = "; ".join(f"{k}={v}" for k, v in text.items() if k not in known and v)
    return LogEntry(line, stamp, weld_id, values, note)


class LabelLog:
    """A validated tool/surface condition log that labels welds by weld id or by time.

    Parameters
    ----------
    entries
        Validated entries (see :meth:`load` and :meth:`from_records`).

    Raises
    ------
    LabelLogError
        If two entries for the same weld id contradict each other.
    """

    def __init__(self, entries: Iterable[LogEntry]) -> None:
        entries = list(entries)
        self._changes = sorted((e for e in entries if e.weld_id is None), key=lambda e: (e.time, e.line))
        self._per_weld: dict[str, dict[str, str]] = {}
        errors = []
        for e in entries:
            if e.weld_id is None:
                continue
            have = self._per_weld.setdefault(e.weld_id, {})
            for k, v in e.values.items():
                if have.get(k, v) != v:
                    errors.append(
                        f"line {e.line}: weld {e.weld_id} {k}={v} contradicts earlier {k}={have[k]}"
                    )
                have[k] = v
        if errors:
            raise LabelLogError("label log is inconsistent:\n  " + "\n  ".join(errors))
        self._times = [e.time for e in self._changes]
        self._states: list[dict[str, str]] = []
        state: dict[str, str] = {}
        for e in self._changes:
            state = {**state, **e.values}
            self._states.append(state)

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        *,
        source: str = "log",
        first_line: int = 1,
        assume_tz: tzinfo = UTC,
    ) -> LabelLog:
        """Validate raw records, collecting every error before raising."""
        return cls._build(enumerate(records, first_line), source, assume_tz)

    @classmethod
    def _build(
        cls,
        numbered: Iterable[tuple[int, Any]],
        source: str,
        assume_tz: tzinfo,
        errors: list[str] | None = None,
    ) -> LabelLog:
        entries, errors = [], list(errors or [])
        for i, raw in numbered:
            try:
                if not isinstance(raw, Mapping):
                    raise ValueError(f"expected an object with named fields, got {type(raw).__name__}")
                entries.append(parse_entry(raw, i, assume_tz=assume_tz))
            except ValueError as exc:
                errors.append(f"{source} line {i}: {exc}")
        if errors:
            shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
            raise LabelLogError(
                f"{len(errors)} invalid label entr{'y' if len(errors) == 1 else 'ies'}:\n  "
                + "\n  ".join(shown)
            )
        return cls(entries)

    @classmethod
    def load(cls, path: str | Path, *, assume_tz: tzinfo = UTC) -> LabelLog:
        """Read a ``.csv`` or ``.jsonl`` log (naive times are read in ``assume_tz``)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise LabelLogError(f"{path}: not UTF-8 text ({exc})") from None
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            numbered, errors = [], []
            for i, ln in enumerate(text.splitlines(), 1):
                if not ln.strip() or ln.lstrip().startswith("#"):
                    continue
                try:
                    numbered.append((i, json.loads(ln)))
                except json.JSONDecodeError as exc:
                    errors.append(f"{path} line {i}: invalid JSON ({exc.msg})")
            return cls._build(numbered, str(path), assume_tz, errors)
        if suffix == ".csv":
            lines = text.splitlines(keepends=True)
            kept = [
                (i, ln) for i, ln in enumerate(lines, 1) if not ln.lstrip().startswith("#") and ln.strip()
            ]
            if not kept:
                raise LabelLogError(f"{path}: empty CSV (need a header such as time,horn,anvil,surface)")
            reader = csv.DictReader(io.StringIO("".join(ln for _, ln in kept)))
            numbers = [i for i, _ in kept[1:]]
            return cls._build(zip(numbers, reader, strict=False), str(path), assume_tz)
        raise LabelLogError(f"{path}: unsupported label log type {path.suffix!r}; use .csv or .jsonl")

    def state_at(self, when: datetime) -> dict[str, str]:
        """The accumulated horn/anvil/surface state at ``when`` (aware datetime)."""
        if when.tzinfo is None:
            raise LabelLogError(f"time {when} has no time zone")
        i = bisect.bisect_right(self._times, when)
        return dict(self._states[i - 1]) if i else {}

    def label(self, weld_id: str, started_at: datetime) -> WeldLabel:
        """Label one weld: its own entries first, then the state at its start time."""
        values = {**self.state_at(started_at), **self._per_weld.get(weld_id, {})}
        return WeldLabel(weld_id, **{k: values.get(k) for k in _LABEL_FIELDS})

    def label_recording(self, recording: WeldRecording) -> WeldLabel:
        """Label a recording by its weld id and start time."""
        return self.label(recording.weld_id, recording.started_at)
