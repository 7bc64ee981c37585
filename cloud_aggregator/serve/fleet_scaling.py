"""The aggregator's side of a task's ``scaling = "fleet"``: pool the devices' feature sums once.

Each device of such a task sends ``(n, Σx, Σx²)`` over its training rows
(:class:`ioft_protocol.feature_stats.FeatureStats`) when it first sees the task's round.  Once
statistics of at least ``scaling_min_devices`` devices (never fewer than
:data:`~trainer_lite.algorithms.base.MIN_POOL_DEVICES`) are in, they are pooled
(:func:`sensors.features.scaling.pool_feature_sums`) and the transform is published, retained, on
``task/<task>/scaling``; it is frozen from then on, so every device trains and serves through the
same one, and a device that joins later takes the retained copy.  Statistics of a device the task
does not select, held out, of another width, or after the transform went out are refused with a
log line that says why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from ioft_protocol import codec, topics
from ioft_protocol.feature_stats import FeatureStats, FleetScaling
from sensors.features.scaling import pool_feature_sums
from trainer_lite.algorithms.base import MIN_POOL_DEVICES
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


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
    not contribute to ``task`` (not selected, held out) or ``None``.
    """

    def __init__(
        self,
        fleet: str,
        publish: Callable[[str, bytes], None],
        refusal: Callable[[str, str], str | None],
    ) -> None:
        self.fleet = fleet
        self._publish = publish
        self._refusal = refusal
        self._lock = threading.Lock()  # any collecting thread may hold the pump
        self._need: dict[str, int] = {}  # task -> devices to pool, for tasks with scaling = "fleet"
        self._sums: dict[str, dict[str, tuple[int, np.ndarray, np.ndarray]]] = {}
        #: task -> the transform published (frozen)
        self.published: dict[str, FleetScaling] = {}
        #: task -> device -> why its statistics were refused (the last reason)
        self.refused: dict[str, dict[str, str]] = {}

    def task(self, spec: TaskSpec) -> None:
        """A task was announced: note whether it pools statistics, and how many."""
        need = min_devices(spec)
        with self._lock:
            if need is None:
                self._need.pop(spec.name, None)
            else:
                self._need[spec.name] = need

    def republish(self) -> None:
        """After a (re)connect: the transforms again, retained (a restarted broker lost them)."""
        for pooled in list(self.published.values()):
            self._publish(topics.topic_scaling(self.fleet, pooled.task), pooled.encode())

    def handle(self, task: str, device: str, payload: bytes) -> None:
        """One device's statistics: kept, or refused with a log line; pooled once enough are in."""
        with self._lock:
            why = self._check(task, device, payload)
            if why is not None:
                self.refused.setdefault(task, {})[device] = why
                log.warning("task %s: refused feature statistics from %s: %s", task, device, why)
                return
            need = self._need[task]
            have = self._sums[task]
            log.info("task %s: feature statistics from %s (%d of %d devices)", task, device, len(have), need)
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
        if task in self.published:
            return "the fleet's transform is published already (frozen: the device takes the retained one)"
        why = self._refusal(task, device)
        if why is not None:
            return why
        try:
            stats = FeatureStats.decode(payload)
        except codec.WireError as exc:
            return str(exc)
        if (stats.task, stats.device) != (task, device):
            return f"statistics of {stats.device}/{stats.task} on the topic of {device}/{task}"
        have = self._sums.setdefault(task, {})
        widths = {len(s[1]) for d, s in have.items() if d != device}
        if widths and len(stats.sum) not in widths:
            return f"{len(stats.sum)} features per row; the other devices' have {widths.pop()}"
        have[device] = (stats.n, stats.sum, stats.sumsq)  # a resend replaces the earlier
        return None
