"""The round loop's hand-over to serving: each round's models judged, gated and installed.

:class:`Offers` is the part of :class:`edge.serving.server.Server` the daemon's round loop calls:
:meth:`~Offers.answering` and :meth:`~Offers.holdout` before a round trains (which rows judge),
:meth:`~Offers.offer` after it (the candidates of :mod:`edge.serving.candidates`, the gate of
:mod:`edge.serving.gate`, the winner saved and swapped in) and :meth:`~Offers.served_metrics` for the
round's report.  It reads and writes the server's state, declared below.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge.config_serve import ServeConfig
from edge.feed import SERVING_DIR, feed_path
from edge.serving import gate
from edge.serving.advising import Advising
from edge.serving.candidates import ORDER as CANDIDATES
from edge.serving.candidates import Choice, choose
from edge.serving.model import Refused, ServingModel
from sensors.features.scaling import Standardizer
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset, newest_split
from trainer_lite.params import Params

log = logging.getLogger(__name__)


def model_path(state_dir: Path, task: str) -> Path:
    return Path(state_dir) / SERVING_DIR / f"{task}.safetensors"


class Offers:
    """The round loop's side of :class:`edge.serving.server.Server` (which sets what is declared here)."""

    cfg: ServeConfig
    device: str
    state_dir: Path
    models: dict[str, ServingModel]
    gate: dict[str, str]
    choices: dict[str, Choice]
    advising: Advising
    encoder: Callable[[str], Any]
    _changed: bool
    _lock: threading.Lock
    serves: Callable[[str], bool]
    say: Callable[[str, str, str], None]
    _announce: Callable[[str, ServingModel], None]

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
        A task whose models cannot answer a row on their own (``algo.answers_rows``: FedDAR's need
        each row's domain) is not judged at all, and one whose models fail here (a ``ValueError``)
        serves nothing: either way the status's ``gate`` says why, and the round goes on.
        """
        if not self.serves(task) or rows is None:
            return False
        if not algo.answers_rows:
            return self._cannot_serve(
                task, round_, f"{algo.name} answers with each row's domain, which rows do not carry"
            )
        try:
            return self._offer(task, algo, shared, local, rows, raw, round_, scaler)
        except ValueError as exc:
            return self._cannot_serve(task, round_, str(exc))

    def _cannot_serve(self, task: str, round_: int, why: str) -> bool:
        self.gate[task] = f"round {round_}: its models cannot serve here: {why}"
        self._changed = True
        self.say(task, "cannot_serve", f"its models cannot serve here: {why}")
        return False

    def _offer(
        self,
        task: str,
        algo: ClientAlgorithm,
        shared: Params,
        local: Params,
        rows: tuple[Dataset, Dataset, int | None],
        raw: tuple[Dataset, Dataset, dict],
        round_: int,
        scaler: Standardizer | None,
    ) -> bool:
        train, _, encoder_version = rows
        raw_train, _, meta = raw
        fit = self.holdout(train)[0]  # embedded where the task embeds: what its models train on
        # As stored: the rows its models trained on, and the newest, which judge them (row for row the same).
        raw_fit, newest = self.holdout(raw_train)
        if scaler is None and algo.scaling == "local" and len(fit):
            scaler = Standardizer.fit(fit.x)
        if scaler is None and algo.scaling == "fleet":
            return False  # trained through no transform yet: nothing to serve
        personal = gate.personal_model(
            self.device, task, algo, (shared, local), (raw_train, meta), round_, encoder_version, scaler
        )
        judging = (self.state_dir, self.encoder, self.cfg.min_judge_rows)
        choice = self.choices[task] = choose(
            personal, algo, shared, fit, newest, scaler, *judging, every=train
        )
        candidate, evidence = choice.serving, choice.evidence
        # The alone copy on every row has seen the newest rows: its twin, which has not, stands in for
        # it wherever they judge (its reference figure, its first interval's residuals).
        twin = candidate.judged_by
        seen, judged = (raw_train, twin) if twin is not None else (raw_fit, candidate)
        gate.bound_speed(candidate, seen)
        enc = self.encoder(candidate.encoder) if candidate.encoder is not None else None
        current = self.models.get(task)
        # The same rows and the same training that chose the serving model: the gate then measures
        # by the training rows' constant answer, not by the serving model's score (gate.refusal).
        judgement = gate.judgement(newest, algo.spec.to_json())
        stale = None
        if current is not None and current.judged_on == judgement:
            stale = gate.constant_answer(raw_fit, candidate.classes is not None)
        why = gate.refusal(candidate, evidence, current, newest, enc, encoder_version, self.cfg.margin, stale)
        if why is not None:
            return self._gate_refuses(task, round_, why)
        score = candidate.metric
        candidate.reference = score if candidate.classes is not None else judged.test_error(newest, enc)
        candidate.calibrate(seen, newest, enc, judged)  # the trained range, the first interval's rows
        candidate.judged_on = judgement
        return self._install(task, candidate, current, round_, evidence)

    def _install(
        self,
        task: str,
        candidate: ServingModel,
        current: ServingModel | None,
        round_: int,
        evidence: dict[str, Any],
    ) -> bool:
        """Save ``candidate`` and serve it from the next row on; ``False`` if it could not be saved."""
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
        self.advising.model_changed(task)
        if current is None:
            self._announce(task, candidate)
        log.info(
            "%s: task %s now serves its model of round %d, %s: the %s candidate (%s)",
            self.device,
            task,
            round_,
            candidate.digest,
            candidate.candidate,
            "; ".join(filter(None, (evidence["why"], evidence.get("serves")))),
        )
        return True

    def answering(self, task: str) -> bool:
        """Whether ``task``'s rows are answered here: it serves, and edge-recorder has fed rows (or
        ``[serve] hold_out_always``).

        Only then does a round train without its newest rows (they judge the candidates): a
        device that answers nothing keeps every row for training, as the fleet's simulations do.
        """
        return self.serves(task) and (self.cfg.hold_out_always or feed_path(self.state_dir).exists())

    def served_metrics(self, task: str, test: Dataset) -> dict[str, float]:
        """What serves ``task`` now, as the round's report gives it: ``served_test_*`` (the task's
        metrics of the serving model on the ``test`` split as stored, beside the personal model's
        ``test_*``), ``serves_<candidate>``, 1 for the one that serves and 0 for the others (a
        fleet mean is the share of serving devices that serve it), and ``served_round``, the round
        of the serving model.  Empty while nothing serves;
        without the ``served_test_*`` if the serving model cannot be run on the test split."""
        model = self.models.get(task)
        if model is None or not self.serves(task):
            return {}
        out = {f"serves_{name}": float(name == model.candidate) for name in CANDIDATES}
        out["served_round"] = float(model.round)  # older than the report's: the gate kept it
        try:
            enc = self.encoder(model.encoder) if model.encoder is not None else None
            scores = model.evaluate(test, enc)
        except Refused as exc:  # an encoder gone since: the share is still true
            self.say(task, "served_metrics", f"the serving model cannot be scored on the test split: {exc}")
            return out
        return out | {f"served_test_{k}": float(v) for k, v in scores.items()}

    def holdout(self, train: Dataset) -> tuple[Dataset, Dataset]:
        """``(the rows a round trains on, the newest ones that judge its candidates)`` of ``train``."""
        return newest_split(train, self.cfg.holdout_fraction)

    def _gate_refuses(self, task: str, round_: int, why: str) -> bool:
        self.gate[task] = f"round {round_}: {why}"
        self._changed = True
        log.warning("%s: task %s: the model of round %d does not serve: %s", self.device, task, round_, why)
        return False
