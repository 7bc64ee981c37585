"""``cloud-aggregator worker``: one of K processes that share a fleet's uplink.

Each worker joins the shared subscription ``$share/ioft-agg/ioft/v1/<fleet>/task/+/up/+``, so
the broker hands each upload to one of them.  A worker learns each round from the retained
announcement (the same message devices train on), judges every upload with the aggregator's
own :class:`~cloud_aggregator.serve.mqtt_fleet.MqttFleet` ``handle`` (selection, held-out devices and
the whole admission pipeline: not a copy), and sends what it admitted to the coordinator
(``serve``) as a :class:`~cloud_aggregator.serve.worker_wire.Batch`: the partial weighted sum of those
uploads and who they are, whenever no upload waits behind them (under a backlog every
``FLUSH_S`` or ``BATCH_MAX`` uploads), with its refusals.  The
coordinator (``cloud_aggregator.serve.coordinator``) merges batches, refuses a device counted twice,
and closes the round; it alone writes the store.  Each upload's weight is cut to the round's
``max_samples`` (the task's weight cap, announced with the round); the coordinator counts and
logs the cut from the sample counts the batch names (``cloud_aggregator.rounds.engine``).

A worker keeps the uploads of a batch until the coordinator acknowledges it: a batch holding a
device already counted (a re-send that another worker admitted) is merged nowhere, and the
worker sends the rest again.  A killed worker loses what it had not batched, and mosquitto gives
its unacknowledged uploads to no other member: the coordinator finds those devices and asks them
to re-send (``cloud_aggregator.serve.coordinator``, "Losing a worker").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from cloud_aggregator import faults, worker_login
from cloud_aggregator.aggregation.strategies import Strategy, make_strategy
from cloud_aggregator.aggregation.streaming import RoundFold
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.aggregation.weighting import capped_weight
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.rounds.admission import AdmissionPolicy, Inbox
from cloud_aggregator.rounds.types import CollectRequest, Reason, StoredRefusal, StoredUpload
from cloud_aggregator.serve import worker_wire as wire
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from ioft_protocol import codec, topics
from ioft_protocol.config import ConfigError, build, load_toml
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_inbound import Message
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.round_messages import Announcement
from ioft_protocol.service import Notifier
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)

#: A batch leaves once nothing more waits to be read, or after this long of a backlog...
FLUSH_S = 0.25
#: Seconds a worker waits for a message when it has none (then it looks at its batches).
IDLE_S = 0.01
#: ...or once it holds this many uploads.
BATCH_MAX = 256
#: A plant's batch leaves this fraction of the round's time before the cloud's deadline at the latest.
PLANT_MARGIN = 0.2
#: Seconds a supervised local worker that died waits before ``serve`` starts it again.
RESTART_S = 1.0


class _Refusals:
    """The ``RoundStore`` a worker's ``MqttFleet`` writes to: refusals wait for the next batch,
    admitted payloads are not kept (the coordinator asks a device to re-send a lost one)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int | None, str, str, str]] = []

    def put_rejection(self, task: str, round_: int | None, device: str, reason: Reason, detail: str) -> None:
        self.items.append((task, round_, device, str(reason), detail))

    def put_update(self, *args: object) -> bool:
        return True

    def put_batch(self, updates: Sequence[StoredUpload], rejections: Sequence[StoredRefusal]) -> None:
        for row in rejections:
            self.put_rejection(*row)

    def take(self) -> list[tuple[str, int | None, str, str, str]]:
        out, self.items = self.items, []
        return out


@dataclass
class _Round:
    """A task's open round as this worker knows it."""

    request: CollectRequest
    fold: RoundFold  # the strategy's fold: its per-upload weight
    deadline: float
    inbox: Inbox = field(default_factory=dict)
    pending: dict[str, Update] = field(default_factory=dict)  # admitted, in no batch yet
    changed: bool = False  # an upload was judged since the plant last looked (plant mode)
    opened: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[int, str, str]:
        return self.request.round, self.request.phase, self.request.global_hash


