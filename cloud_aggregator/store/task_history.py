"""What the store holds of one task, and which changes to a task's spec would void that history."""

from __future__ import annotations

import json
from dataclasses import dataclass

from trainer_lite.task import training_changes


class TaskChangedError(ValueError):
    """A configured task differs from the stored one in fields that would void its history.

    ``fields`` names them; the message says how to go on (put them back, or ``serve
    --restart TASK``).
    """

    def __init__(self, task: str, fields: list[str], history: TaskHistory) -> None:
        self.task = task
        self.fields = fields
        super().__init__(
            f"task {task!r}: {', '.join(fields)} changed since its stored {history.describe()}; "
            f"put {'it' if len(fields) == 1 else 'them'} back to resume, or run "
            f"`cloud-aggregator serve --restart {task}` to delete its history and start it afresh"
        )


@dataclass(frozen=True)
class TaskHistory:
    """What the store holds of one task (what ``--restart TASK`` deletes)."""

    rounds: int
    last_round: int
    updates: int
    rejections: int

    def describe(self) -> str:
        """E.g. ``"3 rounds (1-3), 2 pending uploads, 0 refused uploads"``."""
        span = f" (1-{self.last_round})" if self.last_round else ""
        return (
            f"{self.rounds} round record{'s' if self.rounds != 1 else ''}{span}, "
            f"{self.updates} pending upload{'s' if self.updates != 1 else ''}, "
            f"{self.rejections} refused upload{'s' if self.rejections != 1 else ''}"
        )


def changed_fields(stored_json: str, spec_json: str, last_round: int = 0) -> list[str]:
    """The spec fields that differ and void a task's history (``rounds`` only below ``last_round``).

    Parameters
    ----------
    stored_json, spec_json
        ``TaskSpec.to_json()`` of the stored and the configured task.
    last_round
        The last round the store completed: fewer ``rounds`` than that is a change too.

    Returns
    -------
    list[str]
        Sorted field names; empty when the task resumes with its history.
    """
    out = training_changes(stored_json, spec_json)
    if int(json.loads(spec_json).get("rounds", 0)) < last_round:
        out.append(f"rounds (below the {last_round} already run)")
    return out
