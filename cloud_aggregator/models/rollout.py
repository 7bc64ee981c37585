"""Staged model rollouts: the record kept in the store, the canaries' answers, the decision.

``push --canary N`` offers a new version to N canary devices first (the retained
offer addresses them only); each installs it or refuses it (the device's own checks
and holdout guard) and reports, in its retained status, the new version's holdout
score beside the previous version's (``previous_metric``).  The rollout goes on to
the rest of the fleet only when at least ``min_installed`` of the canaries installed
it and no installed canary scores it worse than the version it replaced by more than
``margin``; otherwise it stops and the canaries go back to the previous version.
The MQTT side is ``cloud_aggregator.models.rollout_run``; this module is pure.
"""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from cloud_aggregator.models.push_answers import INSTALLED, PENDING, REFUSED, answer_of

#: Defaults of ``push --canary``: the share of canaries that must install the new version
#: without a rollback, and how much lower than the replaced version's their holdout may be.
MIN_INSTALLED = 0.8
MARGIN = 0.05


class State(StrEnum):
    CANARY = "canary"  # offered to the canaries; waiting for their answers
    PROMOTED = "promoted"  # offered to the rest of the fleet
    STOPPED = "stopped"  # the canaries failed the check; they were told to roll back
    ABORTED = "aborted"  # the operator stopped it (``rollout abort``)


class Verdict(StrEnum):
    PROMOTE = "promote"
    STOP = "stop"
    WAIT = "wait"


class RolloutError(ValueError):
    """A rollout that cannot start or go on as asked; the message says what to do instead."""


@dataclass
class Rollout:
    """One staged rollout of ``model`` v``version`` (replacing v``base_version``), as stored.

    ``canary_offer`` is the retained offer as published to the canaries (re-addressed to
    ``targets``, empty for the whole fleet, on promotion); ``previous_offer`` the one it
    replaced (published again with ``withdrawn`` when the rollout stops).
    ``withdrawal_signature`` is the fleet key's signature of that withdrawal
    (``model_push.withdrawal_text``), made when the rollout starts, so a stop (automatic or
    ``rollout abort``) needs no key; devices refuse an unsigned one.
    """

    model: str
    version: int
    base_version: int
    canaries: tuple[str, ...]
    targets: tuple[str, ...]
    min_installed: float
    margin: float
    canary_offer: bytes
    previous_offer: bytes
    state: State = State.CANARY
    reason: str = ""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    decided_at: float | None = None
    withdrawal_signature: str = ""

    def to_json(self) -> str:
        out = asdict(self)
        for key in ("canary_offer", "previous_offer"):
            out[key] = base64.b64encode(getattr(self, key)).decode()
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Rollout:
        raw = json.loads(text)
        for key in ("canary_offer", "previous_offer"):
            raw[key] = base64.b64decode(raw[key])
        raw["canaries"], raw["targets"] = tuple(raw["canaries"]), tuple(raw["targets"])
        raw["state"] = State(raw["state"])
        return cls(**raw)


@dataclass(frozen=True)
class CanaryResult:
    """What one canary's retained status says: installed (with the two scores), refused, pending."""

    device: str
    state: str  # push_answers.INSTALLED, REFUSED or PENDING
    detail: str = ""
    metric: float | None = None
    base_metric: float | None = None
    metric_name: str | None = None


def canary_result(device: str, status: dict | None, rollout: Rollout) -> CanaryResult:
    """``device``'s answer to ``rollout``; installed carries the new and the replaced version's score."""
    answer = answer_of(device, status, rollout.model, rollout.version)
    if answer.state != INSTALLED:
        return CanaryResult(device, answer.state, answer.detail)
    entry = status["models"][rollout.model]  # answer_of found the version active there
    metric, base = _number(entry.get("metric")), None
    if entry.get("previous") == rollout.base_version:
        base = _number(entry.get("previous_metric"))
    name = entry.get("metric_name") if isinstance(entry.get("metric_name"), str) else None
    return CanaryResult(device, INSTALLED, "", metric, base, name)


