"""Buffered asynchronous rounds (FedBuff) over MQTT: ``[[task]] mode = "buffered"`` under ``serve``.

The algorithm is :class:`cloud_aggregator.rounds.buffered.BufferedServer` (the simulator's, unchanged):
every admitted upload goes into the buffer with its staleness weight, and every ``k`` of them
move the global.  This module is only its transport:

* the current global is announced retained on the task's downlink with ``mode = "buffered"``
  and ``round = version + 1``; a device trains from the newest one it has, uploads quoting
  its hash and a round of its own (``edge.buffered``), and starts again;
* each uplink is decoded once (size first) and handed to :meth:`BufferedServer.take`, which
  recovers the job from the hash and round and runs the one admission pipeline
  (``cloud_aggregator.rounds.admission``) against it -- a refusal is counted per device and reason,
  logged and stored, as in a synchronous round;
* every application of the buffer is a :class:`~cloud_aggregator.rounds.engine.RoundRecord` (round =
  the new version) saved with the new global as the resume point, so ``fleet status``, the
  console and the metrics see it and a restarted aggregator goes on from the stored version
  (the partial buffer, fewer than ``k`` uploads, is lost; devices keep training).

Uploads more than ``max_staleness`` versions old are refused (``stale_round``); the globals of
the last ``max_staleness + 1`` versions are kept in memory to judge the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cloud_aggregator.aggregation.fedbuff import Arrival, BufferConfig
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy
from cloud_aggregator.rounds.buffered import BufferedServer
from cloud_aggregator.rounds.ingest import ROUTINE_REFUSALS
from cloud_aggregator.rounds.types import Reason, Refusal, RoundRecord
from cloud_aggregator.serve.mqtt_fleet import MqttFleet
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import codec, topics
from ioft_protocol.round_messages import UpdateMessage
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)

#: Seconds a buffered announcement's deadline lies ahead (informational: nothing closes on it).
HORIZON_S = 86_400.0


class BufferedTask:
    """One buffered task's run over an :class:`MqttFleet`, recorded in ``store``.

    Parameters
    ----------
    spec
        The task; ``spec.rounds`` is the number of buffer applications (server updates).
    config
        ``k``, ``server_lr``, ``staleness`` and ``max_staleness`` (required here).
    fleet, store
        The fleet's MQTT side and the aggregator's store.
    admission
        Bounds of the admission pipeline's norm check.
    on_record
        Called with each application's record once it is stored.
    """

    def __init__(
        self,
        spec: TaskSpec,
        config: BufferConfig,
        fleet: MqttFleet,
        store: SqliteStore,
        *,
        admission: AdmissionPolicy | None = None,
        on_record: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        if config.max_staleness is None:
            raise ValueError("a buffered task over MQTT needs max_staleness (the globals it keeps)")
        self.spec, self.fleet, self.store, self.on_record = spec, fleet, store, on_record
        pipeline = Admission(
            fleet.fleet,
            admission,
            max_payload_bytes=fleet.admission.max_payload_bytes,
            reported_rows=fleet.admission.reported_rows,
            statuses=fleet.admission.statuses,
        )
        pipeline.refused = fleet.admission.refused  # one per-device count of refusals for the fleet's view
        self.server = BufferedServer(
            spec, config, fleet=fleet.fleet, admission=pipeline, keep_recent=config.max_staleness + 1
        )
        self._reset(time.time())

    def _reset(self, started: float) -> None:
        """Start the record of the next application."""
        self._started = started
        self._arrivals: list[tuple[str, int, float]] = []  # (device, staleness, weight) in order
        self._n_samples: dict[str, int] = {}
        self._metrics: dict[str, dict[str, float]] = {}
        self._rejected: dict[str, str] = {}

    def run(self) -> Params:
        """Apply the buffer until ``spec.rounds`` versions exist (resuming a stored run); the final global."""
        self._resume()
        self._announce()
        name = self.spec.name
        while self.server.version < self.spec.rounds:
            msg = self.fleet.next_message(name, 0.5)
            if msg is None:
                continue
            try:
                where = topics.parse_topic(msg.topic)
            except codec.WireError:
                continue
            if where.kind == "up" and where.task == name and where.fleet == self.fleet.fleet:
                self.upload(where.device, msg.payload)
            else:
                self.fleet.handle(msg, None)  # statuses keep the fleet's view current
        return self.server.global_params

    def _resume(self) -> None:
        point = self.store.resume_point(self.spec.name)
        if point is None:
            return
        round_, _, global_params, state = point
        self.server.strategy.load_state(state)
        recent: dict[int, Params] = {}
        keep = self.server.keep_recent
        for rec in self.store.rounds(self.spec.name)[-keep:]:
            try:
                recent[rec.round] = self.store.get_params(rec.global_hash)
            except (OSError, ValueError) as exc:
                log.warning(
                    "task %s: version %d's global is not readable: %s", self.spec.name, rec.round, exc
                )
        self.server.resume(round_ - 1, global_params, recent)
        log.info("task %s resumes buffered at version %d", self.spec.name, round_ - 1)

    def _announce(self) -> None:
        version, params, digest = self.server.current()
        request = self.server.request(version + 1, params, digest)
        self.fleet.announce(request, time.time() + HORIZON_S, mode="buffered")

    def upload(self, device: str, payload: bytes) -> Arrival | Refusal:
        """Judge one uplink of ``device``: into the buffer, or refused with a reason (counted, logged, stored).

        A payload that does not decode, or a device outside the task's selection, is refused
        here; every other step is :meth:`BufferedServer.take` and the admission pipeline.
        """
        try:
            msg = UpdateMessage.decode(payload, max_bytes=self.fleet.admission.max_payload_bytes)
        except codec.WireError as exc:
            return self._refuse(device, Refusal(Reason.MALFORMED, str(exc)), None, counted=False)
        why = self.fleet.view.outside(device, self.fleet.selections.get(self.spec.name))
        if why is not None:
            return self._refuse(device, Refusal(Reason.NOT_SELECTED, why), msg.round, counted=False)
        verdict = self.server.take(device, msg)
        if isinstance(verdict, Refusal):
            return self._refuse(device, verdict, msg.round, counted=True)
        self._arrivals.append((device, verdict.staleness, verdict.weight))
        self._n_samples[device] = msg.n_samples
        self._metrics[device] = dict(msg.metrics)
        if verdict.applied:
            self._record(verdict)
        return verdict

    def _refuse(self, device: str, refusal: Refusal, round_: int | None, *, counted: bool) -> Refusal:
        """Count (unless the pipeline did), log and store a refused upload."""
        if not counted:
            self.server.admission.count_refusal(device, refusal.reason)
        level = logging.INFO if refusal.reason in ROUTINE_REFUSALS else logging.WARNING
        log.log(level, "task %s: dropped update from %s: %s", self.spec.name, device, refusal)
        self.store.put_rejection(self.spec.name, round_, device, refusal.reason, refusal.detail)
        self._rejected[device] = str(refusal)
        return refusal

    def _record(self, arrival: Arrival) -> None:
        """Store the application that made version ``arrival.version`` and announce it."""
        server, now = self.server, time.time()
        _, new, digest = server.current()  # hashed once: _announce sends the same
        record = RoundRecord(
            task=self.spec.name,
            round=arrival.version,
            phase=server.phase,
            status="completed",
            participants=sorted(self._n_samples),
            n_samples=dict(self._n_samples),
            metrics=dict(self._metrics),
            rejected=dict(self._rejected),
            global_hash=digest,
            started=self._started,
            finished=now,
            extra={
                "mode": "buffered",
                "arrivals": [[d, tau, round(w, 6)] for d, tau, w in self._arrivals],
                "ledger": dict(server.ledger()),
            },
        )
        self.store.save(record, (arrival.version + 1, 0), new, server.strategy.state())
        self._reset(now)
        self._announce()
        if self.on_record is not None:
            self.on_record(record)