class AggregatorWorker:
    """One worker on ``session`` (not started yet: the worker replaces the plain uplink
    subscription ``MqttFleet`` makes with the shared one before it connects)."""

    def __init__(
        self,
        session: MqttSession,
        fleet: str,
        worker: str,
        admission: AdmissionPolicy | None = None,
        max_payload_bytes: int = codec.MAX_PAYLOAD_BYTES,
        *,
        plant: bool = False,
    ) -> None:
        self.session = session
        #: A plant's partial aggregator: one batch per round (see :meth:`_plant_due`).
        self.plant = plant
        self.id = codec.check_id("worker", worker)
        self.outbox = _Refusals()
        self.fleet = MqttFleet(
            session, fleet, CollectPolicy(max_payload_bytes=max_payload_bytes), self.outbox, admission
        )
        session.unsubscribe(topics.topic_up_all(self.fleet.fleet))
        # Re-announcing and asking the devices for their statuses on connect are the coordinator's
        # job: K workers doing it too would multiply a reconnect's status burst by K.
        session.on_connect_hooks[:] = []
        session.subscribe(wire.topic_uplinks_shared(self.fleet.fleet))
        session.subscribe(topics.topic_down_all(self.fleet.fleet))  # a worker learns each round from it
        session.subscribe(wire.topic_ctl(self.fleet.fleet))
        self.rounds: dict[str, _Round] = {}
        self._strategies: dict[str, Strategy] = {}  # by spec JSON
        self._unacked: dict[int, tuple[str, tuple[int, str, str], dict[str, Update]]] = {}
        self._seq = 0
        #: Uploads admitted and batches sent (for logs and tests).
        self.admitted = 0
        self.batches = 0

    # -- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event, notifier: Notifier | None = None) -> None:
        """Handle messages and send batches until ``stop`` is set; ``notifier``: systemd's READY once
        connected and a watchdog ping from each turn (``ioft-plant-worker.service``).

        A batch leaves as soon as the worker has nothing more to read (no upload waits behind it),
        or after ``FLUSH_S`` of a backlog: under load batches grow (a batch carries 2 × P float64,
        four times an upload's float32: one per upload would double the broker's bytes), idle
        they leave at once.
        """
        while not stop.is_set():
            if notifier is not None:
                notifier.alive()
                if not notifier.ready_sent and self.session.connected.is_set():
                    b = self.session.options.broker
                    notifier.ready(f"worker {self.id}: connected to {b.host}:{b.port}")
            msg, until = self.session.get(IDLE_S), time.monotonic() + FLUSH_S
            while msg is not None:
                self.handle(msg)
                msg = self.session.get(0) if time.monotonic() < until else None
            drained = self.session.inbound.empty() if hasattr(self.session, "inbound") else True
            for r in list(self.rounds.values()):
                if self.plant:
                    if r.pending and self._plant_due(r):
                        self._send(r)
                elif r.pending and (drained or len(r.pending) >= BATCH_MAX or time.monotonic() >= until):
                    self._send(r)
            if self.outbox.items and self.rounds and not self.plant:  # refusals alone, e.g. replays
                self._send(next(iter(self.rounds.values())))

    def handle(self, msg: Message) -> None:
        agg = wire.parse(msg.topic, self.fleet.fleet)
        if agg is not None:
            if agg.kind == "ctl":
                self._ctl(wire.decode_ctl(msg.payload))
            return
        try:
            topic = topics.parse_topic(msg.topic)
        except codec.WireError:
            return
        if topic.kind == "down":
            try:
                self._announcement(topic.task, msg.payload)
            except (codec.WireError, ValueError, KeyError, TypeError) as exc:
                log.warning("worker %s: ignored announcement of %s: %s", self.id, topic.task, exc)
            return
        if topic.kind != "up":
            self.fleet.handle(msg, None)  # a device status: selections are judged from it
            return
        r = self.rounds.get(topic.task)
        if r is None:
            self.fleet.handle(msg, None, None)  # refused: no round open
            return
        before = r.inbox.get(topic.device)
        self.fleet.handle(msg, r.request, r.inbox)
        r.changed = True
        got = r.inbox.get(topic.device)
        if isinstance(got, Update) and got is not before:  # admitted just now: into the next batch
            r.pending[topic.device] = got
            r.inbox[topic.device] = replace(got, params={})
            self.admitted += 1
            faults.point("worker_admitted")

    # -- rounds -----------------------------------------------------------------------------
    def _strategy(self, spec_json: str) -> Strategy:
        strategy = self._strategies.get(spec_json)
        if strategy is None:
            strategy = self._strategies[spec_json] = make_strategy(TaskSpec.from_json(spec_json))
        return strategy

    def _announcement(self, task: str, payload: bytes) -> None:
        ann = Announcement.decode(payload, max_bytes=self.fleet.policy.max_payload_bytes)
        r = self.rounds.get(task)
        if ann.state != "running":
            if r is not None:
                self._send(r)
                del self.rounds[task]
            return
        key = (ann.round, ann.phase, ann.global_hash)
        if r is not None and r.key == key:
            if ann.deadline != r.deadline:  # re-announced: an extension, or a restarted coordinator
                self.fleet.admission.forget_answers(task, ann.round, ann.phase)
                r.deadline = ann.deadline
            return
        if r is not None:
            self._send(r)  # the last uploads of the round before
        strategy = self._strategy(ann.spec)
        fold = strategy.fold(ann.phase)
        if fold is None:
            log.error("worker %s: task %s needs every upload at once; workers cannot split it", self.id, task)
            self.rounds.pop(task, None)
            return
        request = CollectRequest(
            strategy.spec,
            ann.round,
            ann.phase,
            ann.params,
            ann.global_hash,
            strategy.downlinks(ann.params),
            strategy.expected(ann.params, ann.phase),
            participants=ann.participants,
            expected_by_device=strategy.expected_by_device(ann.params, ann.phase),
            max_samples=ann.max_samples if ann.max_samples is None or ann.max_samples >= 1 else 1,
        )
        if (
            request.max_samples is not None
        ):  # the round's weight cap: what this worker folds counts at most it
            fold.weight = capped_weight(fold.weight, request.max_samples)
        self.fleet.selections[task] = ann.devices
        self.fleet.holdouts[task] = ann.holdout
        self.rounds[task] = _Round(request, fold, ann.deadline)
        log.info("worker %s: task %s round %d/%s open", self.id, task, ann.round, ann.phase)

    def _plant_due(self, r: _Round) -> bool:
        """A plant sends its round's one batch once every device online at its broker (that runs the
        task and is not held out) has an upload judged, or ``PLANT_MARGIN`` of the round's time
        before the cloud's deadline: one message per plant per round crosses the bridge."""
        if time.time() >= r.deadline - PLANT_MARGIN * max(0.0, r.deadline - r.opened):
            return True
        if not r.changed:
            return False
        r.changed = False
        task = r.request.spec.name
        selection, held_out = self.fleet.selections.get(task), set(self.fleet.holdouts.get(task, ()))
        awaited = {
            d
            for d in self.fleet.view.online_devices()
            if d not in held_out and self.fleet.view.refusal(d, task, selection) is None
        }
        return awaited <= set(r.inbox)

    # -- batches ----------------------------------------------------------------------------
    def _send(self, r: _Round | None, task: str = "", flush: int | None = None) -> None:
        """Send ``r``'s pending uploads (and every refusal) as one batch; with ``flush``, even an
        empty one (a barrier's answer)."""
        updates = {} if r is None else r.pending
        refused = self.outbox.take()
        if not updates and not refused and flush is None:
            return
        self._seq += 1
        request = None if r is None else r.request
        batch = wire.Batch(
            self.id,
            self._seq,
            task if request is None else request.spec.name,
            0 if request is None else request.round,
            "" if request is None else request.phase,
            "" if request is None else request.global_hash,
            refused=refused,
            flush=flush,
        )
        if r is not None and updates:
            fold = RoundFold(r.fold.weight)
            for device in sorted(updates):  # a fixed order: the same batch sums the same bits
                fold.add(updates[device])
            batch.mean = fold.mean
            batch.folded = {d: (u.n_samples, dict(u.metrics)) for d, u in updates.items()}
            self._unacked[self._seq] = (batch.task, r.key, updates)
            r.pending = {}
        self.session.publish(
            wire.topic_batch(self.fleet.fleet, batch.task, self.id), batch.encode(), timeout=None
        )
        self.batches += 1

    def _ctl(self, body: dict) -> None:
        if "flush" in body and isinstance(body.get("task"), str):
            task = body["task"]
            self._send(self.rounds.get(task), task=task, flush=body["flush"])
        elif body.get("worker") == self.id and "ack" in body:
            entry = self._unacked.pop(body["ack"], None)
            dupes = set(body.get("dupes") or ())
            if entry is None or not dupes:
                return
            task, key, updates = entry
            r = self.rounds.get(task)
            rest = {d: u for d, u in updates.items() if d not in dupes}
            if r is not None and r.key == key and rest:  # counted elsewhere: fold the rest again
                r.pending.update(rest)
                r.changed = True


