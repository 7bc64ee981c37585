"""The aggregator's side of a task's ``scaling = "fleet"``: pool the devices' feature sums once.

Each device of such a task sends ``(n, Σx, Σx²)`` over its training rows
(:class:`ioft_protocol.feature_stats.FeatureStats`) when it first sees the task's round.  Once
statistics of at least ``scaling_min_devices`` devices (never fewer than
:data:`~trainer_lite.algorithms.base.MIN_POOL_DEVICES`) are in, they are pooled
(:func:`sensors.features.scaling.pool_feature_sums`) and the transform is published, retained, on
``task/<task>/scaling``; it is frozen from then on, so every device trains and serves through the
same one, and a device that joins later takes the retained copy.

One device cannot steer the others' transform.  The task's model, not the first device, fixes
the width (a model that does not say pools the width most devices sent).  A device's row count
is capped at the training rows its status reports (its sums scaled down alike: the same mean and
deviation, less weight), and statistics the pool cannot use are refused: a device the task does
not select or holds out, another width, more than the task's ``max_samples`` rows, sums that
overflow or imply a negative variance (``sensors.features.scaling.sums_refusal``), or any after
the transform went out.  The pool clips every device toward the median device
(``pool_feature_sums``).  Refusals are logged one line per device, task and reason at most every
:data:`SAY_EVERY_S` seconds, with how many went unsaid; none of them ever stops a round.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from ioft_protocol import codec, topics
from ioft_protocol.feature_stats import FeatureStats, FleetScaling
from sensors.features.scaling import MAX_STATS_ROWS, pool_feature_sums, sums_refusal
from trainer_lite.algorithms import make_client
from trainer_lite.algorithms.base import MIN_POOL_DEVICES
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)

#: A device's refused statistics are logged at most once per this many seconds (per task): a
#: device resending them in a loop must not fill the log.
SAY_EVERY_S = 60.0


def input_width(spec: TaskSpec) -> int | None:
    """Features per row ``spec``'s model takes (``None``: the model does not say, or cannot be built)."""
    try:
        return make_client(spec).input_width()
    except (ValueError, TypeError, KeyError):  # a task that cannot build here fails its own round
        return None


def min_devices(spec: TaskSpec) -> int | None:
    """How many devices' statistics ``spec``'s fleet scaling pools; ``None``: it scales otherwise."""
    if spec.hparams.get("scaling") != "fleet":
        return None
    value = spec.hparams.get("scaling_min_devices", MIN_POOL_DEVICES)
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_POOL_DEVICES:
        raise ValueError(f"task {spec.name}: scaling_min_devices={value!r}: an integer >= {MIN_POOL_DEVICES}")
    return value


