"""Alert rules over a task's answers: k of the last n over a threshold, with hysteresis and a cooldown.

Each rule (:class:`edge.config_serve.AlertRule`, ``[[serve.alerts]]`` in ``device.toml``) keeps the
values it read from its task's last ``n`` answers.  It **raises** when at least ``k`` of them
are above ``above`` and **clears** when at least ``k`` are at or below ``clear_below``: between
the two thresholds an open alert stays open and a closed one stays closed, so a value hovering
at the threshold changes nothing.  After a clear, the rule does not raise again for
``cooldown_s`` seconds of row time.  A rule with ``require_in_range`` (``require_confident``)
takes no vote from an answer whose row lies outside the serving model's trained range (whose
conformal prediction set is not one class): such answers are counted, not read.  Each raise
or clear starts the window afresh, so the opposite decision needs ``k`` new rows (with
``k <= n/2`` both could otherwise hold at once).  Each raise and each clear is one event
(:class:`Event`): the server publishes it once, retained, on ``alert/<device>/<rule>``.

A rule's ``action`` (what to do) and, for a ``p:<class>`` rule, the class's meaning
(``[serve.classes]``) ride on each event and each open alert.  A rule that can never fire (its
class is not one of its task's classes, or it reads a class probability from a task that predicts
a speed) is refused at start (:func:`rule_problem`, :func:`known_classes`); one that cannot fire
*yet* (no serving model for its task) says so in the status (:func:`edge.serving.server_status.rule_status`).

Open alerts (and each rule's last clear, for the cooldown) are written atomically to
``<state_dir>/serving/alerts.json`` on every raise and clear, so they survive a restart; the
window of recent values does not (a restarted rule needs ``k`` new rows to clear).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge.config import DeviceConfig
from edge.config_serve import AlertRule
from edge.serving.records import Answer
from ioft_protocol.state import atomic_write_json

log = logging.getLogger(__name__)

ALERTS_FILE = "alerts.json"


def read_value(rule: AlertRule, answer: Answer) -> float | None:
    """What ``rule`` reads from ``answer`` (``None``: the answer does not carry it)."""
    if rule.value.startswith("p:"):
        if answer.classes is None or answer.probabilities is None:
            return None
        name = rule.value[2:]
        return answer.probabilities[answer.classes.index(name)] if name in answer.classes else None
    if rule.value == "abs_residual":
        return None if answer.residual is None else abs(answer.residual)
    got = getattr(answer, rule.value, None)
    return None if got is None else float(got)


def rule_problem(rule: AlertRule, classes: list[str] | None) -> str | None:
    """Why ``rule`` can never fire on a task answering ``classes`` (``None``: a speed), else ``None``."""
    head = f"serve.alerts {rule.name!r}: value = {rule.value!r}"
    if rule.class_name is not None and classes is None:
        return f"{head} reads a class probability, but task {rule.task} predicts a speed; read residual, abs_residual or expected_speed"
    if rule.class_name is not None and classes is not None and rule.class_name not in classes:
        return f"{head}: {rule.class_name!r} is not one of task {rule.task}'s classes ({', '.join(classes)})"
    if rule.class_name is None and classes is not None:
        return f"{head} reads a speed, but task {rule.task} answers a class ({', '.join(classes)}); read p:<class>"
    return None


def known_classes(config: DeviceConfig, meta: dict[str, Any]) -> tuple[list[str] | None, str] | None:
    """The classes this device's tasks answer (``None``: a speed) and where that is known from.

    ``None`` when nothing tells yet: a welder with no rows and no ``[sensors]`` target.
    """
    if meta:
        classes = meta.get("classes")
        return (list(classes) if isinstance(classes, list) else None), "the dataset's metadata"
    if config.sensors is not None and config.sensors.kind == "welder":
        from sensors.welding.labels import SURFACES, TOOL_CLASSES_M, TOOL_CLASSES_S

        target = config.sensors.target
        by_target = {
            "tool_m": list(TOOL_CLASSES_M),
            "tool_s": list(TOOL_CLASSES_S),
            "surface": list(SURFACES),
        }
        return by_target.get(target), f"[sensors] target = {target!r}"
    if config.machine_kind == "printer":
        return None, 'kind = "printer"'
    return None


def check_rules(config: DeviceConfig, meta: dict[str, Any]) -> tuple[list[str], str | None]:
    """The problems that refuse the start (rules and ``[serve.classes]`` that can never apply), and a
    note when the classes are not knowable yet (the check then waits for the first serving model)."""
    known = known_classes(config, meta)
    if known is None:
        names = sorted(
            {r.class_name for r in config.serve.alerts if r.class_name} | set(config.serve.classes)
        )
        if not names:
            return [], None
        return [], (
            f"classes {', '.join(names)} not checked: this device has no rows yet and no [sensors] target "
            "to tell its classes; each alert rule is checked when its task's first model serves"
        )
    classes, source = known
    problems = [f"{p} (from {source})" for r in config.serve.alerts if (p := rule_problem(r, classes))]
    for name in config.serve.classes:
        if classes is None or name not in classes:
            have = (
                f"its classes are {', '.join(classes)}"
                if classes
                else "its tasks predict a speed, not a class"
            )
            problems.append(
                f"serve.classes.{name}: {name!r} is not a class of this device ({have}, from {source})"
            )
    return problems, None


def votes(rule: AlertRule, answer: Answer) -> bool:
    """Whether ``answer`` meets ``rule``'s requirements on how far it can be trusted."""
    if rule.require_in_range and answer.in_range is not True:
        return False
    if rule.require_confident:
        c = answer.conformal
        return isinstance(c, dict) and bool(c.get("calibrated")) and len(c.get("set") or ()) == 1
    return True