# -- processes ---------------------------------------------------------------------------------
def worker_options(cfg: AggregatorConfig, worker: str) -> SessionOptions:
    """A clean session: when a worker dies the broker stops giving it uploads (a persistent one
    would keep receiving its share while away; see the README, "Aggregators that scale out")."""
    topic = wire.topic_worker(cfg.fleet, worker)
    return SessionOptions.for_login(
        cfg,
        f"{cfg.client_id}-{worker}",
        clean_session=True,
        will=(topic, wire.OFFLINE),
        birth=lambda: [(topic, wire.ONLINE)],
        inbound_limit=max(100_000, 4 * len(cfg.collect.expected)),
    )


def run_worker(
    cfg: AggregatorConfig, worker: str, stop: threading.Event | None = None, *, plant: bool = False
) -> None:
    stop = stop or threading.Event()
    notifier = Notifier.from_env()  # a no-op outside a Type=notify unit
    session = MqttSession(worker_options(cfg, worker))
    w = AggregatorWorker(
        session, cfg.fleet, worker, cfg.admission.policy(), cfg.max_payload_bytes, plant=plant
    )
    session.start(timeout=None)
    log.info("worker %s of fleet %s: sharing the uplink (group %s)", worker, cfg.fleet, wire.GROUP)
    try:
        w.run(stop, notifier)
    finally:
        notifier.stopping()
        notifier.close()
        session.stop(final=(wire.topic_worker(cfg.fleet, worker), wire.OFFLINE))
        log.info("worker %s stopped: %d uploads admitted, %d batches", worker, w.admitted, w.batches)