class ScalingPool:
    """Per task: the statistics received, and the transform once published.

    ``publish(topic, payload)`` sends retained; ``refusal(task, device)`` says why a device may
    not contribute to ``task`` (not selected, held out) or ``None``; ``reported_rows(device)`` the
    training rows its status reports (``None``: unknown); ``max_rows(task)`` the most rows one
    device's statistics may count (the task's ``max_samples``).
    """

    def __init__(
        self,
        fleet: str,
        publish: Callable[[str, bytes], None],
        refusal: Callable[[str, str], str | None],
        reported_rows: Callable[[str], int | None] = lambda device: None,
        max_rows: Callable[[str], int] = lambda task: MAX_STATS_ROWS,
    ) -> None:
        self.fleet = fleet
        self._publish = publish
        self._refusal = refusal
        self._reported_rows = reported_rows
        self._max_rows = max_rows
        self._lock = threading.Lock()  # any collecting thread may hold the pump
        self._need: dict[str, int] = {}  # task -> devices to pool, for tasks with scaling = "fleet"
        #: task -> (its spec, features per row its model takes)
        self._width: dict[str, tuple[str | None, int | None]] = {}
        #: (task, device, reason) -> (when last said, how many refusals since went unsaid)
        self._said: dict[tuple[str, str, str], tuple[float, int]] = {}
        self._sums: dict[str, dict[str, tuple[int, np.ndarray, np.ndarray]]] = {}
        #: task -> the transform published (frozen)
        self.published: dict[str, FleetScaling] = {}
        #: task -> device -> why its statistics were refused (the last reason)
        self.refused: dict[str, dict[str, str]] = {}

    def task(self, spec: TaskSpec) -> None:
        """A task was announced: note whether it pools statistics, and how many."""
        need = min_devices(spec)
        known = self._width.get(spec.name, (None, None))
        # Every round announces the task again: its model is built once per spec, not per round.
        width = known[1] if known[0] == spec.to_json() else input_width(spec)
        with self._lock:
            if need is None:
                self._need.pop(spec.name, None)
            else:
                self._need[spec.name] = need
                self._width[spec.name] = (spec.to_json(), width)

    def republish(self) -> None:
        """After a (re)connect: the transforms again, retained (a restarted broker lost them)."""
        for pooled in list(self.published.values()):
            self._publish(topics.topic_scaling(self.fleet, pooled.task), pooled.encode())

    def handle(self, task: str, device: str, payload: bytes) -> None:
        """One device's statistics: kept, or refused with a log line; pooled once enough are in."""
        with self._lock:
            resent = device in self._sums.get(task, {})
            why = self._check(task, device, payload)
            if why is not None:
                self.refused.setdefault(task, {})[device] = why
                self._say(task, device, why)
                return
            need = self._need[task]
            have = self._poolable(task)
            if not resent:  # a device resending its sums in a loop is not a line per message
                log.info(
                    "task %s: feature statistics from %s (%d of %d devices)", task, device, len(have), need
                )
            if len(have) < need:
                return
            scaler = pool_feature_sums(have, need)
            pooled = FleetScaling(
                task, tuple(sorted(have)), sum(s[0] for s in have.values()), scaler.mean, scaler.std
            )
            self.published[task] = pooled
        self._publish(topics.topic_scaling(self.fleet, task), pooled.encode())
        log.info(
            "task %s: fleet scaling published, pooled from %d devices (%s; %d rows)",
            task,
            len(pooled.devices),
            ", ".join(pooled.devices),
            pooled.rows,
        )

    def _check(self, task: str, device: str, payload: bytes) -> str | None:
        """Why these statistics are refused; ``None``: kept in ``self._sums``."""
        if task not in self._need:
            return "the task does not scale with fleet statistics (or is not announced here)"
        why = self._refusal(task, device)
        if why is not None:
            return why
        # Malformed statistics are named as such whether or not the transform is frozen yet: the
        # operator learns of a broken (or lying) device however late its statistics come.
        try:
            stats = FeatureStats.decode(payload)
        except codec.WireError as exc:
            return str(exc)
        if (stats.task, stats.device) != (task, device):
            return f"statistics of {stats.device}/{stats.task} on the topic of {device}/{task}"
        bad = sums_refusal(
            stats.n, stats.sum, stats.sumsq, width=self._width[task][1], max_rows=self._max_rows(task)
        )
        if bad is not None:
            return bad
        if task in self.published:
            return "the fleet's transform is published already (frozen: the device takes the retained one)"
        n, total, sumsq = stats.n, stats.sum, stats.sumsq
        rows = self._reported_rows(device)
        if rows is not None and n > rows:
            if rows < 1:
                return f"n = {n} rows, but the device's status reports no training rows"
            # More rows than the device says it trains on: the same moments, the weight it reported.
            n, total, sumsq = rows, total * (rows / n), sumsq * (rows / n)
        self._sums.setdefault(task, {})[device] = (n, total, sumsq)  # a resend replaces the earlier
        return None

    def _poolable(self, task: str) -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
        """The statistics to pool: all (their width was checked against the model's), or, where the
        model does not say its width, those of the width most devices sent."""
        have = self._sums.get(task, {})
        if self._width[task][1] is not None or not have:
            return have
        counts = Counter(len(s[1]) for s in have.values())
        width = min(counts, key=lambda w: (-counts[w], w))
        return {d: s for d, s in have.items() if len(s[1]) == width}

    def _say(self, task: str, device: str, why: str) -> None:
        """One warning line per device, task and reason at most every :data:`SAY_EVERY_S` seconds."""
        now = time.monotonic()
        key = (task, device, re.sub(r"\d[\d.e+-]*", "#", why))  # numbers varied in a loop: one reason
        last, unsaid = self._said.get(key, (-SAY_EVERY_S, 0))
        if now - last < SAY_EVERY_S:
            self._said[key] = (last, unsaid + 1)
            return
        self._said[key] = (now, 0)
        more = f" ({unsaid} more refused since the last line)" if unsaid else ""
        log.warning("task %s: refused feature statistics from %s: %s%s", task, device, why, more)
