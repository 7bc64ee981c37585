"""An interval on every answer: split conformal prediction from the device's own labelled rows.

Split conformal (Angelopoulos & Bates, "A Gentle Introduction to Conformal Prediction", 2021):
given ``n`` scores of rows the model did not train on, the ``⌈(n+1)(1−α)⌉``-th smallest, ``q``,
makes ``P(score of a new row <= q) >= 1 − α`` for any model, as long as the rows are exchangeable.

- A printer's answer (the speed its model expects) scores ``|expected − commanded|`` in mm/s;
  its interval is ``[expected − q, expected + q]``, which holds the commanded speed.
- A weld's answer scores ``1 − p(true class)``; its prediction set is every class with
  ``1 − p <= q``, which holds the weld's label.

The scores (the calibration) start from the model's own held-out test rows when it is offered,
and each labelled answer of that model adds its score as the label arrives (a layer at once, a
weld when the maintenance log labels it), keeping the last :data:`WINDOW`.  With fewer than
``⌈1/α⌉ − 1`` scores no finite ``q`` exists: the interval is unbounded and the set is every
class, and the answer says so (``calibrated: false``).  Field scores added after the offer
live in memory only: a restarted trainer starts again from the saved test-split scores.

MAPIE and crepes, the maintained Python libraries, both pull scikit-learn, too big for a Pi;
the method is a sort and an index, written here in NumPy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: ``[serve] coverage`` unless set: the interval holds the truth for 90 % of rows.
DEFAULT_COVERAGE = 0.90
#: The most recent scores kept per serving model (older rows describe an older machine).
WINDOW = 500
#: Probabilities are published to 6 decimals: a class within that of the quantile is in the set.
_TIE = 1e-6
#: Slack on ``(n+1)(1−α)`` before rounding up: ``10 × 0.9`` must stay 9, not become 10.
_EPS = 1e-9


def needed(level: float) -> int:
    """The fewest scores that give a finite ``q`` at coverage ``level`` (``⌈1/α⌉ − 1``)."""
    return max(0, math.ceil(1.0 / (1.0 - level) - _EPS) - 1)


def quantile(scores: Sequence[float] | np.ndarray, level: float) -> float | None:
    """The ``⌈(n+1)·level⌉``-th smallest of ``scores``; ``None`` (infinite) with too few of them."""
    n = len(scores)
    k = max(1, math.ceil((n + 1) * level - _EPS))
    if k > n:
        return None
    return float(np.partition(np.asarray(scores, dtype=np.float64), k - 1)[k - 1])


def score(answer: Any, truth: float | str) -> float | None:
    """The score of ``answer`` (an :class:`~edge.serving.records.Answer`) against its truth: the
    commanded speed of a layer, the label of a weld (``None``: the answer cannot be scored)."""
    if answer.classes is not None and answer.probabilities is not None:
        if truth not in answer.classes:
            return None
        return 1.0 - float(answer.probabilities[answer.classes.index(truth)])
    if answer.expected_speed is None or isinstance(truth, str):
        return None
    return abs(answer.expected_speed - float(truth))


def covers(answer: Any, truth: float | str) -> bool | None:
    """Whether ``answer``'s calibrated interval or set held ``truth``; ``None``: it had none to hold."""
    c = answer.conformal
    if not isinstance(c, dict) or not c.get("calibrated"):
        return None
    if "set" in c:
        return truth in c["set"]
    lo, hi = c["interval"]
    return not isinstance(truth, str) and lo <= float(truth) <= hi


def in_range(x: Sequence[float], low: np.ndarray | None, high: np.ndarray | None) -> bool | None:
    """Whether every feature of ``x`` lies within the training rows' ``[low, high]`` (``None``: unknown)."""
    if low is None or high is None:
        return None
    v = np.asarray(x, dtype=np.float64)
    return bool(v.shape == low.shape and np.all(v >= low) and np.all(v <= high))


class Calibration:
    """The last :data:`WINDOW` scores of one serving model's labelled rows."""

    def __init__(self, scores: Iterable[float] = (), window: int = WINDOW) -> None:
        self.scores: deque[float] = deque((float(s) for s in scores if math.isfinite(s)), maxlen=window)

    def __len__(self) -> int:
        return len(self.scores)

    def add(self, value: float | None) -> None:
        if value is not None and math.isfinite(value):
            self.scores.append(float(value))

    def array(self) -> np.ndarray:
        return np.asarray(
            list(self.scores), dtype=np.float64
        )  # list(): one C-level copy, never torn by an append

    def quantile(self, level: float) -> float | None:
        return quantile(self.array(), level)

    def interval(self, expected: float, level: float) -> dict[str, Any]:
        """The answer's ``conformal`` field for a speed of ``expected`` mm/s."""
        q = self.quantile(level)
        body: dict[str, Any] = {"level": level, "n": len(self), "calibrated": q is not None}
        body["interval"] = None if q is None else [round(expected - q, 6), round(expected + q, 6)]
        return body

    def prediction_set(self, classes: Sequence[str], p: Sequence[float], level: float) -> dict[str, Any]:
        """The answer's ``conformal`` field for class probabilities ``p``."""
        q = self.quantile(level)
        chosen = (
            list(classes)
            if q is None
            else [c for c, pc in zip(classes, p, strict=True) if 1.0 - pc <= q + _TIE]
        )
        return {"level": level, "n": len(self), "calibrated": q is not None, "set": chosen}