def _number(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def decide(
    results: list[CanaryResult], *, min_installed: float, margin: float, base_version: int, final: bool
) -> tuple[Verdict, str]:
    """Go on, stop, or wait for more answers; with the reason.

    Stops at once when an installed canary's holdout is below the replaced version's by
    more than ``margin``, or when too many refused for ``min_installed`` to be reached;
    promotes once every canary answered (or, ``final``, at the deadline) with enough
    installed; otherwise waits.
    """
    n = len(results)
    for r in results:
        worse = r.metric is not None and r.base_metric is not None and r.metric < r.base_metric - margin
        if r.state == INSTALLED and worse:
            return Verdict.STOP, (
                f"{r.device}: holdout {r.metric_name} {r.metric:.4f} is below v{base_version}'s "
                f"{r.base_metric:.4f} by more than the margin {margin:g}"
            )
    installed = sum(r.state == INSTALLED for r in results)
    pending = sum(r.state == PENDING for r in results)
    refused = [r for r in results if r.state == REFUSED]
    share = f"{installed} of {n} canaries installed it (at least {min_installed:.0%} must)"
    if (installed + pending) / n < min_installed:
        why = "; ".join(f"{r.device}: {r.detail}" for r in refused)
        return Verdict.STOP, share + (f"; refused by {why}" if why else "")
    if installed / n >= min_installed and (pending == 0 or final):
        return Verdict.PROMOTE, share + ", none scores it worse than the margin allows"
    return Verdict.WAIT, share + f"; {pending} not answered yet"


def parse_canary(spec: str) -> tuple[int | None, float | None]:
    """``--canary``: a count (``"2"``) or a share of the targeted devices (``"20%"``).

    Raises
    ------
    RolloutError
        If it is neither a positive int nor a percentage in (0, 100).
    """
    text = spec.strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 < pct < 100:
                raise ValueError
            return None, pct
        count = int(text)
        if count < 1:
            raise ValueError
        return count, None
    except ValueError:
        raise RolloutError(f"--canary {spec!r}: give a device count (2) or a share (20%)") from None


def pick_canaries(spec: str, devices: list[str]) -> tuple[str, ...]:
    """The first devices of ``devices`` by id: ``spec``'s count, or its share rounded up.

    Raises
    ------
    RolloutError
        When the canaries would be the whole of ``devices`` (nothing left to stage).
    """
    count, pct = parse_canary(spec)
    ordered = sorted(devices)
    n = count if count is not None else math.ceil(len(ordered) * float(pct or 0) / 100)
    if n >= len(ordered):
        raise RolloutError(
            f"--canary {spec} takes {n} of the {len(ordered)} online devices running the current version "
            f"({', '.join(ordered) or 'none'}): nothing left to stage; use a smaller canary or push without --canary"
        )
    return tuple(ordered[:n])


def describe(r: Rollout) -> str:
    """One paragraph for ``rollout status``: state, canaries and their answers, the reason."""
    lines = [
        f"{r.model} v{r.version} (replacing v{r.base_version}): {r.state}"
        + (
            f", decided {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(r.decided_at))} UTC"
            if r.decided_at
            else ""
        )
    ]
    rest = ", ".join(r.targets) if r.targets else "the whole fleet"
    lines.append(f"  canaries: {', '.join(r.canaries)}; then: {rest}")
    lines.append(f"  checks: at least {r.min_installed:.0%} installed, holdout within {r.margin:g}")
    for device in r.canaries:
        res = r.results.get(device)
        lines.append(f"  {device}: {_result_text(res) if res else 'no answer yet'}")
    if r.reason:
        lines.append(f"  reason: {r.reason}")
    return "\n".join(lines)


def _result_text(res: dict[str, Any]) -> str:
    text = res.get("state", "?")
    if res.get("metric") is not None:
        base = res.get("base_metric")
        text += f" ({res.get('metric_name')} {res['metric']:.4f}" + (
            f", was {base:.4f})" if base is not None else ")"
        )
    if res.get("rolled_back"):
        text += ", rolled back"
    if res.get("detail"):
        text += f" ({res['detail']})"
    return text
