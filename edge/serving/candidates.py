"""Which model a machine serves for a task: the best of its candidates on its own newest rows.

After each round the device has three models of a task (the *candidates*):

``personal``
    the algorithm's personalized model of the round;
``global``
    the fleet's model as a device that never trained would run it: the shared parameters as
    received, with the personal parts the algorithm starts a newcomer from
    (:meth:`~trainer_lite.algorithms.base.ClientAlgorithm.cold_start` of its seeded start on the
    device's rows; for FedAvg the global model itself, for PFL-DA the global decoder with an
    encoder fitted through it).  Algorithms that share nothing (``indiv``) have none;
``alone``
    the task's model trained on this device's rows only, kept current cheaply: a few optimizer
    steps (the task's ``local_steps``) each round from its last state, in two copies
    (:mod:`edge.serving.alone`): one on the older rows, which is judged, and one on every row,
    which serves when the judged one wins (``every_row`` in its status; the evidence's ``serves``).

Each is judged on the newest rows of the device's training split (:func:`trainer_lite.data.newest_split`),
which no candidate was trained on (on a device that answers rows, the daemon trains the round on
the older ones: :meth:`edge.serving.offers.Offers.answering`): accuracy, or
R².  The best *record* serves: each round's score joins the candidate's earlier ones with weight
``MEMORY`` per round of age (kept in ``serving/judge/<task>.json``), because one round's few newest
rows are a noisy judge (``benchmarks/results/field_accuracy.md``: on a single round's ten rows the
served choice flip-flopped between rounds and missed the field's best by up to 131 %).  With fewer than ``[serve] min_judge_rows`` newest rows there is no fair
judgement, and the fleet's model (through the cold start) serves; the evidence says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from edge.feed import SERVING_DIR
from edge.serving.alone import EVERY, train_alone
from edge.serving.model import Refused, ServingModel
from sensors.features.scaling import Standardizer
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.algorithms.base import algorithm_state
from trainer_lite.client import cast_dataset, derive_rng, initial_local
from trainer_lite.data import Dataset
from trainer_lite.params import Params

log = logging.getLogger(__name__)

PERSONAL, GLOBAL, ALONE = "personal", "global", "alone"
#: Ties go to the first: the round's own model, then the fleet's.
ORDER = (PERSONAL, GLOBAL, ALONE)
JUDGE_DIR = "judge"
#: The weight of a candidate's score one round older (``remember``): 0 judges on this round's rows
#: alone.  Measured on ``field_accuracy``'s fleet over 0.3-0.9, with and without a switching margin:
#: 0.3 is the only one better than none on both machine kinds (longer memories keep a model that
#: the fleet has since overtaken; a margin kept the losing one longer).
MEMORY = 0.3


def global_local(algo: ClientAlgorithm, device: str, shared: Params, rows: Dataset) -> Params:
    """The personal parts a newcomer would run the fleet's ``shared`` with (:mod:`trainer_lite.holdout`'s rule)."""
    local = algorithm_state(initial_local(algo, device))
    if len(rows):
        rng = derive_rng(algo.spec.seed, device, "holdout")
        local = algo.cold_start(shared, local, cast_dataset(rows, algo.spec.dtype), rng=rng, phase="train")
    return local


def scaled(rows: Dataset, scaler: Standardizer | None) -> Dataset:
    if scaler is None or not len(rows):
        return rows
    return Dataset(scaler.transform(rows.x, np.result_type(rows.x.dtype, np.float32)), rows.y, rows.domain)


def make_candidates(
    personal: ServingModel,
    algo: ClientAlgorithm,
    shared: Params,
    rows: tuple[Dataset, Dataset],
    scaler: Standardizer | None,
    state_dir: Path,
) -> tuple[dict[str, ServingModel], ServingModel]:
    """The task's candidates (module docstring), built from the round's ``personal`` model, and the
    alone copy on every row, which serves in the judged ``alone``'s place (:func:`serving`).  ``rows``:
    the rows the round trained on and every row of the training split (before scaling, embedded where
    the task embeds)."""
    fit, every = (scaled(r, scaler) for r in rows)
    out = {PERSONAL: personal}
    if algo.shared_names():
        out[GLOBAL] = dataclasses.replace(
            personal,
            candidate=GLOBAL,
            shared=dict(shared),
            local=global_local(algo, personal.device, shared, fit),
            _digest=None,
        )
    whose = (state_dir, personal.device, personal.task, algo.spec)
    alone_algo, params = train_alone(*whose, fit, personal.round)
    judged = out[ALONE] = dataclasses.replace(
        personal,
        candidate=ALONE,
        spec_json=alone_algo.spec.to_json(),
        shared={},
        local=params,
        _algo=alone_algo,
        _digest=None,
    )
    _, params = train_alone(*whose, every, personal.round, EVERY)
    return out, dataclasses.replace(judged, local=params, every_row=True, judged_by=judged, _digest=None)


def serving(
    chosen: ServingModel, every_row: ServingModel, evidence: dict[str, Any], rows: tuple[int, int]
) -> ServingModel:
    """What serves for the judge's ``chosen``: when it is ``alone``, the copy on ``every_row`` in its
    place (``rows``: how many rows each copy trained on), and the evidence says so."""
    if chosen.candidate != ALONE:
        return chosen
    evidence["serves"] = (
        f"the alone copy trained on all {rows[1]} rows, judged by its twin trained on the older {rows[0]}"
    )
    return every_row


def remember(
    scores: dict[str, float | None], record: dict[str, list[float]], memory: float = MEMORY
) -> dict[str, float | None]:
    """Each candidate's record after this round's ``scores`` (``record`` is updated in place): the
    mean of its scores, each weighted ``memory ** age`` in rounds.  A candidate that could not be
    scored this round has no record this round (and keeps its old one)."""
    out: dict[str, float | None] = {}
    for name, score in scores.items():
        if score is None:
            out[name] = None
            continue
        total, weight = record.get(name, (0.0, 0.0))
        record[name] = [score + memory * total, 1.0 + memory * weight]
        out[name] = record[name][0] / record[name][1]
    return out


def judge_path(state_dir: Path, task: str) -> Path:
    return Path(state_dir) / SERVING_DIR / JUDGE_DIR / f"{task}.json"


def load_record(state_dir: Path, task: str) -> dict[str, list[float]]:
    """The task's judging record (``remember``); empty when there is none or it is unreadable."""
    try:
        got = json.loads(judge_path(state_dir, task).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(got, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)
        for v in got.values()
    )
    return {k: [float(x) for x in v] for k, v in got.items()} if ok else {}


