"""Field accuracy: each answer scored when its row's truth becomes known, and a drift flag.

A printer layer knows its truth at once (the commanded speed is in the row): its answer is
scored when made, by its absolute error ``|expected - commanded|`` in mm/s.  A weld's truth
comes later, from the maintenance log: the recorder feeds a label record
(``{"kind": "label", "key": <weld id>, "label": <class>}``) when it stores the weld, and the
answer made earlier for that weld is scored then (right or wrong).  Answers waiting for a
label are kept (at most :data:`MAX_PENDING`, oldest dropped and counted); a label for a weld
never answered is counted under ``unknown_labels`` and ignored.

Per task the status shows the rolling accuracy (welds) or mean absolute error (layers) over
the last ``[serve] field_window`` scored answers, beside the serving model's own test-split
figure (``reference``), and ``drift: true`` once at least half a window is scored and the
field figure is worse than the reference by more than ``[serve] drift_margin`` (accuracy:
points below; error: that fraction above).

Coverage (:mod:`edge.serving.conformal`): each scored answer whose conformal interval or set
was calibrated counts whether it held the truth (the commanded speed, the label); the status
shows the fraction over the last ``field_window`` of them and over all, beside the nominal
level.  ``on_truth(answer, truth)`` hears every truth as it becomes known (the server adds the
answer's score to its model's calibration).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import Any

from edge.serving.conformal import covers
from edge.serving.records import Answer

#: Weld answers kept waiting for their label (about a shift of welds).
MAX_PENDING = 4096


class FieldScores:
    """Scored answers per task (see the module docstring)."""

    def __init__(
        self, window: int, margin: float, on_truth: Callable[[Answer, float | str], None] | None = None
    ) -> None:
        self.window, self.margin = window, margin
        self.scores: dict[str, deque[float]] = {}
        self.kinds: dict[str, str] = {}  # task -> "accuracy" or "error"
        self.scored: Counter[str] = Counter()
        self.pending: OrderedDict[tuple[str, str], Answer] = OrderedDict()  # (task, weld id) -> its answer
        self.classes: dict[str, list[str]] = {}
        self.expired = 0
        self.unknown_labels = 0
        # Coverage of the conformal intervals and sets (see the module docstring).
        self.on_truth = on_truth
        self.held: dict[str, deque[float]] = {}
        self.held_all: Counter[str] = Counter()  # task -> answers that held the truth, ever
        self.held_of: Counter[str] = Counter()  # task -> calibrated answers scored, ever
        self.levels: dict[str, float] = {}

    def _add(self, task: str, kind: str, value: float) -> None:
        self.kinds[task] = kind
        self.scores.setdefault(task, deque(maxlen=self.window)).append(value)
        self.scored[task] += 1

    def reload(self, records: list[dict[str, Any]]) -> None:
        """Weld answers from the answer log, so that a label landing after a restart still scores its answer."""
        for record in records[-MAX_PENDING:]:
            if record.get("kind") != "weld":
                continue
            try:
                answer = Answer.from_dict(record)  # reads the old logs' "label" too
            except (ValueError, TypeError):
                continue
            if answer.predicted is not None:
                self.answered(answer)

    def answered(self, answer: Answer) -> None:
        """Score a layer's answer now; keep a weld's until its label comes."""
        if answer.residual is not None:
            self._add(answer.task, "error", abs(answer.residual))
            if answer.commanded is not None:
                self._truth(answer, answer.commanded)
        elif answer.predicted is not None and answer.classes is not None:
            self.classes[answer.task] = list(answer.classes)
            self.pending[(answer.task, answer.key)] = answer
            self.pending.move_to_end((answer.task, answer.key))
            while len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
                self.expired += 1

    def label(self, key: str, label: str) -> list[tuple[str, bool]]:
        """A weld's label arrived: score every task's earlier answer to it; ``[(task, right)]``."""
        out = []
        for task in list(self.classes):
            answer = self.pending.pop((task, key), None)
            if answer is not None and label in self.classes[task]:
                self._add(task, "accuracy", float(answer.predicted == label))
                self._truth(answer, label)
                out.append((task, answer.predicted == label))
        if not out:
            self.unknown_labels += 1
        return out

    def _truth(self, answer: Answer, truth: float | str) -> None:
        """``answer``'s truth is known: count whether its interval or set held it; tell ``on_truth``."""
        held = covers(answer, truth)
        if held is not None:
            task = answer.task
            self.levels[task] = float(answer.conformal["level"])  # type: ignore[index]
            self.held.setdefault(task, deque(maxlen=self.window)).append(float(held))
            self.held_of[task] += 1
            self.held_all[task] += int(held)
        if self.on_truth is not None:
            self.on_truth(answer, truth)

    def coverage(self, task: str) -> dict[str, Any] | None:
        """``{level, value, n, all, scored}``: the fraction of ``task``'s calibrated answers whose
        interval or set held the truth, over the last ``window`` (``value``) and over all."""
        h = self.held.get(task)
        if not h:
            return None
        scored = self.held_of[task]
        return {"level": self.levels[task], "value": sum(h) / len(h), "n": len(h),
                "all": self.held_all[task] / scored, "scored": scored}  # fmt: skip

    def figure(self, task: str) -> float | None:
        s = self.scores.get(task)
        return None if not s else sum(s) / len(s)

    def drifting(self, task: str, reference: float | None) -> bool:
        s, value = self.scores.get(task), self.figure(task)
        if reference is None or value is None or s is None or len(s) < max(2, self.window // 2):
            return False
        if self.kinds[task] == "accuracy":
            return value < reference - self.margin
        return value > reference * (1.0 + self.margin)

    def status(self, references: dict[str, float | None]) -> dict[str, Any]:
        """Per task: ``{metric, value, n, scored, reference, drift}`` (``references``: the models' test figures)."""
        out: dict[str, Any] = {}
        for task, s in self.scores.items():
            ref = references.get(task)
            out[task] = {
                "metric": self.kinds[task],
                "value": self.figure(task),
                "n": len(s),
                "scored": self.scored[task],
                "reference": ref,
                "drift": self.drifting(task, ref),
            }
            coverage = self.coverage(task)
            if coverage is not None:
                out[task]["coverage"] = coverage
        waiting = Counter(task for task, _ in self.pending)
        for task, count in waiting.items():
            out.setdefault(task, {"metric": "accuracy", "value": None, "n": 0, "scored": 0,
                                  "reference": references.get(task), "drift": False})  # fmt: skip
            out[task]["awaiting_labels"] = count
        return out
