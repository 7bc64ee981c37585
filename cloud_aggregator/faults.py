"""Fault injection for crash-safety tests: the aggregator dies (or freezes) at a named point.

``IOFT_FAULT="<point>:<n>[:<action>][,<point>:<n>[:<action>]...]"`` makes the ``n``-th
pass through ``point`` (counted from this process's start) send this process
``SIGKILL`` (action ``kill``, the default: a crash, no clean-up runs) or ``SIGSTOP``
(action ``stop``: frozen until a test sends ``SIGCONT``, so it can act on the fleet
at an exact step of the round instead of guessing with sleeps).

Unset, ``point()`` is one global lookup and a return: the hooks stay in production code.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)
ENV = "IOFT_FAULT"

#: Where the aggregator calls ``point``; anything else in ``IOFT_FAULT`` is a typo.
POINTS = {
    "after_announce": "a round was announced (retained), before any upload is read",
    "after_store_update": "an upload was committed to SQLite (one pass per upload of a batch), before it is counted in memory",
    "before_aggregate": "uploads were collected and validated, before the strategy runs",
    "after_aggregate": "new global computed in memory, nothing of it written yet",
    "after_artifact": "new global's artifact file written, its transaction not begun",
    "before_commit": "round record and resume point written inside the open transaction",
    "after_save": "round committed, next round not yet announced",
}
#: Where an aggregator worker (``cloud_aggregator.serve.workers``) calls ``point``: apart, since
#: ``serve`` alone never passes them (the reliability study draws its kills from ``POINTS``).
WORKER_POINTS = {
    "worker_admitted": "an aggregator worker admitted an upload, before any batch holds it",
}
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def child_env(fault: str | None) -> dict[str, str]:
    """This process's environment for a child aggregator with ``IOFT_FAULT`` set to ``fault`` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if fault:
        env[ENV] = fault
    return env


def parse(text: str | None) -> dict[str, dict[int, str]] | None:
    """``{point: {n: action}}`` from the ``IOFT_FAULT`` syntax; ``None`` when unset or empty."""
    if not text:
        return None
    plan: dict[str, dict[int, str]] = {}
    for item in text.split(","):
        parts = item.strip().split(":")
        known = parts[0] in POINTS or parts[0] in WORKER_POINTS
        if len(parts) not in (2, 3) or not known or not parts[1].isdigit() or int(parts[1]) < 1:
            raise ValueError(
                f"{ENV}={text!r}: each item must be <point>:<n>[:kill|stop] with n >= 1; "
                f"points: {sorted(POINTS)}; a worker's: {sorted(WORKER_POINTS)}"
            )
        action = parts[2] if len(parts) == 3 else "kill"
        if action not in ACTIONS:
            raise ValueError(f"{ENV}={text!r}: action {action!r}; choose one of {sorted(ACTIONS)}")
        plan.setdefault(parts[0], {})[int(parts[1])] = action
    return plan


_PLAN = parse(os.environ.get(ENV))
_PASSES: dict[str, int] = {}


def point(name: str, passes: int = 1) -> None:
    """Mark a crash point, passed ``passes`` times in a row (e.g. once per upload of a batch);
    acts only when ``IOFT_FAULT`` names it (see the module docstring)."""
    if _PLAN is None:
        return
    for _ in range(passes):
        _hit(name)


def armed(name: str) -> bool:
    """Whether ``IOFT_FAULT`` acts at ``name`` (a caller that batches passes may then take them one by one)."""
    return _PLAN is not None and name in _PLAN


def _hit(name: str) -> None:
    at = _PLAN.get(name) if _PLAN else None
    if at is None:
        return
    _PASSES[name] = n = _PASSES.get(name, 0) + 1
    action = at.get(n)
    if action is not None:
        log.warning("%s: %s at %s (pass %d)", ENV, action, name, n)  # the log shows where it died
        # To this thread, not the process: a process-directed SIGSTOP is taken by the main thread
        # whenever it next runs, and until then (seconds on a busy machine) this one went on
        # past the point -- announcing the next round while a test acted on "stopped after round 2".
        signal.pthread_kill(threading.get_ident(), ACTIONS[action])