@dataclass(frozen=True)
class Event:
    """One raise or clear of one rule: the payload of its (retained) alert message."""

    device: str
    rule: str
    task: str
    state: str  # "raised" or "cleared"
    at: float  # the row time of the answer that tipped it
    key: str  # that answer's row key
    value: float  # what the rule read from it
    votes: int  # how many of the last n were over (raised) or at/below (cleared) the threshold
    k: int
    n: int
    threshold: float
    since: float  # when the alert was raised (a clear: when the alert it ends was raised)
    action: str | None = None  # what to do, in the operator's words (the rule's ``action``)
    meaning: str | None = None  # what the class it reads means (``[serve.classes]``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for the log: the rule, its vote and the row that tipped it."""
        side = "over" if self.state == "raised" else "at or below"
        return (
            f"alert {self.rule} {self.state} (task {self.task}: {self.votes} of the last {self.n} rows "
            f"{side} {self.threshold:g}; row {self.key} read {self.value:g})"
        )


class Alerts:
    """Every rule's window and state on one device (see the module docstring)."""

    def __init__(
        self, device: str, rules: list[AlertRule], folder: Path, meanings: dict[str, str] | None = None
    ) -> None:
        self.device = device
        self.rules = {r.name: r for r in rules}
        self.meanings = dict(meanings or {})  # class -> what it means ([serve.classes])
        self.path = Path(folder) / ALERTS_FILE
        self.windows: dict[str, deque[float]] = {r.name: deque(maxlen=r.n) for r in rules}
        self.open: dict[str, dict[str, Any]] = {}  # rule -> the raise event, as a dict
        self.cleared_at: dict[str, float] = {}
        self.unreadable = self.unknown_values = 0
        self.untrusted = 0  # answers a rule's require_in_range / require_confident kept from voting
        self._load()

    def _load(self) -> None:
        try:
            saved = json.loads(self.path.read_text())
            open_, cleared = saved["open"], saved["cleared_at"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.error("%s: %s unreadable (%s); starting with no open alert", self.device, self.path, exc)
            return
        # A rule removed from device.toml since closes its alert silently (nothing reads it any more).
        self.open = {name: ev for name, ev in open_.items() if name in self.rules}
        self.cleared_at = {name: float(t) for name, t in cleared.items() if name in self.rules}
        for name in self.open:
            log.info("%s: alert %s still open from before the restart", self.device, name)

    def _save(self) -> None:
        try:
            atomic_write_json(self.path, {"open": self.open, "cleared_at": self.cleared_at})
        except OSError as exc:
            log.error("%s: could not save the open alerts to %s: %s", self.device, self.path, exc)

    def observe(self, answer: Answer) -> list[Event]:
        """Feed one answer to its task's rules; the raises and clears it causes (usually none)."""
        events = []
        for rule in self.rules.values():
            if rule.task != answer.task:
                continue
            if not votes(rule, answer):
                self.untrusted += 1
                continue
            value = read_value(rule, answer)
            if value is None:
                self.unknown_values += 1
                continue
            window = self.windows[rule.name]
            window.append(value)
            ev = self._decide(rule, window, answer, value)
            if ev is not None:
                events.append(ev)
        if events:
            self._save()
        return events

    def _decide(self, rule: AlertRule, window: deque[float], answer: Answer, value: float) -> Event | None:
        at = answer.row_time
        if rule.name in self.open:
            votes = sum(v <= rule.clear_at for v in window)
            if votes < rule.k:
                return None
            raised = self.open.pop(rule.name)
            self.cleared_at[rule.name] = at
            window.clear()  # the next raise needs k fresh rows over the threshold
            return Event(self.device, rule.name, rule.task, "cleared", at, answer.key, value, votes,
                         rule.k, rule.n, rule.clear_at, float(raised["since"]), *self.words(rule))  # fmt: skip
        votes = sum(v > rule.above for v in window)
        if votes < rule.k:
            return None
        last_clear = self.cleared_at.get(rule.name)
        if last_clear is not None and at - last_clear < rule.cooldown_s:
            return None
        ev = Event(self.device, rule.name, rule.task, "raised", at, answer.key, value, votes,
                   rule.k, rule.n, rule.above, at, *self.words(rule))  # fmt: skip
        self.open[rule.name] = ev.to_dict()
        window.clear()  # the clear needs k fresh rows at or below clear_below
        return ev

    def words(self, rule: AlertRule) -> tuple[str | None, str | None]:
        """The rule's ``action`` and the meaning of the class it reads (each ``None`` when not given)."""
        return rule.action, self.meanings.get(rule.class_name or "")

    def status(self) -> list[dict[str, Any]]:
        """The open alerts (their raise events), oldest first: the status's ``alerts``.

        The words are today's config's (an alert opened before a restart takes an edited action)."""
        out = []
        for ev in sorted(self.open.values(), key=lambda e: (e["since"], e["rule"])):
            action, meaning = self.words(self.rules[ev["rule"]])
            out.append(ev | {"action": action, "meaning": meaning})
        return out