def save_record(state_dir: Path, task: str, record: dict[str, list[float]]) -> None:
    path = judge_path(state_dir, task)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
    except OSError as exc:  # the next round judges on its own rows: worse, not wrong
        log.warning("could not save task %s's judging record: %s", task, exc)


def judge(
    candidates: dict[str, ServingModel],
    rows: Dataset,
    encoder: Any,
    min_rows: int,
    record: dict[str, list[float]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(the winner's name, the evidence)``: each candidate's score (and mean |error| in mm/s for
    speeds) on ``rows``, the newest ones none was trained on; with ``record``, the best record
    (``remember``) wins, and ``record`` takes this round's scores (module docstring)."""
    scores: dict[str, float | None] = {}
    errors: dict[str, float | None] = {}
    metric = "none"
    for name, model in candidates.items():
        try:
            score, metric_name = model.score(rows, encoder)
            error = model.test_error(rows, encoder)
        except Refused as exc:
            log.warning("%s: task %s's %s model cannot be judged: %s", model.device, model.task, name, exc)
            score, error, metric_name = None, None, metric
        metric = metric_name if metric_name != "none" else metric
        scores[name] = None if score is None or not math.isfinite(score) else round(score, 6)
        errors[name] = None if error is None else round(error, 4)
    evidence: dict[str, Any] = {"rows": len(rows), "min_rows": min_rows, "metric": metric, "scores": scores}
    if any(v is not None for v in errors.values()):
        evidence["errors"] = errors
    fallback = GLOBAL if GLOBAL in candidates else PERSONAL
    if len(rows) < min_rows:
        evidence["why"] = (
            f"{len(rows)} newest rows held out, fewer than the {min_rows} needed to judge: "
            f"the fleet's model serves through the cold start"
            if fallback == GLOBAL
            else f"{len(rows)} newest rows held out, fewer than the {min_rows} needed to judge"
        )
        return fallback, evidence
    ranked = scores
    if record is not None:
        ranked = remember(scores, record)
        evidence["record"] = {n: None if v is None else round(v, 6) for n, v in ranked.items()}
    judged = [(ranked[n], -ORDER.index(n), n) for n in candidates if ranked[n] is not None]
    if not judged:
        evidence["why"] = "no candidate could be scored on the newest rows"
        return fallback, evidence
    best = max(judged)[2]
    evidence["why"] = (
        f"best {metric} on the {len(rows)} newest rows"
        if record is None
        else f"best {metric} record (this round's {len(rows)} newest rows, earlier rounds' × {MEMORY} a round)"
    )
    return best, evidence


class Choice(NamedTuple):
    """One round's judgement: the model that serves for it (its score set), the judge's evidence, and
    the candidates it chose among (``alone`` the judged copy; ``every_row`` the copy that serves in
    its place)."""

    serving: ServingModel
    evidence: dict[str, Any]
    candidates: dict[str, ServingModel]
    every_row: ServingModel


def choose(
    personal: ServingModel,
    algo: ClientAlgorithm,
    shared: Params,
    fit: Dataset,
    newest: Dataset,
    scaler: Standardizer | None,
    state_dir: Path,
    encoder: Callable[[str], Any],
    min_rows: int,
    every: Dataset | None = None,
) -> Choice:
    """The model that serves ``personal``'s task, and what chose it (:class:`Choice`).  ``fit``: the
    rows the round trained on, ``every``: every row of the training split (default ``fit``), both
    before scaling, embedded where the task embeds; ``newest``: the rows that judge, as stored."""
    every = fit if every is None else every
    candidates, every_row = make_candidates(personal, algo, shared, (fit, every), scaler, state_dir)
    enc = encoder(personal.encoder) if personal.encoder is not None else None
    record = load_record(state_dir, personal.task)
    name, evidence = judge(candidates, newest, enc, min_rows, record)
    save_record(state_dir, personal.task, record)
    chosen = serving(candidates[name], every_row, evidence, (len(fit), len(every)))
    chosen.metric, chosen.metric_name = evidence["scores"].get(name), evidence["metric"]
    chosen.evidence = evidence
    return Choice(chosen, evidence, candidates, every_row)