class LocalWorkers:
    """``[collect] workers = K`` with ``spawn_workers``: ``serve`` runs K ``cloud-aggregator worker``
    processes beside itself, and starts one again ``RESTART_S`` after it dies."""

    def __init__(self, count: int, argv: list[str], prefix: str = "w", log_dir: Path | None = None) -> None:
        self.argv, self.log_dir = argv, log_dir
        self.names = self.names_for(count, prefix)
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()
        for name in self.names:
            self._start(name)
        threading.Thread(target=self._supervise, name="workers", daemon=True).start()

    @staticmethod
    def names_for(count: int, prefix: str = "w") -> list[str]:
        """The ids of the ``count`` workers serve starts (each logs in with ``workers/<id>.toml`` where
        the config logs in as someone: :mod:`cloud_aggregator.worker_login`)."""
        return [f"{prefix}{i}" for i in range(1, count + 1)]

    def _start(self, name: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cloud_aggregator.cli",
            "--log-level",
            logging.getLevelName(log.getEffectiveLevel()),
        ]
        out = None if self.log_dir is None else (self.log_dir / f"worker-{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [*cmd, "worker", *self.argv, "--id", name], stdout=out, stderr=out
        )
        if out is not None:
            out.close()
        log.info("worker %s started (pid %d)", name, self.procs[name].pid)

    def _supervise(self) -> None:
        while not self._stop.wait(RESTART_S):
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    log.warning(
                        "worker %s (pid %d) exited with %s; starting it again",
                        name,
                        proc.pid,
                        proc.returncode,
                    )
                    self._start(name)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the command ---------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "worker",
        help="one of [collect] workers: admit and fold a share of the fleet's uploads for serve",
    )
    w.add_argument(
        "--config",
        type=Path,
        required=True,
        help="the aggregator TOML serve runs on; the worker logs in with workers/<id>.toml beside it "
        "(fleet add-worker) where the config logs in as someone",
    )
    w.add_argument("--broker", help="mqtt://host:port or mqtts://host:port (overrides the config)")
    w.add_argument("--allow-plaintext", action="store_true")
    w.add_argument("--id", default=f"w{os.getpid()}", help="this worker's name, unique in the fleet")
    w.add_argument(
        "--plant",
        action="store_true",
        help="a plant's partial aggregator (--broker: the plant's): one batch per round crosses the bridge",
    )
    w.set_defaults(func=_worker)


def _worker(args: argparse.Namespace) -> int:
    try:
        codec.check_id("worker", args.id)  # before it names a login file
        raw, own = worker_login.with_login(load_toml(args.config), args.config, args.id)
        who = worker_login.raw_identity(raw)
        if not own and not args.plant and who is not None:  # a plant worker's config is its own login
            refusal = worker_login.missing_logins(who, args.config, [args.id])
            print(refusal, file=sys.stderr)
            return 2
        if args.broker:
            raw["broker"] = args.broker
        if args.allow_plaintext:
            raw["allow_plaintext"] = True
        cfg = build(AggregatorConfig, raw, str(args.config))
    except ConfigError as exc:
        print(f"invalid configuration in {args.config}: {'; '.join(exc.errors)}", file=sys.stderr)
        return 2
    except codec.WireError as exc:
        print(f"--id: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run_worker(cfg, args.id, stop, plant=args.plant)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, before)
    return 0
