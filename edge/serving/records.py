"""The two records of serving: a :class:`Row` handed over by the recorder, the :class:`Answer` to it.

Both travel as one JSON object per line (the row feed, the answer log, the MQTT payload),
so :meth:`from_json` checks every field a foreign or torn line could get wrong and raises
``ValueError`` naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

# Row lives below the recorder and serving (edge.rows); importers of this module still find it here.
from edge.rows import ROW_KINDS, Row  # noqa: F401 (kept importable from here)
from edge.rows import check as _check
from edge.rows import finite_number as _number


@dataclass(frozen=True)
class ModelId:
    """Which model answered: its task, the round it was trained in, a digest of its parameters
    (two models of one round number -- a task started over -- still differ) and its encoder's
    name and version where the task embeds rows."""

    task: str
    round: int
    digest: str = ""
    encoder: str | None = None
    encoder_version: int | None = None


@dataclass(frozen=True)
class Answer:
    """The serving model's answer to one row.

    Printer (``kind = "layer"``): ``expected_speed``, the speed in mm/s this printer's
    model expects at the layer's measured vibration, and ``residual`` = expected −
    commanded (large: the layer vibrates like a much faster or slower one).  Welder:
    ``probabilities`` per class of the task's target (``classes``) and the most likely,
    ``predicted`` (also published as ``label``, its old name, until version 0.2.0:
    :data:`PREDICTED_OLD_NAME`).  ``latency_s``: from ``row_time`` (features existed) to the answer.
    ``conformal`` and ``in_range``: how far to trust it (see the fields).
    """

    device: str
    task: str
    kind: str
    key: str
    row_time: float
    answered_at: float
    latency_s: float
    model: ModelId
    expected_speed: float | None = None
    commanded: float | None = None
    residual: float | None = None
    classes: list[str] | None = None
    probabilities: list[float] | None = None
    predicted: str | None = None
    # An interval on every answer (edge.serving.conformal): ``conformal`` holds the coverage
    # ``level``, the ``n`` calibration rows, ``calibrated`` and the ``interval`` [lo, hi] in mm/s
    # (layers) or the prediction ``set`` (welds); ``in_range``: the row lies within the per-feature
    # range of the rows the model was trained on.
    conformal: dict[str, Any] | None = None
    in_range: bool | None = None
    #: The candidate model that gave it (``edge.serving.candidates``); records older than it: "personal".
    candidate: str = "personal"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: its recursive deep copy was half an answer's CPU.
        body: dict[str, Any] = {}
        for name in _ANSWER_FIELDS:
            v = getattr(self, name)
            if name == "model":
                body[name] = {k: getattr(v, k) for k in _MODEL_FIELDS if getattr(v, k) is not None}
            elif v is not None:
                body[name] = list(v) if isinstance(v, list) else v
        if self.predicted is not None:
            # the old name too, for one version: subscribers written for it keep working meanwhile
            body[PREDICTED_OLD_NAME] = self.predicted
        return body | self.extra

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Answer:
        """An answer read back (the log, a subscriber); ``ValueError`` names the first bad field."""
        _check(isinstance(d, dict), "an answer must be a JSON object")
        for name in ("device", "task", "kind", "key"):
            _check(
                isinstance(d.get(name), str) and bool(d[name]), f"answer {name} must be a non-empty string"
            )
        for name in ("row_time", "answered_at", "latency_s"):
            _check(_number(d.get(name)), f"answer {name} must be a number")
        m = d.get("model")
        _check(isinstance(m, dict) and isinstance(m.get("task"), str), "answer model must name its task")
        _check(isinstance(m.get("round"), int), "answer model must name its round")
        model = ModelId(
            m["task"], m["round"], str(m.get("digest", "")), m.get("encoder"), m.get("encoder_version")
        )
        _check(
            d.get("conformal") is None or isinstance(d["conformal"], dict),
            "answer conformal must be an object",
        )
        _check(
            d.get("in_range") is None or isinstance(d["in_range"], bool),
            "answer in_range must be true or false",
        )
        known = {f for f in cls.__dataclass_fields__ if f not in ("model", "extra")}
        body = {k: v for k, v in d.items() if k in known}
        if body.get("predicted") is None and d.get(PREDICTED_OLD_NAME) is not None:
            body["predicted"] = d[PREDICTED_OLD_NAME]  # a device (or a log) not upgraded yet
        _check(
            body.get("predicted") is None or isinstance(body["predicted"], str),
            "answer predicted must be a string",
        )
        return cls(**body, model=model)


#: ``Answer.predicted``'s old name ("label" is the docs' word for the maintenance log's truth):
#: published beside it and read back until version 0.2.0, which drops it (docs/watching.md).
PREDICTED_OLD_NAME = "label"
_ANSWER_FIELDS = tuple(f.name for f in fields(Answer) if f.name != "extra")
_MODEL_FIELDS = tuple(f.name for f in fields(ModelId))
