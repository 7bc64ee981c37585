"""The trainer's side of serving: read the row feed, answer with the serving model, log, publish.

:class:`Server` lives in ``edge-trainer`` beside the round loop, on its own thread, so a
row is answered while a round trains.  The round loop hands it a candidate model after
each round (:meth:`Server.offer`); the gate decides whether it replaces the serving one.

Ledger: for every row read and every serving task, exactly one of ``answered`` or
``refused[reason]`` is counted (a row read before any task has a model counts once under
the task ``"*"``); the counts are in the trainer's retained status (``serving``).
Here: the answer path and the hand-over.  Apart: the feed (:mod:`~edge.serving.feed_reader`), the
advice (:mod:`~edge.serving.advising`), the gate (:mod:`~edge.serving.gate`), the status
(:mod:`~edge.serving.server_status`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.config import DeviceConfig
from edge.config_serve import AlertRule
from edge.feed import SERVING_DIR
from edge.jsonlog import JsonLinesLog, read_log
from edge.rows import Row
from edge.serving import server_status
from edge.serving.advising import Advising
from edge.serving.alerts import Alerts, Event, rule_problem
from edge.serving.candidates import Choice
from edge.serving.conformal import score as conformal_score
from edge.serving.feed_reader import SAVE_MAX_S, FeedReader
from edge.serving.field import FieldScores
from edge.serving.home_assistant import Announcer, Discovery
from edge.serving.model import Refusal, Refused, ServingModel, load_served
from edge.serving.offers import Offers
from edge.serving.records import Answer
from ioft_protocol import topics

log = logging.getLogger(__name__)

ANSWER_LOG = "answers.jsonl"
#: A feed line that is not a row but a label for an earlier one (``edge.serving.field``).
LABEL_KIND = "label"


class Server(Offers):
    """Answers every row of the feed with each serving task's model (see the module docstring); the
    round loop offers it each round's models (:class:`~edge.serving.offers.Offers`).

    Parameters
    ----------
    config
        The device's config (``[serve]``, its tasks, fleet and id).
    state_dir
        The device's state folder (feed, models, answer log under ``serving/``).
    publish
        ``publish(topic, payload)``: one QoS 1 retained message (called from the serving thread).
    encoder
        ``encoder(name)``: the active ONNX model of that name, or ``None``.
    """

    def __init__(
        self,
        config: DeviceConfig,
        state_dir: Path,
        publish: Callable[[str, bytes], None],
        encoder: Callable[[str], Any] = lambda _name: None,
    ) -> None:
        self.config, self.cfg = config, config.serve
        self.device = config.device
        self.dir = Path(state_dir) / SERVING_DIR
        self.state_dir = Path(state_dir)
        self.publish, self.encoder = publish, encoder
        # Rows come from edge-recorder ([data] source = "state"); simulated devices and the swarm have
        # none, and serve only where told to judge without them (hold_out_always: make demo's printers).
        self.enabled = self.cfg.enabled and (config.data.source == "state" or self.cfg.hold_out_always)
        self.models: dict[str, ServingModel] = {}
        self.answered: Counter[str] = Counter()
        # When these counts (and Moonraker's) began: a restart starts them again, and the console's
        # counters say so with their ``_created`` (cloud_aggregator.console.machines_metrics).
        self.counting_since = time.time()
        self.refused: dict[str, Counter[str]] = {}
        self.gate: dict[str, str] = {}  # task -> the last gate refusal
        self.choices: dict[str, Choice] = {}  # task -> its last round's judgement (the studies read it)
        self.rows = 0
        self.publish_errors = 0
        self.last_latency_s: float | None = None
        self._changed = False
        self._lock = threading.Lock()  # the round loop swaps models while the serving thread answers
        self._said: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.feed = FeedReader(self.state_dir, self.device)
        self._topics: dict[str, str] = {}  # task -> its answer topic
        cfg = self.cfg
        self.answers = JsonLinesLog(
            self.dir / ANSWER_LOG, max_bytes=cfg.log_max_bytes, max_age_s=cfg.log_max_age_s, keep=cfg.log_keep
        )
        self.alerts = Alerts(self.device, cfg.alerts if self.enabled else [], self.dir, cfg.classes)
        self.unchecked: str | None = None  # why the rules' classes were not checked at start (no rows yet)
        self.field = FieldScores(cfg.field_window, cfg.drift_margin, self._calibrate)
        self.advising = Advising(config, self.models, self.serves)
        self.moonraker = self.advising.moonraker
        self.home_assistant = Discovery(config) if self.enabled and cfg.home_assistant else None
        self.announcer = Announcer(
            self.home_assistant, self.dir, self.device, cfg.vibration_budget is not None
        )
        self.watch_lock = threading.Lock()  # field scores and alerts: the serving thread vs the status

    def serves(self, task: str) -> bool:
        """Whether ``task`` answers rows here (``[serve] tasks``; empty: every task the device trains)."""
        trains = not self.config.tasks or task in self.config.tasks
        return self.enabled and trains and (not self.cfg.tasks or task in self.cfg.tasks)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Load the serving models saved by earlier runs and start reading the feed."""
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for task, model in load_served(self.dir, self.device, self.serves).items():
            self.models[task] = model
            log.info("%s: task %s serves its model of round %d", self.device, task, model.round)
            self._announce(task, model)
        self.field.reload(read_log(self.dir / ANSWER_LOG)[0])
        self.feed.open()
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.feed.wake()
        if self._thread is not None:
            self._thread.join(5.0)
        self.feed.close()
        self.advising.close()  # puts the printer's own limit back
        self.answers.close()

    def _run(self) -> None:
        saved_at = time.monotonic()
        while not self._stop.is_set():
            woken = self.feed.wait(self._stop)
            try:
                self.process()
            except Exception:  # a bug here must not stop the serving thread, nor the trainer
                log.exception("%s: serving failed on a row; going on", self.device)
            # The save (an fsync) waits for a quiet moment: after a row it would hold up the next one.
            if not woken or time.monotonic() - saved_at >= SAVE_MAX_S:
                saved_at = time.monotonic()
                self.feed.save()

    # -- answering ----------------------------------------------------------------------
    def process(self) -> int:
        """Answer every row fed since the last call; the number of answers made."""
        made = 0
        for record in self.feed.read():
            if isinstance(record, dict) and record.get("kind") == LABEL_KIND:
                self.label(record)
                continue
            self.rows += 1
            try:
                row = Row.from_dict(record)
            except ValueError as exc:
                self._refuse("*", Refusal.BAD_ROW, str(exc))
                continue
            made += self.answer(row)
        return made

    def answer(self, row: Row) -> int:
        """Answer ``row`` with every serving task's model: log, publish; the answers made."""
        serving = [(t, m) for t, m in list(self.models.items()) if self.serves(t)]
        if not serving:
            self._refuse(
                "*", Refusal.NO_MODEL, "no task has a serving model yet (none has finished a round here)"
            )
            return 0
        made = 0
        for task, model in serving:
            try:
                enc = self.encoder(model.encoder) if model.encoder is not None else None
                ans = model.answer(row, enc, coverage=self.cfg.coverage)
            except Refused as exc:
                if exc.reason is Refusal.NOT_FINITE:
                    with self._lock:  # not served again until a round brings a finite one
                        if self.models.get(task) is model:
                            del self.models[task]
                    self.advising.model_changed(task)
                self._refuse(task, exc.reason, str(exc))
                continue
            ans = self.advising.with_advice(task, model, ans)
            payload = ans.encode()  # once: the log line and the message are the same bytes
            try:
                self.answers.append_line(payload)
            except OSError as exc:
                self.say(task, "log", f"could not write the answer log: {exc}")
            self._send(task, self._answer_topic(task), payload, "an answer")
            self.answered[task] += 1
            self._changed = True
            self.last_latency_s = ans.latency_s
            made += 1
            with self.watch_lock:
                self.field.answered(ans)
                events = self.alerts.observe(ans)
            for event in events:
                self._publish_alert(event)
            if self.advising.maybe_apply(ans):
                self._changed = True
        return made

    def _answer_topic(self, task: str) -> str:
        topic = self._topics.get(task)
        if topic is None:
            topic = self._topics[task] = topics.topic_answer(self.config.fleet, self.device, task)
        return topic

    def _publish_alert(self, event: Event) -> None:
        log.warning("%s: %s", self.device, event.summary())
        self._changed = True
        payload = json.dumps(event.to_dict(), separators=(",", ":")).encode()
        self._send(
            event.task, topics.topic_alert(self.config.fleet, self.device, event.rule), payload, "an alert"
        )

    def _send(self, task: str, topic: str, payload: bytes, what: str) -> None:
        """Publish one message; the transport's errors are counted and said once (nothing is lost:
        answers are in the log, alerts in the status, configs go out again on the next connect)."""
        try:
            self.publish(topic, payload)
        except Exception as exc:
            self.publish_errors += 1
            self.say(task, "publish", f"could not publish {what}: {exc}")

    def _calibrate(self, answer: Answer, truth: float | str) -> None:
        """A labelled answer's score joins its model's calibration while that model serves."""
        model = self.models.get(answer.task)
        if model is not None and model.digest == answer.model.digest:
            model.calibration.add(conformal_score(answer, truth))

    def label(self, record: dict[str, Any]) -> None:
        """A label the recorder fed for an earlier row: score the answers made to it."""
        key, name = record.get("key"), record.get("label")
        if not isinstance(key, str) or not isinstance(name, str):
            self._refuse("*", Refusal.BAD_ROW, f"a label record needs a string key and label: {record!r}")
            return
        with self.watch_lock:
            self.field.label(key, name)
        self._changed = True

    def _refuse(self, task: str, reason: Refusal, message: str) -> None:
        self.refused.setdefault(task, Counter())[reason.value] += 1
        self._changed = True
        self.say(task, reason.value, message)

    def say(self, task: str, what: str, message: str) -> None:
        """Log once per task and kind of trouble (the counts keep growing in the status)."""
        if (task, what) not in self._said:
            self._said.add((task, what))
            log.warning("%s: serving task %s: %s", self.device, task, message)

    # -- Home Assistant -------------------------------------------------------------------
    def discovery(self) -> list[tuple[str, bytes]]:
        """Every Home Assistant config message (:meth:`edge.serving.home_assistant.Announcer.configs`)."""
        tasks = {task: model.classes for task, model in list(self.models.items())}
        return self.announcer.configs(self.cfg.alerts, tasks, self._never_fires)

    def _never_fires(self, rule: AlertRule) -> bool:
        model = self.models.get(rule.task)
        return model is not None and rule_problem(rule, model.classes) is not None

    def _announce(self, task: str, model: ServingModel) -> None:
        """A task's first serving model: tell Home Assistant about its sensors now, not at the next connect."""
        for topic, payload in self.announcer.first_model(task, model.classes):
            self._send(task, topic, payload, "a Home Assistant config")

    # -- status ----------------------------------------------------------------
    def take_changed(self) -> bool:
        """Whether answers, refusals, the serving model or Moonraker's outcome changed since the last call."""
        changed, self._changed = self._changed, False
        return self.advising.moonraker_changed() | changed

    def status(self) -> dict[str, Any]:
        """The serving part of the trainer's retained status (:func:`edge.serving.server_status.status`)."""
        return server_status.status(self)
