"""``edge-trainer``: the long-running device daemon.

It connects with a Last Will that marks it offline, follows its fleet's round
announcements, runs the task's client update from ``trainer_lite`` on its local
dataset, and publishes only the algorithm's shared parameters.  Personal state
and the last upload live together in one atomically written file per task, so a
kill at any instant leaves a state that is either before or after a round — and
an upload that was computed is re-sent, never recomputed, when a round is
re-announced (after an aggregator or broker restart).

With ``[model] public_key`` set it also follows the fleet's model pushes
(``edge.models``: verify, fetch, smoke-test, activate or roll back) and reports
each model's active version and refusals in its retained status.  A task whose
hyperparameters say ``"features": "onnx:<model>"`` trains on that model's
embeddings of the local data, computed by onnxruntime before the client update.

Rows that edge-recorder feeds are answered at once by each task's serving model, on a thread
of its own (``edge.serving``); after each round the round's personalized model is offered to it.

A task spec with ``feature_schema`` set is refused unless the local dataset's meta
carries the same ``schema_hash`` (weld features of another recipe, windows of another
layout, or data with no schema at all): the refusal is logged once per task and spec
and reported under ``refused`` in the retained status; the device sends nothing.

An announcement is answered in named steps (:meth:`EdgeTrainer.on_announcement`): gate, state,
holdout, pace, resend, rows, train, encode, arm SecAgg, persist, publish, offer to serving.  Only
the gate refuses (``edge.round_steps.TaskRefused``, reported); the other steps return early,
logged, when this device has nothing (more) to send for the round.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge import round_steps
from edge.announcements import Announcements
from edge.buffered import Pacer
from edge.config import DeviceConfig
from edge.dataset import DIR as DATASET_DIR
from edge.dataset import prepare_dataset
from edge.device_status import status_body
from edge.models.manager import ModelManager
from edge.models.onnx import LoadedModel
from edge.optout import REASON as PAUSED
from edge.optout import PauseWatch
from edge.round_steps import Clients, TaskRefused
from edge.secagg_client import ANSWERED_FILE, SecAggDevice, secagg_identity
from edge.segments import DatasetReader
from edge.serving.alerts import check_rules
from edge.serving.server import Server
from edge.status_clock import StatusClock
from edge.task_inputs import Rows, TaskInputs
from edge.task_state import TaskState, load_task_state, save_task_state, task_state_path
from ioft_protocol import codec, feature_stats, restate, round_messages, topics
from ioft_protocol.config import ConfigError
from ioft_protocol.manifest import load_public_key
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import MqttError, SessionOptions
from ioft_protocol.secagg import transport as secagg_wire
from ioft_protocol.service import Notifier
from ioft_protocol.state import StateError
from sensors.features.scaling import feature_sums
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.client import initial_local
from trainer_lite.data import Dataset
from trainer_lite.holdout import holdout_score
from trainer_lite.params import Params
from trainer_lite.task import training_changes

log = logging.getLogger(__name__)


class EdgeTrainer:
    """The device daemon; ``run()`` blocks until ``stop()`` (or SIGTERM/SIGINT via the CLI).

    ``session_factory`` makes the MQTT session (``edge.swarm`` passes one driven by its shared
    loop, and one :class:`Announcements` for all its devices).
    """

    def __init__(
        self,
        config: DeviceConfig,
        notifier: Notifier | None = None,
        *,
        session_factory: Callable[[SessionOptions], MqttSession] = MqttSession,
        announcements: Announcements | None = None,
    ) -> None:
        self.config = config
        self.announcements = announcements or Announcements()
        self.clock = StatusClock(config.round_status_s, config.heartbeat_s, config.aggregator_quiet_s)
        self.device = config.device
        #: announcements handled on this connection, and when it began (``ioft_protocol.restate``)
        self.delivered = restate.Delivered()
        self.connected_at: float | None = None
        #: what the device says while no aggregator of its fleet answers (also in its status)
        self.unheard: str | None = None
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        #: systemd's READY / WATCHDOG / STOPPING (a no-op outside a Type=notify unit)
        self.notifier = notifier or Notifier.from_env()
        self.pause = PauseWatch(self.state_dir)  # the owner's opt-out (edge-trainer pause|resume)
        self._last_ann: dict[str, round_messages.Announcement] = {}  # per task: answered again on resume
        self._stop = threading.Event()
        self.tasks: dict[str, TaskState] = {}
        self.clients = Clients(config.algorithms)  # each task spec's client update, made once
        self.refused: dict[str, str] = {}  # task -> why this device does not take part
        #: task -> the (round, phase) whose announcement this device sent its feature statistics on
        self._stats_sent: dict[str, tuple[int, str]] = {}
        #: task -> this device's score of the task's latest global, where the task holds it out
        self.holdout: dict[str, round_messages.HoldoutScore] = {}
        #: task -> the round this device trained and the (lower) one announced (``_note_ahead``)
        self.ahead: dict[str, dict[str, object]] = {}
        self.round_cpu_s: float | None = None  # CPU seconds of the last round (status reads it)
        self._data = DatasetReader(self.state_dir)
        self.train, self.test, self.data_meta = self._first_dataset()
        self.models: ModelManager | None = None
        # the rows each task trains on: raw, embedded by a pushed encoder, scaled locally
        self.inputs = TaskInputs(self.device, self._active_model)
        self._connect_parts(session_factory)
        self.rounds_done = 0
        # buffered (FedBuff) tasks and a simulated pace: which announcement to answer, and when
        self.pacer = Pacer(
            self.device, config.simulate, self._run_paced, self._answered_round, self._presence
        )

    def _first_dataset(self) -> tuple[Dataset, Dataset, dict]:
        """The local dataset at start; with ``[data] source = "state"`` it may not exist yet:
        edge-recorder appends segments while this process runs, and refresh_dataset() reads them."""
        try:
            return prepare_dataset(self.state_dir, self.device, self.config.data, reader=self._data)
        except FileNotFoundError:
            if self.config.data.source != "state":
                raise
        log.warning(
            "%s: no local dataset in %s yet; rounds are skipped until edge-recorder writes one",
            self.device,
            self.state_dir / DATASET_DIR,
        )
        empty = Dataset(np.empty((0, 1)), np.empty((0, 1)))
        return empty, empty, {}

    def _connect_parts(self, session_factory: Callable[[SessionOptions], MqttSession]) -> None:
        """The MQTT session and the parts that speak through it besides the rounds: serving's
        answers, SecAgg's stages and, with ``[model] public_key`` set, the model pushes."""
        config = self.config
        # answers for every new row the recorder feeds (edge.serving), on their own thread
        self.serving = Server(
            config,
            self.state_dir,
            lambda topic, payload: self.session.publish(topic, payload, retain=True, timeout=None),
            self._active_model,
        )
        # An alert rule that can never fire is refused here, where the dataset tells the classes.
        problems, self.serving.unchecked = check_rules(config, self.data_meta)
        if problems:
            raise ConfigError("[[serve.alerts]]", problems)
        if self.serving.unchecked:
            log.warning("%s: %s", self.device, self.serving.unchecked)
        self.session = session_factory(self._session_options())  # its Last Will reads serving's state
        # tasks with secagg: the update leaves masked, through the SecAgg stages (edge/secagg_client.py)
        self.secagg = SecAggDevice(
            config.fleet,
            self.device,
            lambda t, p: self.session.publish(t, p, timeout=None),
            min_participants=config.secagg_min_participants,
            answered=self.state_dir / ANSWERED_FILE,
            **secagg_identity(config),
        )
        if config.model.public_key:
            self.models = ModelManager(
                self.state_dir / "models",
                config.model,
                device=self.device,
                fleet=config.fleet,
                public_key=load_public_key(config.model.public_key),
                data_schema_hash=self.data_meta.get("schema_hash"),
                holdout=(self.train, self.test),
                subscribe=lambda topic: self.session.subscribe(topic),
                unsubscribe=lambda topic: self.session.unsubscribe(topic),
                tap=lambda topic, callback: self.session.tap(topic, callback),
            )

    def _active_model(self, name: str) -> LoadedModel | None:
        """The pushed model serving under ``name`` here, if any."""
        return self.models.active(name) if self.models is not None else None

    # -- local dataset ---------------------------------------------------------------
    def refresh_dataset(self) -> bool:
        """Take in the segments edge-recorder appended since the last read; ``True`` if the data changed.

        Only new segments are read (:meth:`edge.segments.DatasetReader.refresh`); ones
        merged by the recorder's compaction are recognised by their sequence numbers.
        """
        if not self._data.refresh():
            return False
        self.train, self.test, self.data_meta = self._data.train, self._data.test, self._data.meta
        self.inputs.forget_embeddings()
        if self.models is not None:
            self.models.holdout = (self.train, self.test)
            self.models.data_schema_hash = self.data_meta.get("schema_hash")
        log.info(
            "%s: local dataset reloaded: %d train / %d test rows",
            self.device,
            len(self.train),
            len(self.test),
        )
        return True

    # -- MQTT ------------------------------------------------------------------------
    def _status(self, state: str) -> tuple[str, bytes]:
        body = status_body(self, state)
        return topics.topic_status(self.config.fleet, self.device), json.dumps(body, sort_keys=True).encode()

    def _session_options(self) -> SessionOptions:
        c = self.config
        return SessionOptions.for_login(
            c,
            f"ioft-{c.fleet}-{c.device}",
            keepalive=c.keepalive,
            will=self._status("offline"),
            birth=self._birth,
        )

    def _birth(self) -> list[tuple[str, bytes]]:
        """The status published on every (re)connect, from a new connection (``ioft_protocol.restate``)."""
        self.connected_at = time.time()
        self.clock.born()  # this status counts as the heartbeat's too
        self.delivered.connected()
        return [self._status("online"), *self.serving.discovery()]  # and Home Assistant's configs, opt-in

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.start()
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                if self.session.fatal:
                    raise MqttError(self.session.fatal)
                self.notifier.alive()  # from this loop, so systemd's watchdog restarts a hung one
                if not self.notifier.ready_sent and self.session.connected.is_set():
                    self.notifier.ready(f"connected to {self.config.broker}")
                msg = self.session.get(min(0.2, max(0.0, self.pacer.next_at - time.monotonic())))
                if msg is not None:
                    self.handle(msg.topic, msg.payload)
                self.pace()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 1.0
                    self.tick()
        finally:
            self.shutdown()

    # The daemon's life in three calls, which ``run`` and ``edge.swarm`` (thousands of virtual
    # devices in one process, one network loop) share: start, then handle() and tick(), shutdown.
    def start(self) -> None:
        """Subscribe to the fleet's downlinks and connect (in the background, retrying forever)."""
        fleet = self.config.fleet
        self.session.subscribe(topics.topic_down_all(fleet))
        self.session.subscribe(topics.topic_down_device(fleet, topics.ANY, self.device))
        self.session.subscribe(secagg_wire.topic_down_mine(fleet, self.device))
        self.session.subscribe(topics.topic_roll_call(fleet))
        self.session.subscribe(topics.topic_scaling_all(fleet))  # tasks with scaling = "fleet"
        if self.models is not None:
            self.session.subscribe(topics.topic_model_offer_all(fleet))
        self.session.start(timeout=None)  # paho keeps retrying until the broker is there
        self.serving.start()
        log.info(
            "%s running (state %s, %d train / %d test rows)",
            self.device,
            self.state_dir,
            len(self.train),
            len(self.test),
        )

    def tick(self) -> None:
        """Once a second: the owner's pause file, and model pushes waiting for a retry."""
        if self.pause.changed():
            self._pause_changed()
        self._check_heard()
        self.clock.due |= self.serving.take_changed()  # answers and refusals show in the status
        if self.models is not None and self.models.tick():
            self._publish_status()
        elif self.clock.rounds_due():
            self._publish_status()  # the rounds answered since the last one
        elif self.clock.heartbeat_due(self.session.connected.is_set()):
            self._publish_status()  # live: the aggregator waits only for devices heard lately

    def _check_heard(self) -> None:
        """Say once, within ``aggregator_quiet_s`` of connecting, that no aggregator of this
        device's fleet has answered (a wrong ``fleet =`` fails silently otherwise)."""
        if self.unheard is not None or not self.clock.quiet_too_long():
            return
        c = self.config
        self.unheard = (
            f"no aggregator of fleet {c.fleet!r} has answered in {c.aggregator_quiet_s:g} s (no round "
            f"announcement on {c.broker}): check that `fleet =` in device.toml is the "
            "aggregator's fleet (its aggregator.toml) and that `cloud-aggregator serve` is running"
        )
        log.warning("%s: %s", self.device, self.unheard)
        self.notifier.status(self.unheard)
        self._publish_status()

    def _heard(self) -> None:
        """A message from the fleet's side arrived: its aggregator is there."""
        if self.clock.heard() and self.unheard is not None:
            self.unheard = None
            log.info("%s: the aggregator of fleet %r answered", self.device, self.config.fleet)
            self._publish_status()

    def shutdown(self) -> None:
        """Publish the retained offline status and disconnect cleanly."""
        self.notifier.stopping(f"stopping after {self.rounds_done} rounds")
        if self.models is not None:
            self.models.close()
        self.serving.close()
        self.session.stop(final=self._status("offline"))
        log.info("%s stopped after %d rounds", self.device, self.rounds_done)

    def _pause_changed(self) -> None:
        """The owner paused (every task known here is refused, so no round waits for this device)
        or resumed (the refusals go, and the tasks' current rounds are answered)."""
        reason = self.pause.reason
        if reason is not None:
            log.warning("%s: %s; taking part in no task until `edge-trainer resume`", self.device, reason)
            self.refused.update(dict.fromkeys({*self.tasks, *self.refused, *self._last_ann}, reason))
            self._publish_status()
            self.notifier.status(reason)
            return
        log.info("%s: resumed by its owner; taking part again", self.device)
        self.refused = {t: why for t, why in self.refused.items() if not why.startswith(PAUSED)}
        self._publish_status()
        self.notifier.status("resumed by its owner")
        for task, ann in list(self._last_ann.items()):
            state = self.tasks.get(task)
            if state is not None and state.answered == (ann.round, ann.phase):
                continue  # answered before the pause: resending it now would only be refused as a replay
            try:
                self.on_announcement(ann)
            except (codec.WireError, ValueError, KeyError) as exc:
                log.warning("%s: task %s: %s", self.device, task, exc)

    # -- rounds ------------------------------------------------------------------------
    def handle(self, topic: str, payload: bytes) -> None:
        """Act on one downlink message; malformed input is logged and dropped."""
        where = secagg_wire.parse_topic(topic)
        if where is not None:
            if (where.fleet, where.direction, where.device) == (self.config.fleet, "down", self.device):
                self.secagg.handle(where, payload)
            return
        try:
            parsed = topics.parse_topic(topic)
            if parsed.fleet != self.config.fleet:
                return
            if parsed.kind != "roll_call":  # a roll call may be `fleet status` or the console's
                self._heard()
            if parsed.kind == "roll_call":  # the aggregator (re)connected: say where this device stands
                self._publish_status()
                return
            if parsed.kind in ("model_offer", "model_chunk"):
                self._handle_model(parsed, payload)
                return
            if parsed.kind == "scaling":
                self._fleet_scaling(str(parsed.task), payload)
                return
            if parsed.kind not in ("down", "down_device"):
                return
            if self.delivered.duplicate(parsed.kind, payload):
                return  # a restated copy of an announcement this connection already brought
            ann = self.announcements.decode(topic, payload, self.config.max_payload_bytes)
            if ann.task != parsed.task or ann.fleet != parsed.fleet:
                raise codec.WireError(f"announcement for {ann.fleet}/{ann.task} on topic {topic}")
            self.on_announcement(ann)
        except (codec.WireError, ValueError, KeyError) as exc:
            log.warning("%s dropped downlink on %s: %s", self.device, topic, exc)

    def _handle_model(self, parsed: topics.Topic, payload: bytes) -> None:
        if self.models is None or parsed.model is None:
            return
        if parsed.kind == "model_offer":
            changed = self.models.handle_offer(parsed.model, payload)
        else:
            changed = self.models.handle_chunk(parsed.model, int(parsed.version), int(parsed.index), payload)
        if changed:
            self._publish_status()

    def _publish_status(self) -> None:
        topic, status = self._status("online")
        self.session.publish(topic, status, retain=True, timeout=None)
        self.clock.sent()

    def _round_status(self) -> None:
        """The status after an answered round: at once, or, within ``round_status_s`` of the last
        one, from :meth:`tick` once that has passed (:meth:`StatusClock.round_answered`)."""
        if self.clock.round_answered():
            self._publish_status()

    def task_data(self, spec_json: str) -> Rows | None:
        """The local splits a task trains on (:meth:`edge.task_inputs.TaskInputs.for_task`)."""
        return self.inputs.for_task(spec_json, self._client(spec_json), self.train, self.test)

    def _rows(self, algo: ClientAlgorithm) -> Rows | None:
        """The task's rows before scaling (:meth:`edge.task_inputs.TaskInputs.rows`)."""
        return self.inputs.rows(algo, self.train, self.test)

    def _client(self, spec_json: str) -> ClientAlgorithm:
        """The task's client update (:meth:`edge.round_steps.Clients.client`: may raise ``TaskRefused``)."""
        return self.clients.client(spec_json, self.data_meta)

    def _refuse(self, task: str, reason: str) -> None:
        """Report (retained status, once per reason) that this device will not run ``task``."""
        if self.refused.get(task) != reason:  # once per task and spec, not every round
            self.refused[task] = reason
            log.warning("%s: refusing task %s: %s; sending nothing for it", self.device, task, reason)
            self._publish_status()

    # -- one round, in named steps (edge.round_steps) ------------------------------------
    def on_announcement(self, ann: round_messages.Announcement) -> None:
        """Answer one round announcement; a step that leaves this device nothing to send returns early."""
        if self.config.tasks and ann.task not in self.config.tasks:
            return
        self._last_ann[ann.task] = ann
        algo = self._gate(ann)
        if algo is None:
            return  # refused, and reported
        state = self._task_state(ann.task, ann.spec, algo)
        if self.device in ann.holdout and ann.state == "running":
            self._score_holdout(ann, algo)
            return
        if self.pacer.hold(ann):  # a buffered task, or a simulated pace: answered by pace()
            return
        if self._over(ann) or self._answered_before(ann, state):
            return
        rows = self._round_rows(ann, algo)
        if rows is None:
            return
        trained = round_steps.train(algo, self.device, ann, state.local, rows)
        self.round_cpu_s = trained.cpu_s
        new_state = round_steps.kept_state(algo, self.device, ann, trained)
        if algo.spec.secagg is not None:  # the change leaves masked, the upload carries none
            update, weight = round_steps.masked_input(algo, self.device, ann, trained)
            self.secagg.arm(ann.task, ann.round, ann.phase, update, weight)
        save_task_state(task_state_path(self.state_dir, ann.task), new_state)  # durable before it is sent
        self.tasks[ann.task] = new_state
        self._publish_upload(ann.task, new_state)
        self._offer(ann, algo, new_state.local)
        self._answered(ann, trained.metrics)

    def _gate(self, ann: round_messages.Announcement) -> ClientAlgorithm | None:
        """The task's client update, or ``None`` where this device refuses the task (paused, not
        selected, an algorithm not allowed, rows of another schema or width): reported in its status."""
        try:
            if self.pause.reason is not None:
                raise TaskRefused(self.pause.reason)
            round_steps.check_selected(ann, self.device, self.config.machine_kind, self.config.tags)
            algo = self._client(ann.spec)
            if self.refresh_dataset():
                # before the upload: the aggregator bounds n_samples by the rows the status reports
                self._publish_status()
            if algo.input_width() is not None and len(self.train):  # on a "done" one too: it stays reported
                round_steps.check_width(algo, self.task_data(ann.spec), self.data_meta)
        except TaskRefused as exc:
            self._refuse(ann.task, str(exc))
            return None
        if self.refused.pop(ann.task, None) is not None:
            self._publish_status()  # the aggregator may wait for this device again
        return algo

    def _over(self, ann: round_messages.Announcement) -> bool:
        """Whether the task is over or this round is not this device's: nothing to send."""
        if ann.state != "done" and ann.takes_part(self.device):
            return False
        if self.clock.due and ann.state == "done":
            self._publish_status()  # the task is over: its last round shows at once
        return True

    def _answered_before(self, ann: round_messages.Announcement, state: TaskState) -> bool:
        """Whether this device trained this round already (its kept upload is re-sent: the
        aggregator may have lost it) or a later one (a stale announcement: noted in its status)."""
        if state.answered is not None and (ann.round, ann.phase) == state.answered:
            if state.upload_meta.get("global_hash") == ann.global_hash:
                self._publish_upload(ann.task, state)
            else:  # this round was trained from another global: the aggregator's store lost it
                self._note_ahead(ann, state.answered[0])
            return True
        if state.answered is not None and ann.round < state.answered[0]:
            self._note_ahead(ann, state.answered[0])
            return True
        if self.ahead.pop(ann.task, None) is not None:
            log.info("%s: task %s: the aggregator is at round %d again", self.device, ann.task, ann.round)
        return False

    def _params_ok(self, ann: round_messages.Announcement) -> bool:
        """Whether the announced parameters hash to their announced hash; if not, the message is dropped."""
        if self.announcements.params_match(ann):
            return True
        log.warning(
            "%s dropped the announcement of task %s round %d: downlink parameters do not match their "
            "announced hash",
            self.device,
            ann.task,
            ann.round,
        )
        return False

    def _round_rows(self, ann: round_messages.Announcement, algo: ClientAlgorithm) -> Rows | None:
        """The rows the round trains on, or ``None`` (logged) while there are none: no local rows
        yet, an encoder not active here, or a fleet transform still to come (the statistics go out)."""
        if not self._params_ok(ann):
            return None
        if len(self.train) == 0:
            log.warning(
                "%s: task %s round %d: no local training rows yet; skipping the round",
                self.device,
                ann.task,
                ann.round,
            )
            return None
        data = self.task_data(ann.spec)
        if data is None and algo.scaling == "fleet" and ann.task not in self.inputs.fleet:
            self._send_stats(ann, algo)
            return None
        if data is None:
            log.warning(
                "%s: task %s round %d needs encoder %s, which is not active here yet; skipping the round",
                self.device,
                ann.task,
                ann.round,
                algo.spec.hparams.get("features"),
            )
            return None
        if self.serving.answering(ann.task):  # its newest rows judge the round's candidates: not trained on
            return self.serving.holdout(data[0])[0], data[1], data[2]
        return data

    def _offer(self, ann: round_messages.Announcement, algo: ClientAlgorithm, local: Params) -> None:
        """Offer the round's personalized model to serving: it answers rows if the gate lets it."""
        raw = (self.train, self.test, self.data_meta)
        rows = self._rows(algo)
        scaler = None if rows is None else self.inputs.scaler(ann.spec, algo, rows[0])
        self.serving.offer(ann.task, algo, ann.params, local, rows, raw, ann.round, scaler)

    def _answered(self, ann: round_messages.Announcement, metrics: dict[str, float]) -> None:
        """Count, log and report the round just answered."""
        self.rounds_done += 1
        shown = [k for k in ("test_accuracy", "test_loss", "train_loss") if k in metrics]
        log.info(
            "%s: task %s round %d %s: %s (%.2f s)",
            self.device,
            ann.task,
            ann.round,
            ann.phase,
            " ".join(f"{k} {metrics[k]:.4f}" for k in shown),
            metrics["train_seconds"],
        )
        self._round_status()
        self.notifier.status(f"task {ann.task}: answered round {ann.round} {ann.phase}")

    def _send_stats(self, ann: round_messages.Announcement, algo: ClientAlgorithm) -> None:
        """A ``scaling = "fleet"`` task with no pooled transform here yet: send this device's
        ``(n, Σx, Σx²)`` (once per announced round) and answer the round when the transform comes."""
        if self._stats_sent.get(ann.task) == (ann.round, ann.phase):
            return
        rows = self._rows(algo)
        if rows is None:
            return  # waits for its encoder: the statistics are of the embedded rows
        train = rows[0]
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
        self.session.publish(
            topics.topic_stats(self.config.fleet, ann.task, self.device), msg.encode(), timeout=None
        )
        self._stats_sent[ann.task] = (ann.round, ann.phase)
        log.info(
            "%s: task %s: sent the feature statistics of %d rows (fleet scaling); round %d waits for "
            "the pooled transform",
            self.device,
            ann.task,
            n,
            ann.round,
        )

    def _fleet_scaling(self, task: str, payload: bytes) -> None:
        """The aggregator's pooled transform for ``task``: apply it from now on, and answer the
        round that waited for it."""
        pooled = feature_stats.FleetScaling.decode(payload)
        if pooled.task != task:
            raise codec.WireError(f"fleet scaling for task {pooled.task} on the topic of task {task}")
        if not self.inputs.take_fleet(pooled):
            return  # the retained copy again (a reconnect)
        log.info(
            "%s: task %s: fleet scaling pooled from %d devices (%d rows) applied to training and serving",
            self.device,
            task,
            len(pooled.devices),
            pooled.rows,
        )
        ann = self._last_ann.get(task)
        if ann is not None:
            self.on_announcement(ann)

    def _note_ahead(self, ann: round_messages.Announcement, device_round: int) -> None:
        """An announcement below the round this device trained last: its status says so (once per
        announced round) for ``serve`` to tell its operator, who resumes it past this round."""
        ahead = {"task": ann.task, "device_round": device_round, "announced_round": ann.round}
        if ann.state != "running" or self.ahead.get(ann.task) == ahead:
            return
        self.ahead[ann.task] = ahead
        log.warning(
            "%s: task %s: the aggregator announces round %d but this device trained round %d already "
            "(its store is older than this device's state); not answering until a round past %d "
            "(serve --resume-from-devices)",
            self.device,
            ann.task,
            ann.round,
            device_round,
            device_round,
        )
        self._publish_status()

    def pace(self) -> None:
        """Send what :class:`edge.buffered.Pacer` has due (buffered jobs, paced answers); cheap when nothing is."""
        if self.pacer.next_at <= time.monotonic():
            self.pacer.step()

    def _run_paced(self, ann: round_messages.Announcement) -> None:
        try:
            self.on_announcement(ann)
        except (codec.WireError, ValueError, KeyError) as exc:
            log.warning("%s: task %s: %s", self.device, ann.task, exc)

    def _answered_round(self, task: str) -> int | None:
        state = self.tasks.get(task)
        return None if state is None or state.answered is None else state.answered[0]

    def _presence(self, online: bool) -> None:
        """A simulated departure or return (``[simulate]``): the retained status says so."""
        topic, status = self._status("online" if online else "offline")
        self.session.publish(topic, status, retain=True, timeout=None)
        log.info("%s: %s (simulated churn)", self.device, "back online" if online else "left the fleet")

    def _score_holdout(self, ann: round_messages.Announcement, algo: ClientAlgorithm) -> None:
        """Held out of the task: score the round's global on this device's rows and report it in
        the status (``trainer_lite.holdout``); never train, never upload."""
        done = self.holdout.get(ann.task)
        if done is not None and (done.round, done.phase, done.global_hash) == (
            ann.round,
            ann.phase,
            ann.global_hash,
        ):
            return
        if not self._params_ok(ann):
            return
        data = self.task_data(ann.spec)
        if data is None or len(data[0]) + len(data[1]) == 0:
            log.warning(
                "%s: task %s round %d: nothing to score the global on yet", self.device, ann.task, ann.round
            )
            return
        train, test, _ = data
        metrics = holdout_score(algo, self.device, ann.params, train, test, phase=ann.phase)
        self.holdout[ann.task] = round_messages.HoldoutScore(ann.round, ann.phase, ann.global_hash, metrics)
        log.info(
            "%s: task %s round %d %s: held out, the global scores %s",
            self.device,
            ann.task,
            ann.round,
            ann.phase,
            " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())),
        )
        self._publish_status()

    def _publish_upload(self, task: str, state: TaskState) -> None:
        """Send the round's kept upload (:func:`edge.round_steps.upload_message`): the same bytes each time."""
        msg = round_steps.upload_message(
            self.config.fleet, self.device, task, state, self.clients.masked(state.spec_json)
        )
        self.session.publish(
            topics.topic_up(self.config.fleet, task, self.device), msg.encode(), timeout=None
        )

    # -- state on disk --------------------------------------------------------------------
    def _task_state(self, task: str, spec_json: str, algo: ClientAlgorithm) -> TaskState:
        """The task's state: kept, read from its file, or fresh where there is none or its training changed."""
        state = self.tasks.get(task)
        if state is None:
            try:
                state = load_task_state(task_state_path(self.state_dir, task))
            except StateError as exc:
                log.error("%s: %s; starting task %s afresh", self.device, exc, task)
        changed = None if state is None else training_changes(state.spec_json, spec_json)
        if state is None or changed:
            if state is not None:
                log.info("%s: task %s changed %s; resetting its local state", self.device, task, changed)
            state = TaskState(spec_json=spec_json, local=initial_local(algo, self.device))
        elif state.spec_json != spec_json:  # more rounds: the same training goes on
            state.spec_json = spec_json
        self.tasks[task] = state
        return state

    # -- inspection ---------------------------------------------------------------------
    def personal_prediction(self, task: str, shared: Params, x: np.ndarray) -> np.ndarray:
        """The personalized model's output for raw rows ``x`` (embedded first if the task says so)."""
        state = self.tasks[task]
        algo = self._client(state.spec_json)
        return algo.predict(shared, state.local, self.inputs.encode(task, algo, x))
