"""A SecAgg round over MQTT: the aggregator learns the survivors' mean update and nothing else.

:class:`SecAggFleet` wraps the MQTT fleet.  A task without ``secagg`` is collected as
always.  For one with it:

1. the round is announced and collected as always, except that uploads carry no
   parameters (a device's answer says it trained, with its sample count and metrics);
2. the devices that answered run the four SecAgg stages (``ioft_protocol.secagg``) on
   their per-device topics, each stage closing when every device still in it answered or
   its deadline (``stage_deadline_s``) passed; a device whose status goes offline is not
   waited for;
3. the unmasked weighted mean of the survivors' clipped changes is added to the global,
   and each survivor is handed to the strategy as an ``Update`` carrying that new global
   (the weighted mean of identical parameters is those parameters), so the round engine
   and the mean-family strategies run unchanged and the record lists the survivors.

A device that trained but did not survive the SecAgg stages is a ``Rejection`` with
reason ``secagg_dropped``; an abandoned SecAgg round rejects every device with
``secagg_abandoned: <reason>`` and the round engine abandons the round (too few valid
uploads), leaving the global as it was.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.secagg import replies_from, ring_codes, ring_length
from cloud_aggregator.rounds.task_rules import secagg_config
from cloud_aggregator.rounds.types import CollectRequest
from cloud_aggregator.serve.mqtt_fleet import MqttFleet
from ioft_protocol import codec, topics
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.secagg import Abandoned, SecAggConfig, SecAggResult, ServerSecAgg
from ioft_protocol.secagg.messages import SecAggWireError
from ioft_protocol.secagg.server import StageError
from ioft_protocol.secagg.transport import (
    ANSWERS,
    Envelope,
    parse_topic,
    topic_down,
    topic_up_all,
)

log = logging.getLogger(__name__)


class SecAggFleet:
    """The MQTT fleet, with SecAgg rounds for the tasks that ask for them (see the module docstring)."""

    def __init__(
        self, inner: MqttFleet, *, stage_deadline_s: float = 15.0, certificates: bool = False
    ) -> None:
        self.inner = inner
        self.stage_deadline_s = stage_deadline_s
        #: the fleet logs in with certificates: a task's unset ``signed_keys`` means true
        self.certificates = certificates
        self.outcomes: list[tuple[str, int, SecAggResult | Abandoned]] = []  # (task, round, outcome)
        inner.session.subscribe(topic_up_all(inner.fleet))

    def __getattr__(self, name: str) -> Any:  # announce, finish, view, selections ... of the MQTT fleet
        return getattr(self.inner, name)

    def collect(self, request: CollectRequest) -> Sequence[Any]:
        cfg = secagg_config(request.spec)
        if cfg is None:
            return self.inner.collect(request)
        # the uploads carry no parameters: admission checks everything else as usual
        replies = self.inner.collect(replace(request, expected={}, expected_by_device={}))
        ready = {r.device: r for r in replies if isinstance(r, Update)}
        others = [r for r in replies if not isinstance(r, Update)]
        if not ready:
            return others
        outcome = self.run_secagg(request, cfg, sorted(ready))
        self.outcomes.append((request.spec.name, request.round, outcome))
        return others + replies_from(request, ready, outcome)

    # -- the four stages over MQTT ----------------------------------------------------------------
    def run_secagg(
        self, request: CollectRequest, cfg: SecAggConfig, devices: list[str]
    ) -> SecAggResult | Abandoned:
        task = request.spec.name
        session = f"{task}-{request.round}-{request.phase}-{secrets.token_hex(4)}"
        server = ServerSecAgg(
            cfg,
            devices,
            session=session,
            length=ring_length(request),
            certificates=self.certificates,
            codes=ring_codes(request),
        )
        receive = {
            "setup": server.receive_keys,
            "neighbour_keys": server.receive_shares,
            "inbox": server.receive_masked,
            "unmask": server.receive_unmask,
        }
        requests: dict[str, Any] = server.setup()
        if server.outcome is not None:  # too few devices ready: nothing is sent
            return server.outcome
        for stage, close in (
            ("setup", server.close_keys),
            ("neighbour_keys", server.close_shares),
            ("inbox", server.close_masked),
            ("unmask", None),
        ):
            for device, msg in requests.items():
                env = Envelope(session, request.round, request.phase, stage, msg.encode())
                self.inner.session.publish(
                    topic_down(self.inner.fleet, task, device), env.encode(), timeout=None
                )
            self._gather(task, session, stage, set(requests), receive[stage])
            if close is None:
                break
            requests = close()
            if server.outcome is not None:
                return server.outcome
        return server.close_unmask()

    def _gather(self, task: str, session: str, stage: str, waiting: set[str], receive: Any) -> None:
        """Feed the stage's answers to the server until everyone answered, went offline, or the deadline."""
        deadline = time.monotonic() + self.stage_deadline_s
        while waiting and time.monotonic() < deadline:
            msg = self.inner.next_message(task, min(0.2, max(0.0, deadline - time.monotonic())))
            if msg is not None:
                self._take(msg, task, session, stage, waiting, receive)
            online = self.inner.view.online
            gone = {d for d in waiting if online.get(d) is False}
            if gone:
                log.info("task %s SecAgg %s: %s went offline", task, stage, sorted(gone))
                waiting -= gone

    def _take(
        self, msg: Message, task: str, session: str, stage: str, waiting: set[str], receive: Any
    ) -> None:
        where = parse_topic(msg.topic)
        if where is None:
            try:
                if topics.parse_topic(msg.topic).kind == "status":
                    self.inner.handle(msg, None)  # keeps the fleet view (who went offline)
            except codec.WireError:
                pass
            return
        if where.direction != "up" or where.task != task or where.fleet != self.inner.fleet:
            return
        try:
            env = Envelope.decode(msg.payload)
            if env.session != session or env.stage != stage:
                log.info(
                    "task %s: SecAgg %s from %s for another session or stage; dropped",
                    task,
                    env.stage,
                    where.device,
                )
                return
            receive(where.device, env.open(ANSWERS))
        except (SecAggWireError, StageError) as exc:
            log.warning("task %s: SecAgg %s from %s dropped: %s", task, stage, where.device, exc)
            return
        waiting.discard(where.device)
