"""A row of features as the recorder hands it to the serving model (:class:`Row`).

One JSON object per line of the row feed (:mod:`edge.feed`); :meth:`Row.from_json` checks
every field a foreign or torn line could get wrong and raises ``ValueError`` naming it.  Kept
below both the recorder (which writes rows) and serving (which answers them), so neither
imports the other for it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

#: What a row is: a completed printer layer or a weld.
ROW_KINDS = ("layer", "weld")


def check(cond: bool, what: str) -> None:
    """Raise ``ValueError(what)`` unless ``cond``: one line naming the bad field."""
    if not cond:
        raise ValueError(what)


def finite_number(v: object) -> bool:
    """A finite int or float (a bool is no number here)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Row:
    """One row of features, as the model of its task takes them.

    ``x`` is the row exactly as the dataset stores it (``sigma_a`` for a layer, the 624
    DWT features of a weld); ``time`` the wall-clock second its features existed;
    ``commanded`` the layer's commanded speed in mm/s (printers only); ``schema_hash``
    the weld features' recipe (welds only).
    """

    kind: str
    key: str
    time: float
    x: tuple[float, ...]
    commanded: float | None = None
    schema_hash: str | None = None

    def to_json(self) -> str:
        body = {"kind": self.kind, "key": self.key, "time": self.time, "x": list(self.x)}
        if self.commanded is not None:
            body["commanded"] = self.commanded
        if self.schema_hash is not None:
            body["schema_hash"] = self.schema_hash
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str | bytes) -> Row:
        """Parse one feed line; ``ValueError`` names the first bad field."""
        return cls.from_dict(json.loads(line))

    @classmethod
    def from_dict(cls, d: Any) -> Row:
        """A row from a parsed feed line; ``ValueError`` names the first bad field."""
        check(isinstance(d, dict), "a row must be a JSON object")
        check(d.get("kind") in ROW_KINDS, f"row kind must be one of {list(ROW_KINDS)}, got {d.get('kind')!r}")
        check(isinstance(d.get("key"), str) and bool(d["key"]), "row key must be a non-empty string")
        check(finite_number(d.get("time")), "row time must be a number (seconds since the epoch)")
        x = d.get("x")
        check(isinstance(x, list) and len(x) > 0, "row x must be a non-empty list of numbers")
        check(
            all(isinstance(v, int | float) and not isinstance(v, bool) for v in x), "row x holds a non-number"
        )
        commanded = d.get("commanded")
        check(commanded is None or finite_number(commanded), "row commanded must be a number (mm/s)")
        schema = d.get("schema_hash")
        check(schema is None or isinstance(schema, str), "row schema_hash must be a string")
        return cls(d["kind"], d["key"], float(d["time"]), tuple(float(v) for v in x), commanded, schema)
