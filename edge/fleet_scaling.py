"""A ``scaling = "fleet"`` task on the device: its feature statistics up, the pooled transform down.

Until the aggregator's pooled transform for a task is here, the device sends its ``(n, Σx, Σx²)``
once per announced round (:meth:`FleetStats.send`) and answers no round; when the transform comes
(:meth:`FleetStats.take`) the round that waited for it is answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edge.task_inputs import TaskInputs
from ioft_protocol import codec, feature_stats, topics
from ioft_protocol.round_messages import Announcement
from sensors.features.scaling import feature_sums
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)


class FleetStats:
    """The statistics this device sent, per task, and the pooled transforms it took (into ``inputs``).

    ``publish(topic, payload)`` sends one message (QoS 1, not retained).
    """

    def __init__(
        self, fleet: str, device: str, inputs: TaskInputs, publish: Callable[[str, bytes], None]
    ) -> None:
        self.fleet, self.device, self.inputs, self.publish = fleet, device, inputs, publish
        #: task -> the (round, phase) whose announcement this device sent its feature statistics on
        self.sent: dict[str, tuple[int, str]] = {}

    def send(self, ann: Announcement, rows: Callable[[], Dataset | None]) -> None:
        """Send this device's statistics of ``rows()`` (the task's training rows, embedded where it
        embeds; ``None`` while its encoder is not here) once per announced round."""
        if self.sent.get(ann.task) == (ann.round, ann.phase):
            return
        train = rows()
        if train is None:
            return  # waits for its encoder: the statistics are of the embedded rows
        if len(train) < feature_stats.MIN_STATS_ROWS:
            log.warning(
                "%s: task %s: %d training rows; fleet scaling takes the statistics of at least %d, "
                "so this device waits for more",
                self.device,
                ann.task,
                len(train),
                feature_stats.MIN_STATS_ROWS,
            )
            return
        n, total, sumsq = feature_sums(train.x)
        msg = feature_stats.FeatureStats(ann.task, self.device, n, total, sumsq)
        self.publish(topics.topic_stats(self.fleet, ann.task, self.device), msg.encode())
        self.sent[ann.task] = (ann.round, ann.phase)
        log.info(
            "%s: task %s: sent the feature statistics of %d rows (fleet scaling); round %d waits for "
            "the pooled transform",
            self.device,
            ann.task,
            n,
            ann.round,
        )

    def take(self, task: str, payload: bytes) -> bool:
        """The aggregator's pooled transform for ``task``: applied from now on; whether it is new
        (then the round that waited for it is answered)."""
        pooled = feature_stats.FleetScaling.decode(payload)
        if pooled.task != task:
            raise codec.WireError(f"fleet scaling for task {pooled.task} on the topic of task {task}")
        if not self.inputs.take_fleet(pooled):
            return False  # the retained copy again (a reconnect)
        log.info(
            "%s: task %s: fleet scaling pooled from %d devices (%d rows) applied to training and serving",
            self.device,
            task,
            len(pooled.devices),
            pooled.rows,
        )
        return True
