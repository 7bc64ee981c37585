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
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from cloud_aggregator.aggregation.strategies import Update, make_strategy
from cloud_aggregator.rounds.engine import CollectRequest, Rejection
from cloud_aggregator.serve.mqtt_fleet import MqttFleet
from ioft_protocol import codec, topics
from ioft_protocol.mqtt import Message
from ioft_protocol.secagg import Abandoned, SecAggConfig, SecAggResult, ServerSecAgg
from ioft_protocol.secagg.messages import SecAggWireError
from ioft_protocol.secagg.server import StageError
from ioft_protocol.secagg.simulate import run_round
from ioft_protocol.secagg.transport import (
    ANSWERS,
    Envelope,
    change,
    device_weight,
    flatten,
    parse_topic,
    topic_down,
    topic_up_all,
    unflatten,
)
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)
DROPPED = "secagg_dropped"
ABANDONED = "secagg_abandoned"


def secagg_config(spec: TaskSpec) -> SecAggConfig | None:
    """The task's SecAgg settings, or ``None`` when it has none."""
    return None if spec.secagg is None else SecAggConfig.from_json(spec.secagg)


def check_secagg_task(spec: TaskSpec) -> None:
    """Refuse, naming what to change, a SecAgg task whose server is not a plain weighted mean."""
    if secagg_config(spec) is None:
        return
    strategy = make_strategy(spec)
    server = dict(spec.server)
    if strategy.name != "fedavg":
        raise ValueError(
            f"task {spec.name!r}: secagg needs a mean-family algorithm (server 'fedavg'); "
            f"{spec.algorithm!r} aggregates with {strategy.name!r}"
        )
    if server.get("reducer", "mean") != "mean":
        raise ValueError(
            f"task {spec.name!r}: secagg sums updates, so server.reducer must be 'mean' (or unset)"
        )
    if server.get("weighting", "samples") not in ("samples", "uniform"):
        raise ValueError(f"task {spec.name!r}: secagg supports server.weighting 'samples' or 'uniform'")
    dp = spec.dp or {}
    if dp and (dp.get("mode") != "distributed" or server.get("weighting", "samples") != "uniform"):
        # the aggregator sees no single change to clip or weigh: only devices can add the noise
        raise ValueError(
            f"task {spec.name!r}: secagg with dp needs dp mode 'distributed' and server.weighting 'uniform'"
        )


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
        length = sum(int(v.size) for v in request.global_params.values())
        session = f"{task}-{request.round}-{request.phase}-{secrets.token_hex(4)}"
        server = ServerSecAgg(cfg, devices, session=session, length=length, certificates=self.certificates)
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


def replies_from(
    request: CollectRequest, ready: Mapping[str, Update], outcome: SecAggResult | Abandoned
) -> list[Update | Rejection]:
    """What the round engine gets: each survivor carrying the new global, a rejection for the others."""
    task, round_ = request.spec.name, request.round
    if isinstance(outcome, Abandoned):
        log.warning(
            "task %s round %d: SecAgg abandoned (%s): %s", task, round_, outcome.reason, outcome.detail
        )
        return [Rejection(d, f"{ABANDONED}: {outcome.reason}") for d in sorted(ready)]
    log.info(
        "task %s round %d: SecAgg sum of %d; ledger %s", task, round_, len(outcome.survivors), outcome.ledger
    )
    new = apply_mean(request.global_params, outcome)
    kept: list[Update | Rejection] = [replace(ready[d], params=new) for d in outcome.survivors]
    return kept + [Rejection(d, DROPPED) for d in sorted(set(ready) - set(outcome.survivors))]


def collect_in_process(request: CollectRequest, replies: Sequence[Any]) -> list[Any]:
    """The in-process simulator's SecAgg round: the same state machines and wire form, no broker.

    ``replies`` are admitted uploads with parameters (a simulated device has them at hand); each
    becomes its change from the global, masked and summed exactly as over MQTT.
    """
    cfg = secagg_config(request.spec)
    ready = {r.device: r for r in replies if isinstance(r, Update)}
    others = [r for r in replies if not isinstance(r, Update)]
    if cfg is None or not ready:
        return list(replies)
    run = run_round(
        cfg,
        {d: change(u.params, request.global_params) for d, u in ready.items()},
        {d: device_weight(request.spec.server, u.n_samples) for d, u in ready.items()},
        session=f"{request.spec.name}-{request.round}-{request.phase}",
        keep_view=False,
    )
    return others + replies_from(request, ready, run.outcome)


def apply_mean(global_params: Params, outcome: SecAggResult) -> Params:
    """The new global: the old one plus the survivors' weighted mean change."""
    return unflatten(flatten(global_params) + outcome.mean(), global_params)
