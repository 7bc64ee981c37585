"""The trainer's side of serving: read the row feed, answer with the serving model, log, publish.

:class:`Server` lives in ``edge-trainer`` beside the round loop, on its own thread, so a
row is answered while a round trains.  The round loop hands it a candidate model after
each round (:meth:`Server.offer`); the gate decides whether it replaces the serving one.

Ledger: for every row read and every serving task, exactly one of ``answered`` or
``refused[reason]`` is counted (a row read before any task has a model counts once under
the task ``"*"``); the counts are in the trainer's retained status (``serving``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge.config import DeviceConfig
from edge.config_serve import AlertRule
from edge.feed import SERVING_DIR, feed_path, wake_path
from edge.jsonlog import JsonLinesLog, Tail, read_log
from edge.models.onnx import no_worse
from edge.rows import Row
from edge.serving.advice import Advice, ceilings, speed_advice
from edge.serving.alerts import Alerts, Event, rule_problem
from edge.serving.candidates import choose
from edge.serving.conformal import score as conformal_score
from edge.serving.field import MAX_PENDING, FieldScores
from edge.serving.home_assistant import Discovery
from edge.serving.model import Refusal, Refused, ServingModel
from edge.serving.moonraker import MoonrakerApply
from edge.serving.records import Answer
from ioft_protocol import topics
from ioft_protocol.state import StateError, atomic_write_json
from sensors.features.scaling import Standardizer
from sensors.layers import SPEED_SCALE
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset, newest_split
from trainer_lite.params import Params

log = logging.getLogger(__name__)

ANSWER_LOG = "answers.jsonl"
#: The Home Assistant config topics last announced: a later start empties those gone since.
ANNOUNCED = "home-assistant.json"
POSITION_FILE = "feed.pos"
#: A feed line that is not a row but a label for an earlier one (``edge.serving.field``).
LABEL_KIND = "label"
#: Without a wake-up the feed is still read this often (a recorder whose datagram was lost).
POLL_S = 0.5
#: The feed position is saved when no row came for ``POLL_S`` (never between a row and the next),
#: and at least this often under an unbroken stream: a killed trainer answers again at most the
#: rows of the last ``SAVE_MAX_S`` seconds, and loses none.
SAVE_MAX_S = 5.0


def model_path(state_dir: Path, task: str) -> Path:
    return Path(state_dir) / SERVING_DIR / f"{task}.safetensors"


class Server:
    """Answers every row of the feed with each serving task's model (see the module docstring).

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
        # Rows come from edge-recorder ([data] source = "state"); simulated devices and the swarm have none.
        self.enabled = self.cfg.enabled and config.data.source == "state"
        self.models: dict[str, ServingModel] = {}
        self.answered: Counter[str] = Counter()
        # When these counts (and Moonraker's) began: a restart starts them again, and the console's
        # counters say so with their ``_created`` (cloud_aggregator.console.machines_metrics).
        self.counting_since = time.time()
        self.refused: dict[str, Counter[str]] = {}
        self.gate: dict[str, str] = {}  # task -> the last gate refusal
        self.rows = 0
        self.publish_errors = 0
        self.last_latency_s: float | None = None
        self._changed = False
        self._lock = threading.Lock()  # the round loop swaps models while the serving thread answers
        self._said: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._tail: Tail | None = None
        self._saved_pos: tuple[int, int] | None = None
        self._topics: dict[str, str] = {}  # task -> its answer topic
        self.answers = JsonLinesLog(
            self.dir / ANSWER_LOG,
            max_bytes=self.cfg.log_max_bytes,
            max_age_s=self.cfg.log_max_age_s,
            keep=self.cfg.log_keep,
        )
        self.alerts = Alerts(self.device, self.cfg.alerts if self.enabled else [], self.dir, self.cfg.classes)
        self.unchecked: str | None = None  # why the rules' classes were not checked at start (no rows yet)
        self.field = FieldScores(self.cfg.field_window, self.cfg.drift_margin, self._calibrate)
        self.advice: dict[str, tuple[tuple, Advice]] = {}  # task -> ((model digest, ceilings), advice)
        self._apply_refused: str | None = None  # several tasks advise and none is the advice_task
        self.moonraker: MoonrakerApply | None = None
        if self.cfg.apply == "moonraker":
            sensors = config.sensors
            url = self.cfg.moonraker_url or (sensors.moonraker_url if sensors is not None else None)
            key = sensors.moonraker_api_key if sensors is not None else None
            self.moonraker = MoonrakerApply(
                url or "http://127.0.0.1:7125", self.cfg.dry_run, key, self.cfg.max_advice, device=self.device
            )
        self._last_run: str | None = None
        self._moonraker_seen: tuple = ()  # Moonraker's counts at the last take_changed
        self._applied_task: str | None = None  # the task whose advice was last sent
        self.home_assistant = Discovery(config) if self.enabled and self.cfg.home_assistant else None
        self._watch_lock = threading.Lock()  # field scores and alerts: the serving thread vs the status

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
        for path in sorted(self.dir.glob("*.safetensors")):
            task = path.name.removesuffix(".safetensors")
            if not self.serves(task):
                continue
            try:
                model = ServingModel.load(path, device=self.device, task=task)
            except (StateError, ValueError, KeyError, TypeError) as exc:
                log.error("%s: serving model %s not served: %s", self.device, path.name, exc)
                continue
            if model is not None:
                self.models[task] = model
                log.info("%s: task %s serves its model of round %d", self.device, task, model.round)
                self._announce(task, model)
        self._reload_pending()
        self._tail = Tail(feed_path(self.state_dir), self._start_position())
        self._sock = self._bind()
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)
        self._thread.start()

    def _reload_pending(self) -> None:
        """Weld answers from the log, so that a label landing after a restart still scores its answer."""
        records, _ = read_log(self.dir / ANSWER_LOG)
        for record in records[-MAX_PENDING:]:
            if record.get("kind") != "weld":
                continue
            try:
                answer = Answer.from_dict(record)  # reads the old logs' "label" too
            except (ValueError, TypeError):
                continue
            if answer.predicted is not None:
                self.field.answered(answer)

    def _start_position(self) -> tuple[int, int] | None:
        """Where the last run stopped reading the feed; without one, its end (only new rows are answered)."""
        try:
            pos = json.loads((self.dir / POSITION_FILE).read_text())
            return int(pos[0]), int(pos[1])
        except (OSError, ValueError, TypeError, IndexError, KeyError):
            pass
        with contextlib.suppress(OSError):
            st = feed_path(self.state_dir).stat()
            return st.st_ino, st.st_size
        return None

    def _bind(self) -> socket.socket | None:
        path = wake_path(self.state_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            path.unlink(missing_ok=True)
            sock.bind(str(path))
        except OSError as exc:  # a path over 107 bytes, a read-only folder: poll instead
            sock.close()
            log.warning(
                "%s: no wake-up socket at %s (%s); reading the row feed every %.1f s",
                self.device,
                path,
                exc,
                POLL_S,
            )
            return None
        sock.settimeout(POLL_S)
        return sock

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(
                    b"\x00", str(wake_path(self.state_dir))
                )
        if self._thread is not None:
            self._thread.join(5.0)
        self._save_position()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                wake_path(self.state_dir).unlink()
        if self._tail is not None:
            self._tail.close()
        if self.moonraker is not None:
            self.moonraker.close()  # puts the printer's own limit back
        self.answers.close()

    def _run(self) -> None:
        saved_at = time.monotonic()
        while not self._stop.is_set():
            woken = self._wait()
            try:
                self.process()
            except Exception:  # a bug here must not stop the serving thread, nor the trainer
                log.exception("%s: serving failed on a row; going on", self.device)
            # The save (an fsync) waits for a quiet moment: after a row it would hold up the next one.
            if not woken or time.monotonic() - saved_at >= SAVE_MAX_S:
                saved_at = time.monotonic()
                self._save_position()

    def _wait(self) -> bool:
        """Until the recorder wakes us or ``POLL_S`` passes; whether it woke us."""
        if self._sock is None:
            self._stop.wait(POLL_S)
            return False
        with contextlib.suppress(TimeoutError, OSError):
            self._sock.recv(64)
            self._sock.setblocking(False)
            try:
                while True:  # several rows fed since: one read takes them all
                    self._sock.recv(64)
            except (BlockingIOError, OSError):
                pass
            finally:
                self._sock.settimeout(POLL_S)
            return True
        return False

    def _save_position(self) -> None:
        pos = self._tail.position if self._tail is not None else None
        if pos is None or pos == self._saved_pos:
            return
        try:
            atomic_write_json(self.dir / POSITION_FILE, list(pos))
            self._saved_pos = pos
        except OSError as exc:
            log.warning("%s: could not save the feed position: %s", self.device, exc)

    # -- answering ----------------------------------------------------------------------
    def process(self) -> int:
        """Answer every row fed since the last call; the number of answers made."""
        if self._tail is None:
            return 0
        made = 0
        for record in self._tail.read():
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
                    self._advice_changed(task)
                self._refuse(task, exc.reason, str(exc))
                continue
            ans = self._with_advice(task, model, ans)
            payload = ans.encode()  # once: the log line and the message are the same bytes
            try:
                self.answers.append_line(payload)
            except OSError as exc:
                self._say(task, "log", f"could not write the answer log: {exc}")
            try:
                self.publish(self._answer_topic(task), payload)
            except Exception as exc:  # the transport's errors: the answer is in the log anyway
                self.publish_errors += 1
                self._say(task, "publish", f"could not publish an answer: {exc}")
            self.answered[task] += 1
            self._changed = True
            self.last_latency_s = ans.latency_s
            made += 1
            with self._watch_lock:
                self.field.answered(ans)
                events = self.alerts.observe(ans)
            for event in events:
                self._publish_alert(event)
            self._maybe_apply(ans)
        return made

    def _answer_topic(self, task: str) -> str:
        topic = self._topics.get(task)
        if topic is None:
            topic = self._topics[task] = topics.topic_answer(self.config.fleet, self.device, task)
        return topic

    # -- advice, alerts, field scores -----------------------------------------------------
    def advice_for(self, task: str, model: ServingModel) -> Advice | None:
        """The speed advice of ``model`` under ``[serve] vibration_budget`` (``None``: no budget), under
        the least of its ceilings known now (cached per model and ceilings)."""
        budget = self.cfg.vibration_budget
        if budget is None:
            return None
        printer_max = self.moonraker.printer_max if self.moonraker is not None else None
        limits = ceilings(model, self.cfg.max_advice, printer_max)
        # The conservative edge: the interval's lower end at this coverage (it narrows as labels come).
        margin = model.speed_margin(self.cfg.coverage)
        key = (model.digest, tuple(sorted(limits.items())), margin)
        cached = self.advice.get(task)
        if cached is None or cached[0] != key:
            if margin is None:
                advice = Advice(
                    None,
                    f"too few labelled layers to bound its answers at {self.cfg.coverage:.0%} coverage "
                    f"(its interval is not calibrated yet)",
                )
            else:
                try:
                    advice = speed_advice(model, budget, self.cfg.min_advice, margin=margin, ceiling=limits)
                except Refused as exc:
                    advice = Advice(None, f"the model cannot answer: {exc}")
            cached = self.advice[task] = (key, advice)
        return cached[1]

    def _with_advice(self, task: str, model: ServingModel, ans: Answer) -> Answer:
        advice = self.advice_for(task, model) if ans.kind == "layer" else None
        if advice is None or advice.speed is None:
            return ans
        ans.extra["advice"] = {"speed": advice.speed, "vibration_budget": self.cfg.vibration_budget}
        return ans  # its extra is its own: ServingModel.answer made it

    def advice_task(self) -> str | None:
        """The task whose advice goes to the printer: ``[serve] advice_task``, else the only printer
        task serving here (several and none configured: none, and the status says so)."""
        if self.cfg.advice_task is not None:
            return self.cfg.advice_task
        printers = sorted(t for t, m in list(self.models.items()) if m.classes is None and self.serves(t))
        if len(printers) > 1:
            if self._apply_refused is None:
                self._apply_refused = (
                    f"tasks {', '.join(printers)} all advise and serve.advice_task is unset: nothing is "
                    "applied until it names one"
                )
                log.error("%s: %s", self.device, self._apply_refused)
            return None
        self._apply_refused = None
        return printers[0] if printers else None

    def _maybe_apply(self, ans: Answer) -> None:
        """The advice to Moonraker once per print run, at its first answered layer (queued: the
        worker thread talks to Moonraker, never this one)."""
        advice = ans.extra.get("advice")
        if self.moonraker is None or advice is None or ans.task != self.advice_task():
            return
        run = ans.key.rsplit("/", 1)[0]
        if run == self._last_run:
            return
        self._last_run, self._applied_task = run, ans.task
        self.moonraker.apply(run, float(advice["speed"]))
        self._changed = True

    def _advice_changed(self, task: str) -> None:
        """``task``'s serving model changed: if the applied task no longer advises, restore the printer."""
        if self.moonraker is None or task != self._applied_task:
            return
        model = self.models.get(task)
        advice = self.advice_for(task, model) if model is not None else None
        if advice is None or advice.speed is None:
            self._last_run = None  # the next print run gets the advice again, if any comes back
            self.moonraker.restore(f"task {task}'s serving model stopped advising")

    def _publish_alert(self, event: Event) -> None:
        log.warning(
            "%s: alert %s %s (task %s: %d of the last %d rows %s %g; row %s read %g)",
            self.device,
            event.rule,
            event.state,
            event.task,
            event.votes,
            event.n,
            "over" if event.state == "raised" else "at or below",
            event.threshold,
            event.key,
            event.value,
        )
        self._changed = True
        try:
            self.publish(
                topics.topic_alert(self.config.fleet, self.device, event.rule),
                json.dumps(event.to_dict(), separators=(",", ":")).encode(),
            )
        except Exception as exc:  # the transport's errors: the open alert is in the status anyway
            self.publish_errors += 1
            self._say(event.task, "publish", f"could not publish an alert: {exc}")

    def _never_fires(self, rule: AlertRule) -> bool:
        model = self.models.get(rule.task)
        return model is not None and rule_problem(rule, model.classes) is not None

    def rule_status(self) -> dict[str, dict[str, Any]]:
        """Each alert rule, its words, and why it cannot fire (yet), if so: the status's ``rules``."""
        out = {}
        for rule in self.cfg.alerts if self.enabled else []:
            model = self.models.get(rule.task)
            if not self.serves(rule.task):
                silent = f"task {rule.task} does not serve here ([serve] tasks)"
            elif model is None:
                silent = f"task {rule.task} has no serving model yet"
            else:
                silent = rule_problem(rule, model.classes)
                if silent is not None:
                    self._say(rule.task, f"rule {rule.name}", f"alert rule never fires: {silent}")
            action, meaning = self.alerts.words(rule)
            out[rule.name] = {"task": rule.task, "value": rule.value, "above": rule.above,
                              "action": action, "meaning": meaning, "silent": silent}  # fmt: skip
        return out

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
        with self._watch_lock:
            self.field.label(key, name)
        self._changed = True

    def _refuse(self, task: str, reason: Refusal, message: str) -> None:
        self.refused.setdefault(task, Counter())[reason.value] += 1
        self._changed = True
        self._say(task, reason.value, message)

    def _say(self, task: str, what: str, message: str) -> None:
        """Log once per task and kind of trouble (the counts keep growing in the status)."""
        if (task, what) not in self._said:
            self._said.add((task, what))
            log.warning("%s: serving task %s: %s", self.device, task, message)

    # -- the round loop's hand-over and the gate -----------------------------------------
    def offer(
        self,
        task: str,
        algo: ClientAlgorithm,
        shared: Params,
        local: Params,
        rows: tuple[Dataset, Dataset, int | None] | None,
        raw: tuple[Dataset, Dataset, dict],
        round_: int,
        scaler: Standardizer | None = None,
    ) -> bool:
        """The round's models as candidates (:mod:`edge.serving.candidates`); ``True`` if one now
        serves ``task``.

        ``rows``: the task's rows before scaling (embedded, where the task embeds) and the encoder
        version; the newest of the training split (:meth:`holdout`) judge, the round did not train on them;
        ``raw``: the dataset's splits as stored and its metadata; ``scaler``: the transform the round
        trained through (the daemon's; a ``scaling = "local"`` task without one is fitted here on the
        training rows), kept with the model so that its answers see rows as training did.
        """
        if not self.serves(task) or rows is None:
            return False
        train, _, encoder_version = rows
        raw_train, _, meta = raw
        fit = self.holdout(train)[0]  # embedded where the task embeds: what its models train on
        # As stored: the rows its models trained on, and the newest, which judge them (row for row the same).
        raw_fit, newest = self.holdout(raw_train)
        source = algo.spec.hparams.get("features")
        if scaler is None and algo.scaling == "local" and len(fit):
            scaler = Standardizer.fit(fit.x)
        if scaler is None and algo.scaling == "fleet":
            return False  # trained through no transform yet: nothing to serve
        personal = ServingModel(
            device=self.device,
            task=task,
            spec_json=algo.spec.to_json(),
            round=round_,
            shared=dict(shared),
            local=dict(local),
            width=int(raw_train.x.shape[1]),
            schema_hash=meta.get("schema_hash"),
            classes=list(meta["classes"]) if isinstance(meta.get("classes"), list) else None,
            encoder=source.split(":", 1)[1] if isinstance(source, str) and ":" in source else None,
            encoder_version=encoder_version,
            scale_mean=None if scaler is None else scaler.mean,
            scale_std=None if scaler is None else scaler.std,
            _algo=algo,
        )
        candidate, evidence = choose(
            personal, algo, shared, fit, newest, scaler, self.state_dir, self.encoder, self.cfg.min_judge_rows
        )
        if candidate.classes is None and len(raw_fit):  # the speed advice's bounds (edge.serving.advice)
            candidate.speed_max = float(np.max(raw_fit.y)) * SPEED_SCALE
            candidate.sigma_min = float(np.min(raw_fit.x[:, 0])) if candidate.width == 1 else None
        enc = self.encoder(candidate.encoder) if candidate.encoder is not None else None
        score, name = candidate.metric, candidate.metric_name
        if not any(v is not None for v in evidence["scores"].values()) and len(newest):
            return self._gate_refuses(task, round_, "no candidate can be scored on the newest rows")
        if score is not None and not math.isfinite(score):
            return self._gate_refuses(task, round_, "its answers on the newest rows are not finite")
        current = self.models.get(task)
        if current is not None and score is not None and current.encoder_version == encoder_version:
            try:
                old, _ = current.score(newest, enc)  # today's rows: both judged on the same ones
            except Refused:
                old = None
            if old is not None and not no_worse(score, old, self.cfg.margin):
                return self._gate_refuses(
                    task,
                    round_,
                    f"its best candidate ({candidate.candidate}) scores {name} {score:.4f} on the newest rows, "
                    f"below the serving round {current.round}'s {old:.4f} by more than the margin "
                    f"{self.cfg.margin}; round {current.round} keeps serving",
                )
        candidate.reference = score if candidate.classes is not None else candidate.test_error(newest, enc)
        candidate.calibrate(raw_fit, newest, enc)  # the trained range, the first interval's rows
        try:
            candidate.save(model_path(self.state_dir, task))
        except OSError as exc:
            log.error(
                "%s: could not save task %s's serving model (%s); the old one keeps serving",
                self.device,
                task,
                exc,
            )
            return False
        with self._lock:
            self.models[task] = candidate  # one assignment: a row is answered by the old model or the new
        self.gate.pop(task, None)
        self._changed = True
        self._advice_changed(task)
        if current is None:
            self._announce(task, candidate)
        log.info(
            "%s: task %s now serves its model of round %d, %s: the %s candidate (%s)",
            self.device,
            task,
            round_,
            candidate.digest,
            candidate.candidate,
            evidence["why"],
        )
        return True

    def answering(self, task: str) -> bool:
        """Whether ``task``'s rows are answered here: it serves, and edge-recorder has fed rows.

        Only then does a round train without its newest rows (they judge the candidates): a
        device that answers nothing keeps every row for training, as the fleet's simulations do.
        """
        return self.serves(task) and feed_path(self.state_dir).exists()

    def holdout(self, train: Dataset) -> tuple[Dataset, Dataset]:
        """``(the rows a round trains on, the newest ones that judge its candidates)`` of ``train``."""
        return newest_split(train, self.cfg.holdout_fraction)

    def _gate_refuses(self, task: str, round_: int, why: str) -> bool:
        self.gate[task] = f"round {round_}: {why}"
        self._changed = True
        log.warning("%s: task %s: the model of round %d does not serve: %s", self.device, task, round_, why)
        return False

    # -- Home Assistant -------------------------------------------------------------------
    def _task_discovery(self, ha: Discovery, task: str, model: ServingModel) -> list[tuple[str, bytes]]:
        return ha.task(task, model.classes, self.cfg.vibration_budget is not None and model.classes is None)

    def discovery(self) -> list[tuple[str, bytes]]:
        """Every Home Assistant config message (published retained on each connect), and an empty one
        for each entity announced before and gone now (a rule removed from the config, discovery
        turned off): Home Assistant then removes it."""
        out: list[tuple[str, bytes]] = []
        if self.home_assistant is not None:
            # A rule its task's model shows can never fire is not announced (nor kept, if it was).
            out = [self.home_assistant.alert(r) for r in self.cfg.alerts if not self._never_fires(r)]
            for task, model in list(self.models.items()):
                out += self._task_discovery(self.home_assistant, task, model)
        now = {t for t, _ in out}
        gone = sorted(self._announced() - now)
        self._remember(now)
        return out + [(t, b"") for t in gone]

    def _announced(self) -> set[str]:
        """The config topics this device announced last (``serving/home-assistant.json``)."""
        try:
            return {str(t) for t in json.loads((self.dir / ANNOUNCED).read_text())}
        except (OSError, ValueError, TypeError):
            return set()

    def _remember(self, announced: set[str]) -> None:
        path = self.dir / ANNOUNCED
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(announced)))
            tmp.replace(path)
        except OSError as exc:  # the next start re-announces everything anyway; only removals are lost
            log.warning("%s: could not record the Home Assistant configs in %s: %s", self.device, path, exc)

    def _announce(self, task: str, model: ServingModel) -> None:
        """A task's first serving model: tell Home Assistant about its sensors now, not at the next connect."""
        if self.home_assistant is None:
            return
        configs = self._task_discovery(self.home_assistant, task, model)
        self._remember(self._announced() | {t for t, _ in configs})
        for topic, payload in configs:
            try:
                self.publish(topic, payload)
            except Exception as exc:  # the transport's errors: the next connect publishes them again
                self.publish_errors += 1
                self._say(task, "publish", f"could not publish a Home Assistant config: {exc}")

    # -- status -------------------------------------------------------------------------
    def take_changed(self) -> bool:
        """Whether answers, refusals, the serving model or Moonraker's outcome changed since the last call."""
        changed, self._changed = self._changed, False
        if self.moonraker is not None:  # its worker thread fails or sends after the answer went out
            m = self.moonraker
            now = (m.sent, m.would_send, m.failed, m.restored, m.refused, m.last_error)
            changed |= now != self._moonraker_seen
            self._moonraker_seen = now
        return changed

    def _moonraker_status(self) -> dict[str, Any]:
        assert self.moonraker is not None
        out = self.moonraker.status() | {"advice_task": self.advice_task()}
        if self._apply_refused is not None and out["refused"] is None:
            out["refused"] = self._apply_refused
        return out

    def status(self) -> dict[str, Any]:
        """The serving part of the trainer's retained status."""
        if not self.enabled:
            return {"enabled": False}
        with self._watch_lock:
            field = self.field.status({t: m.reference for t, m in list(self.models.items())})
            alerts, unknown = self.alerts.status(), self.field.unknown_labels
        return {
            "enabled": True,
            "rows": self.rows,
            "answered": dict(self.answered),
            "refused": {t: dict(c) for t, c in self.refused.items()},
            "counting_since": self.counting_since,
            "models": {
                t: {
                    "round": m.round,
                    "digest": m.digest,
                    "metric": m.metric,
                    "metric_name": m.metric_name,
                    "encoder": m.encoder,
                    "encoder_version": m.encoder_version,
                    "since": m.created_at,
                    "calibration_rows": len(m.calibration),
                    "candidate": m.candidate,
                    "evidence": m.evidence,
                    "reference": m.reference,  # None: no test figure, so no drift is ever told
                }
                for t, m in list(self.models.items())
            },
            "gate": dict(self.gate),
            "field": field,
            "unknown_labels": unknown,
            "advice": {
                t: {**a.to_dict(), "vibration_budget": self.cfg.vibration_budget}
                for t, m in list(self.models.items())
                if m.classes is None and (a := self.advice_for(t, m)) is not None
            },
            **({"moonraker": self._moonraker_status()} if self.moonraker is not None else {}),
            "alerts": alerts,
            "alerts_untrusted": self.alerts.untrusted,
            "rules": self.rule_status(),
            **({"rules_unchecked": self.unchecked} if self.unchecked else {}),
            "classes": dict(self.cfg.classes),
            "publish_errors": self.publish_errors,
            "skipped_lines": self._tail.skipped if self._tail is not None else 0,
            "last_latency_s": self.last_latency_s,
        }
