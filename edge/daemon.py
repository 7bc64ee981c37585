"""``edge-trainer``: the long-running device daemon.

It connects with a Last Will that marks it offline, follows its fleet's round announcements, runs the
task's client update from ``trainer_lite`` on its local dataset, and publishes only the algorithm's
shared parameters.  Personal state and the last upload live together in one atomically written file per
task, so a kill at any instant leaves a state that is either before or after a round — and an upload
that was computed is re-sent, never recomputed, when a round is re-announced (after an aggregator or
broker restart).

With ``[model] public_key`` set it also follows the fleet's model pushes (``edge.models``: verify,
fetch, smoke-test, activate or roll back) and reports each model's active version and refusals in its
retained status.  A task whose hyperparameters say ``"features": "onnx:<model>"`` trains on that model's
embeddings of the local data, computed by onnxruntime before the client update.

Rows that edge-recorder feeds are answered at once by each task's serving model, on a thread
of its own (``edge.serving``); after each round the round's personalized model is offered to it.

A task spec with ``feature_schema`` set is refused unless the local dataset's meta carries the same
``schema_hash`` (weld features of another recipe, windows of another layout, or data with no schema at
all): the refusal is logged once per task and spec and reported under ``refused`` in the retained
status; the device sends nothing.

An announcement is answered in named steps (:meth:`EdgeTrainer.on_announcement`): gate, state,
holdout, pace, resend, rows, train, encode, arm SecAgg, persist, publish, offer to serving.  Only
the gate refuses (``edge.round_steps.TaskRefused``, reported); the other steps return early,
logged, when this device has nothing (more) to send for the round.

Its collaborators, each with one job: the session and the retained status
(:class:`edge.device_link.DeviceLink`), the tasks' states (:class:`edge.task_state.TaskStates`),
fleet scaling (:class:`edge.fleet_scaling.FleetStats`), SecAgg (:class:`edge.secagg_client.SecAggDevice`),
serving (:class:`edge.serving.server.Server`) and model pushes (:class:`edge.models.manager.ModelManager`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from edge import round_steps
from edge.announcements import Announcements
from edge.buffered import Pacer
from edge.config import DeviceConfig
from edge.dataset import first_dataset
from edge.device_link import DeviceLink
from edge.fleet_scaling import FleetStats
from edge.models.manager import ModelManager
from edge.models.onnx import LoadedModel
from edge.optout import PauseWatch
from edge.round_steps import Clients, TaskRefused
from edge.secagg_client import ANSWERED_FILE, SecAggDevice, secagg_identity
from edge.segments import DatasetReader
from edge.service_loop import ServiceLoop
from edge.serving.alerts import check_rules
from edge.serving.server import Server
from edge.task_inputs import Rows, TaskInputs
from edge.task_state import TaskState, TaskStates
from ioft_protocol import round_messages, topics
from ioft_protocol.config import ConfigError
from ioft_protocol.manifest import load_public_key
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import SessionOptions
from ioft_protocol.service import Notifier
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset
from trainer_lite.params import Params

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
        self.device = config.device
        self.state_dir = Path(config.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        #: systemd's READY / WATCHDOG / STOPPING (a no-op outside a Type=notify unit)
        self.notifier = notifier or Notifier.from_env()
        self.pause = PauseWatch(self.state_dir)  # the owner's opt-out (edge-trainer pause|resume)
        self._last_ann: dict[str, round_messages.Announcement] = {}  # per task: answered again on resume
        self.states = TaskStates(self.state_dir, self.device, lambda: self.link.publish_status())
        self.tasks, self.ahead = self.states.by_task, self.states.ahead  # read by the status
        self.clients = Clients(config.algorithms)  # each task spec's client update, made once
        self.refused: dict[str, str] = {}  # task -> why this device does not take part
        #: task -> this device's score of the task's latest global, where the task holds it out
        self.holdout: dict[str, round_messages.HoldoutScore] = {}
        self.round_cpu_s: float | None = None  # CPU seconds of the last round (status reads it)
        self._data = DatasetReader(self.state_dir)
        self.train, self.test, self.data_meta = first_dataset(
            self.state_dir, self.device, config.data, self._data
        )
        self.models: ModelManager | None = None
        # the rows each task trains on: raw, embedded by a pushed encoder, scaled locally
        self.inputs = TaskInputs(self.device, self._active_model)
        self.fleet_stats = FleetStats(
            config.fleet, self.device, self.inputs, lambda t, p: self.session.publish(t, p, timeout=None)
        )
        self._connect_parts(session_factory)
        self.service = ServiceLoop(self, self._last_ann)  # start, the loop, the downlinks, shutdown
        self.rounds_done = 0
        self._up_topics: dict[str, str] = {}  # task -> this device's upload topic
        # buffered (FedBuff) tasks and a simulated pace: which announcement to answer, and when
        self.pacer = Pacer(
            self.device, config.simulate, self.service.answer, self.states.answered_round, self.link.presence
        )

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
        self.link = DeviceLink(self, config, self.notifier, self.serving.discovery, session_factory)
        self.session = self.link.session
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

    # -- the daemon's life (edge.service_loop) --------------------------------------------
    def run(self) -> None:
        """Until :meth:`stop` (:meth:`edge.service_loop.ServiceLoop.run`)."""
        self.service.run()

    def stop(self) -> None:
        self.service.stopping.set()

    def start(self) -> None:
        self.service.start()

    def handle(self, topic: str, payload: bytes) -> None:
        """Act on one downlink message (:meth:`edge.service_loop.ServiceLoop.handle`)."""
        self.service.handle(topic, payload)

    def tick(self) -> None:
        self.service.tick()

    def shutdown(self) -> None:
        self.service.shutdown()

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
            self.link.publish_status()

    # -- one round, in named steps (edge.round_steps) ------------------------------------
    def on_announcement(self, ann: round_messages.Announcement) -> None:
        """Answer one round announcement; a step that leaves this device nothing to send returns early."""
        if self.config.tasks and ann.task not in self.config.tasks:
            return
        self._last_ann[ann.task] = ann
        algo = self._gate(ann)
        if algo is None:
            return  # refused, and reported
        state = self.states.get(ann.task, ann.spec, algo)
        if self.device in ann.holdout and ann.state == "running":
            self._score_holdout(ann, algo)
            return
        if self.pacer.hold(ann):  # a buffered task, or a simulated pace: answered by pace()
            return
        resend = partial(self._publish_upload, ann.task, state)  # its kept upload, where it answered already
        if self._over(ann) or self.states.answered_before(ann, state, resend):
            return
        rows = self._round_rows(ann, algo)
        if rows is None:
            return
        trained = round_steps.train(algo, self.device, ann, state.local, rows)
        self.round_cpu_s = trained.cpu_s
        # Before the upload is built: its metrics say what this device now serves.
        trained.metrics.update(self._offer(ann, algo, trained.local))
        new_state = round_steps.kept_state(algo, self.device, ann, trained)
        if algo.spec.secagg is not None:  # the change leaves masked, the upload carries none
            update, weight = round_steps.masked_input(algo, self.device, ann, trained)
            self.secagg.arm(ann.task, ann.round, ann.phase, update, weight)
        self.states.keep(ann.task, new_state)  # durable before it is sent
        self._publish_upload(ann.task, new_state)
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
                self.link.publish_status()
            if algo.input_width() is not None and len(self.train):  # on a "done" one too: it stays reported
                round_steps.check_width(algo, self.task_data(ann.spec), self.data_meta)
        except TaskRefused as exc:
            self._refuse(ann.task, str(exc))
            return None
        if self.refused.pop(ann.task, None) is not None:
            self.link.publish_status()  # the aggregator may wait for this device again
        return algo

    def _over(self, ann: round_messages.Announcement) -> bool:
        """Whether the task is over or this round is not this device's: nothing to send."""
        if ann.state != "done" and ann.takes_part(self.device):
            return False
        if self.link.clock.due and ann.state == "done":
            self.link.publish_status()  # the task is over: its last round shows at once
        return True

    def _round_rows(self, ann: round_messages.Announcement, algo: ClientAlgorithm) -> Rows | None:
        """The rows the round trains on, or ``None`` (logged) while there are none: no local rows
        yet, an encoder not active here, or a fleet transform still to come (the statistics go out)."""
        if not self.announcements.params_match(ann, self.device):
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
            self.fleet_stats.send(ann, lambda: self._train_rows(algo))
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

    def _offer(
        self, ann: round_messages.Announcement, algo: ClientAlgorithm, local: Params
    ) -> dict[str, float]:
        """Offer the round's personalized model to serving (it answers rows if the gate lets it);
        returns the round report's metrics of what serves the task now (:meth:`edge.serving.offers.Offers.served_metrics`)."""
        raw = (self.train, self.test, self.data_meta)
        rows = self._rows(algo)
        scaler = None if rows is None else self.inputs.scaler(ann.spec, algo, rows[0])
        self.serving.offer(ann.task, algo, ann.params, local, rows, raw, ann.round, scaler)
        return self.serving.served_metrics(ann.task, self.test)

    def _answered(self, ann: round_messages.Announcement, metrics: dict[str, float]) -> None:
        """Count, log and report the round just answered."""
        self.rounds_done += 1
        if log.isEnabledFor(logging.INFO):  # the line's metrics formatted only where it is shown
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
        self.link.round_status()
        if self.notifier.enabled:  # under systemd (a swarm's devices are not)
            self.notifier.status(f"task {ann.task}: answered round {ann.round} {ann.phase}")

    def _train_rows(self, algo: ClientAlgorithm) -> Dataset | None:
        """The task's training rows before scaling (``None`` while its encoder is not here)."""
        rows = self._rows(algo)
        return None if rows is None else rows[0]

    def pace(self) -> None:
        """Send what :class:`edge.buffered.Pacer` has due (buffered jobs, paced answers); cheap when nothing is."""
        if self.pacer.next_at <= time.monotonic():
            self.pacer.step()

    def _score_holdout(self, ann: round_messages.Announcement, algo: ClientAlgorithm) -> None:
        """Held out of the task: score the round's global (once per round and global) and report it
        in the status (:func:`edge.round_steps.score_global`); never train, never upload."""
        done = self.holdout.get(ann.task)
        key = (ann.round, ann.phase, ann.global_hash)
        seen = done is not None and (done.round, done.phase, done.global_hash) == key
        if seen or not self.announcements.params_match(ann, self.device):
            return
        score = round_steps.score_global(algo, self.device, ann, self.task_data(ann.spec))
        if score is not None:
            self.holdout[ann.task] = score
            self.link.publish_status()

    def _publish_upload(self, task: str, state: TaskState) -> None:
        """Send the round's kept upload (:func:`edge.round_steps.upload_message`): the same bytes each time."""
        msg = round_steps.upload_message(
            self.config.fleet, self.device, task, state, self.clients.masked(state.spec_json)
        )
        topic = self._up_topics.get(task)
        if topic is None:  # built (and its ids checked) once per task
            topic = self._up_topics[task] = topics.topic_up(self.config.fleet, task, self.device)
        self.session.publish(topic, msg.encode(), timeout=None)

    # -- inspection ---------------------------------------------------------------------
    def personal_prediction(self, task: str, shared: Params, x: np.ndarray) -> np.ndarray:
        """The personalized model's output for raw rows ``x`` (embedded first if the task says so)."""
        state = self.tasks[task]
        algo = self._client(state.spec_json)
        return algo.predict(shared, state.local, self.inputs.encode(task, algo, x))
