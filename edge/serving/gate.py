"""The gate's pure parts: the round's personal model as a candidate, and why the best one may not serve.

:meth:`edge.serving.offers.Offers.offer` builds the round's personal model
(:func:`personal_model`), lets :func:`edge.serving.candidates.choose` pick the best candidate on
the newest rows, and asks :func:`refusal` whether it may replace the model serving now.

On rows that came since the serving model was chosen, the margin decides.  On the very rows and
training that chose it (*stale*, :func:`judgement`: no row has come since, the spec is the same) its
score is the best of every model it beat there, an optimistic figure, and a newer candidate that
scores below it has not shown itself worse on any row it was not picked by: ``make demo``'s printer3
(its rows never change) kept its round-28 model for 190 rounds, 0.909 on its test split against 0.097
for its latest.  There the serving model is kept only against a candidate that does worse than the
training rows' constant answer where the serving model does better: a training that cannot learn
(``tests/e2e/test_serving.py``), not a model that fits the same rows a little worse.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edge.models.onnx import no_worse
from edge.serving.model import Refused, ServingModel, r2
from sensors.features.scaling import Standardizer
from sensors.layers import SPEED_SCALE
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset
from trainer_lite.params import Params, param_hash


def personal_model(
    device: str,
    task: str,
    algo: ClientAlgorithm,
    params: tuple[Params, Params],
    raw: tuple[Dataset, dict],
    round_: int,
    encoder_version: int | None,
    scaler: Standardizer | None,
) -> ServingModel:
    """The round's personalized model (``params``: shared and local) as a serving model of the
    rows ``raw`` (the training split as stored, and the dataset's metadata)."""
    shared, local = params
    raw_train, meta = raw
    source = algo.spec.hparams.get("features")
    return ServingModel(
        device=device,
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


def bound_speed(candidate: ServingModel, raw_fit: Dataset) -> None:
    """The speed advice's bounds (:mod:`edge.serving.advice`) from the rows a printer's model trained on."""
    if candidate.classes is None and len(raw_fit):
        candidate.speed_max = float(np.max(raw_fit.y)) * SPEED_SCALE
        candidate.sigma_min = float(np.min(raw_fit.x[:, 0])) if candidate.width == 1 else None


def refusal(
    candidate: ServingModel,
    evidence: dict[str, Any],
    current: ServingModel | None,
    newest: Dataset,
    enc: Any,
    encoder_version: int | None,
    margin: float,
    stale: np.ndarray | None = None,
) -> str | None:
    """Why ``candidate`` does not replace ``current`` (``None``: it does): no score on the newest
    rows, answers that are not finite, or a score below the serving model's by more than ``margin``
    (judged only where both read the rows through the same ``encoder_version``).

    ``stale``: given where the rows and training that chose ``current`` judge again (module
    docstring), the training rows' constant answer (:func:`constant_answer`), which then decides.
    """
    score, name = candidate.metric, candidate.metric_name
    if not any(v is not None for v in evidence["scores"].values()) and len(newest):
        return "no candidate can be scored on the newest rows"
    if score is not None and not math.isfinite(score):
        return "its answers on the newest rows are not finite"
    if current is None or score is None or current.encoder_version != encoder_version:
        return None
    # The alone copy on every row trained on (most of) these rows: its twin on the older rows, saved
    # with it, is judged in its place (without one, its own score: in-sample, the cautious side).
    twin = current.judged_by if current.every_row else None
    try:
        old, _ = (current if twin is None else twin).score(newest, enc)  # both judged on the same rows
    except Refused:
        return None
    if old is None:
        return None
    whose = f"the serving round {current.round}'s" + (" twin's" if twin is not None else "")
    if stale is not None:
        floor = constant_score(name, newest, stale)
        if score < floor <= old:
            return (
                f"its best candidate ({candidate.candidate}) scores {name} {score:.4f} on the rows that chose "
                f"round {current.round}, below the training rows' constant answer ({floor:.4f}), where {whose} "
                f"scores {old:.4f}; round {current.round} keeps serving"
            )
        return None
    if not no_worse(score, old, margin):
        return (
            f"its best candidate ({candidate.candidate}) scores {name} {score:.4f} on the newest rows, "
            f"below {whose} {old:.4f} by more than the margin {margin}; round {current.round} keeps serving"
        )
    return None


def constant_answer(train: Dataset, classes: bool) -> np.ndarray | None:
    """The one answer a model that learnt nothing but ``train``'s targets would give: their most
    common class, or their mean; ``None`` without rows."""
    if not len(train):
        return None
    y = np.asarray(train.y)
    if classes:
        values, counts = np.unique(y.reshape(-1), return_counts=True)
        return values[np.argmax(counts)].reshape(1)
    return y.reshape(len(y), -1).astype(np.float64).mean(axis=0)


def constant_score(metric: str, rows: Dataset, answer: np.ndarray) -> float:
    """``answer`` (:func:`constant_answer`) given to every one of ``rows``, scored as the judge
    scores a model (:meth:`edge.serving.model.ServingModel.score`): accuracy, or R²."""
    if metric == "accuracy":
        return float(np.mean(np.asarray(rows.y).reshape(-1) == answer[0]))
    return r2(rows.y, answer)


def judgement(rows: Dataset, spec_json: str) -> str:
    """The identity of a judgement: the rows that judge and the task's training (``stale`` in
    :func:`refusal`: a changed training, a task started over, is judged by the margin again)."""
    spec = np.frombuffer(spec_json.encode(), dtype=np.uint8)
    return param_hash({"x": rows.x, "y": rows.y, "spec": spec})
