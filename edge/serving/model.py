"""The serving model of one task: what answers rows, how it is stored, and the gate it passes.

A :class:`ServingModel` is the device's personalized model as of the round it last took
part in: the global parameters it trained from, its own local parts after the round,
the scaling fitted on its training rows (tasks with ``scaling = "local"``) and, for a
task that embeds rows, the name and version of the ONNX encoder.  It is written to
``<state_dir>/serving/<task>.safetensors`` atomically (temp file, fsync, rename: never
half-written, the previous copy kept as ``.prev``) and swapped into the server by one
reference assignment, so a row is answered by the old model or the new one, whole.

The gate (:func:`edge.models.onnx.no_worse`, the rule that rolls back an ONNX push):
the best candidate (:mod:`edge.serving.candidates`) serves only if its score on the device's
newest rows is no lower than the serving model's score on the same rows by more than the margin.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge.rows import Row
from edge.serving.conformal import DEFAULT_COVERAGE, Calibration, in_range
from edge.serving.records import Answer, ModelId
from ioft_protocol.state import StateError, load_arrays, save_arrays
from sensors.features.scaling import Standardizer
from sensors.layers import SPEED_SCALE
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.client import cast_dataset
from trainer_lite.data import Dataset
from trainer_lite.params import Params, strip_prefix, with_prefix
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)


class Refusal(enum.Enum):
    """Why a row got no answer (counted per reason in the status)."""

    NO_MODEL = "no_model"  # the task has not finished a round on this device yet
    SCHEMA = "schema"  # the row's feature schema is not the one the model was trained on
    WIDTH = "width"  # the row has another number of features than the model takes
    ENCODER = "encoder"  # the model's ONNX encoder (that version) is not active here
    NOT_FINITE = "not_finite"  # the model's answer holds NaN or Inf
    BAD_ROW = "bad_row"  # a feed line that is not a row


def r2(targets: np.ndarray, answers: np.ndarray) -> float:
    """The judge's R² of ``answers`` on ``targets`` (one row each, or one answer for all); where the
    targets do not vary, minus the mean squared error."""
    y = np.asarray(targets, dtype=np.float64).reshape(len(targets), -1)
    sst = float(np.sum((y - y.mean(axis=0)) ** 2))
    sse = float(np.sum((y - np.asarray(answers, dtype=np.float64).reshape(-1, y.shape[1])) ** 2))
    return 1.0 - sse / sst if sst > 0 else -sse / len(y)


class Refused(ValueError):  # noqa: N818 -- a counted outcome, not a program error
    """A row the serving model does not answer; ``reason`` says why."""

    def __init__(self, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


@dataclass
class ServingModel:
    """One task's model as served on this device (see the module docstring)."""

    device: str
    task: str
    spec_json: str
    round: int
    shared: Params
    local: Params
    width: int
    schema_hash: str | None = None
    classes: list[str] | None = None
    encoder: str | None = None
    encoder_version: int | None = None
    scale_mean: np.ndarray | None = None
    scale_std: np.ndarray | None = None
    metric: float | None = None
    metric_name: str = "none"
    #: The figure field scores are held against: test accuracy (classes) or mean |error| in mm/s.
    reference: float | None = None
    #: Printers: the fastest speed (mm/s) and the least vibration (sigma_a) of the training rows,
    #: the speed advice's bounds (edge.serving.advice).
    speed_max: float | None = None
    sigma_min: float | None = None
    created_at: float = field(default_factory=time.time)
    # -- conformal intervals and the trained range (edge.serving.conformal) ---------------
    #: Per-feature min and max of the training rows as stored: an answer says if its row lies within.
    x_low: np.ndarray | None = None
    x_high: np.ndarray | None = None
    #: Scores of labelled rows this model did not train on (test split, then the field's labels).
    calibration: Calibration = field(default_factory=Calibration, repr=False, compare=False)
    #: Which of the device's candidates this is (``edge.serving.candidates``), and why it serves.
    candidate: str = "personal"
    evidence: dict | None = None
    #: Trained on every row of the training split, the newest that judge included (the alone copy
    #: that serves, :mod:`edge.serving.alone`): its own score on those rows says nothing.
    every_row: bool = False
    #: The copy judged in this one's place: its twin on the older rows, of the same round (saved with it).
    judged_by: ServingModel | None = field(default=None, repr=False, compare=False)
    #: The judgement that installed it (:func:`edge.serving.gate.judgement`), saved with it: after a
    #: restart the gate still knows the rows and training that chose it.
    judged_on: str | None = None
    _algo: ClientAlgorithm | None = field(default=None, repr=False, compare=False)
    _digest: str | None = field(default=None, repr=False, compare=False)

    @property
    def algo(self) -> ClientAlgorithm:
        if self._algo is None:
            self._algo = make_client(TaskSpec.from_json(self.spec_json))
        return self._algo

    @property
    def digest(self) -> str:
        """The first 12 hex digits of a SHA-256 over the parameters (names, shapes, bytes) and scaling."""
        if self._digest is None:
            h = hashlib.sha256()
            arrays = {**with_prefix(self.shared, "shared"), **with_prefix(self.local, "local")}
            if self.scale_mean is not None and self.scale_std is not None:
                arrays |= {"scale.mean": self.scale_mean, "scale.std": self.scale_std}
            for name in sorted(arrays):
                a = np.ascontiguousarray(arrays[name])
                h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
                h.update(a.tobytes())
            self._digest = h.hexdigest()[:12]
        return self._digest

    @property
    def identity(self) -> ModelId:
        return ModelId(self.task, self.round, self.digest, self.encoder, self.encoder_version)

    # -- answering -------------------------------------------------------------------
    def outputs(self, x: np.ndarray, encoder=None) -> np.ndarray:
        """The model's raw output for rows ``x`` as the dataset stores them (embedded, scaled here)."""
        x = self._inputs(x, encoder)
        return np.asarray(self.algo.predict(self.shared, self.local, x), dtype=np.float64)

    def evaluate(self, test: Dataset, encoder=None) -> dict[str, float]:
        """The task's own metrics (``loss``, and ``accuracy`` for classes) on ``test`` rows as
        stored: what :func:`trainer_lite.client.participate` reports as ``test_*`` for the
        personal model, for whichever candidate serves; empty without rows."""
        if len(test) == 0:
            return {}
        rows = cast_dataset(Dataset(self._inputs(test.x, encoder), test.y, test.domain), self.algo.spec.dtype)
        return self.algo.evaluate(self.shared, self.local, rows)

    def _inputs(self, x: np.ndarray, encoder=None) -> np.ndarray:
        """Rows ``x`` as stored, as the model takes them: embedded, scaled, in its dtype."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.width:
            raise Refused(Refusal.WIDTH, f"rows of {x.shape[-1]} features; the model takes {self.width}")
        if self.encoder is not None:
            if encoder is None or encoder.version != self.encoder_version:
                have = "none" if encoder is None else f"v{encoder.version}"
                raise Refused(
                    Refusal.ENCODER,
                    f"trained on encoder {self.encoder} v{self.encoder_version}, active: {have}",
                )
            x = encoder.run(x).astype(np.float32, copy=False)
        if self.scale_mean is not None and self.scale_std is not None:
            x = Standardizer(self.scale_mean, self.scale_std).transform(x, np.float64)
        return x.astype(self.algo.spec.dtype, copy=False)

    def answer(
        self, row: Row, encoder=None, *, now: float | None = None, coverage: float = DEFAULT_COVERAGE
    ) -> Answer:
        """This model's answer to ``row`` with its interval or set at ``coverage``; raises
        :class:`Refused` when it gives none."""
        if row.schema_hash != self.schema_hash:
            raise Refused(
                Refusal.SCHEMA,
                f"row of feature schema {str(row.schema_hash)[:12]}, the model's is {str(self.schema_hash)[:12]}",
            )
        out = self.outputs(np.asarray([row.x]), encoder)[0]
        if not np.isfinite(out).all():
            raise Refused(Refusal.NOT_FINITE, f"the model of round {self.round} answers NaN or Inf")
        done = time.time() if now is None else now
        common = dict(
            device=self.device,
            task=self.task,
            kind=row.kind,
            key=row.key,
            row_time=row.time,
            answered_at=done,
            latency_s=max(0.0, done - row.time),
            model=self.identity,
            in_range=in_range(row.x, self.x_low, self.x_high),
            candidate=self.candidate,
        )
        if self.classes is not None:
            p = softmax(out.reshape(-1))
            if len(p) != len(self.classes):
                raise Refused(
                    Refusal.WIDTH, f"the model gives {len(p)} classes, the data has {len(self.classes)}"
                )
            return Answer(
                **common,
                classes=list(self.classes),
                probabilities=[round(float(v), 6) for v in p],
                predicted=self.classes[int(np.argmax(p))],
                conformal=self.calibration.prediction_set(self.classes, p.tolist(), coverage),
            )
        expected = float(out.reshape(-1)[0]) * SPEED_SCALE
        residual = None if row.commanded is None else expected - row.commanded
        return Answer(**common, expected_speed=expected, commanded=row.commanded, residual=residual,
                      conformal=self.calibration.interval(expected, coverage))  # fmt: skip

    # -- scoring (the gate) ----------------------------------------------------------
    def score(self, test: Dataset, encoder=None) -> tuple[float | None, str]:
        """Accuracy (class targets) or R² on ``test`` rows as stored; ``(None, "none")`` without rows.

        An output that is not finite scores ``-inf``: such a model never passes the gate.
        """
        if len(test) == 0:
            return None, "none"
        out = self.outputs(test.x, encoder)
        if not np.isfinite(out).all():
            return float("-inf"), "not_finite"
        if self.classes is not None:
            return float(np.mean(np.argmax(out, axis=1) == np.asarray(test.y).reshape(-1))), "accuracy"
        return r2(test.y, out), "r2"

    def test_error(self, test: Dataset, encoder=None) -> float | None:
        """Mean absolute error in mm/s on ``test`` (speed targets), the field error's yardstick."""
        if len(test) == 0 or self.classes is not None:
            return None
        out = self.outputs(test.x, encoder).reshape(len(test), -1)[:, 0]
        y = np.asarray(test.y, dtype=np.float64).reshape(len(test), -1)[:, 0]
        err = float(np.mean(np.abs(out - y))) * SPEED_SCALE
        return err if math.isfinite(err) else None

    # -- conformal intervals and the trained range (edge.serving.conformal) ---------------
    def calibrate(
        self, train: Dataset, test: Dataset, encoder=None, judged: ServingModel | None = None
    ) -> None:
        """The trained range from ``train`` and the first calibration scores from ``test`` (rows as
        stored, the model's held-out split): ``|expected − true|`` in mm/s, or ``1 − p(true class)``;
        of ``judged``'s answers where it stands in for this model (which trained on ``test``)."""
        if len(train):
            x = np.asarray(train.x, dtype=np.float64)
            self.x_low, self.x_high = x.min(axis=0), x.max(axis=0)
        if len(test) == 0:
            return
        out = (judged or self).outputs(test.x, encoder)
        y = np.asarray(test.y).reshape(len(test), -1)
        if self.classes is not None:
            p = softmax(out.reshape(len(test), -1))
            scores = 1.0 - p[np.arange(len(test)), y[:, 0].astype(np.int64)]
        else:
            scores = np.abs(out.reshape(len(test), -1)[:, 0] - y[:, 0].astype(np.float64)) * SPEED_SCALE
        self.calibration = Calibration(scores.tolist())

    def speed_margin(self, level: float = DEFAULT_COVERAGE) -> float | None:
        """The conformal half-width in mm/s of this printer model's interval at ``level`` (``None``:
        a welder's model, or too few calibration rows for a finite one)."""
        return None if self.classes is not None else self.calibration.quantile(level)

    # -- on disk ---------------------------------------------------------------------
    def save(self, path: Path) -> None:
        arrays = {**with_prefix(self.shared, "shared"), **with_prefix(self.local, "local")}
        if self.scale_mean is not None and self.scale_std is not None:
            arrays |= {"scale.mean": self.scale_mean, "scale.std": self.scale_std}
        # The trained range and the calibration scores (edge.serving.conformal).
        if self.x_low is not None and self.x_high is not None:
            arrays |= {"range.low": self.x_low, "range.high": self.x_high}
        arrays["conformal.scores"] = self.calibration.array()
        if self.judged_by is not None:  # the gate scores it in this model's place next round
            arrays |= with_prefix(self.judged_by.local, "twin")
        meta = {
            "device": self.device,
            "task": self.task,
            "spec": self.spec_json,
            "round": self.round,
            "width": self.width,
            "schema_hash": self.schema_hash,
            "classes": self.classes,
            "encoder": self.encoder,
            "encoder_version": self.encoder_version,
            "metric": self.metric,
            "metric_name": self.metric_name,
            "reference": self.reference,
            "speed_max": self.speed_max,
            "sigma_min": self.sigma_min,
            "created_at": self.created_at,
            "candidate": self.candidate,
            "evidence": self.evidence,
            "every_row": self.every_row,
            "judged_on": self.judged_on,
        }
        save_arrays(path, arrays, meta)

    @classmethod
    def load(cls, path: Path, *, device: str, task: str) -> ServingModel | None:
        """The model saved at ``path`` (``None`` if none was); ``ValueError`` when it is another
        machine's or another task's, or unreadable (``StateError`` from the checksums)."""
        got = load_arrays(path)
        if got is None:
            return None
        arrays, meta = got
        if meta.get("device") != device or meta.get("task") != task:
            raise ValueError(
                f"{path} holds device {meta.get('device')!r}'s model of task {meta.get('task')!r}, "
                f"not {device!r}'s of {task!r}; it is not served"
            )
        mean, std = arrays.get("scale.mean"), arrays.get("scale.std")
        model = cls(
            device=device,
            task=task,
            spec_json=str(meta["spec"]),
            round=int(meta["round"]),
            shared=strip_prefix(arrays, "shared"),
            local=strip_prefix(arrays, "local"),
            width=int(meta["width"]),
            schema_hash=meta.get("schema_hash"),
            classes=meta.get("classes"),
            encoder=meta.get("encoder"),
            encoder_version=meta.get("encoder_version"),
            scale_mean=mean,
            scale_std=std,
            metric=meta.get("metric"),
            metric_name=str(meta.get("metric_name", "none")),
            reference=meta.get("reference"),
            speed_max=meta.get("speed_max"),
            sigma_min=meta.get("sigma_min"),
            created_at=float(meta.get("created_at", 0.0)),
            x_low=arrays.get("range.low"),
            x_high=arrays.get("range.high"),
            calibration=Calibration(arrays.get("conformal.scores", np.zeros(0)).tolist()),
            candidate=str(meta.get("candidate", "personal")),
            evidence=meta.get("evidence"),
            every_row=bool(meta.get("every_row", False)),
            judged_on=meta["judged_on"] if isinstance(meta.get("judged_on"), str) else None,
        )
        twin = strip_prefix(arrays, "twin")
        if twin:
            model.judged_by = dataclasses.replace(model, local=twin, every_row=False, _digest=None)
        return model


def load_served(folder: Path, device: str, serves: Callable[[str], bool]) -> dict[str, ServingModel]:
    """The serving models earlier runs saved in ``folder``, of the tasks that ``serves``; one that
    cannot be read is logged and left out (the task serves again after its next round)."""
    out: dict[str, ServingModel] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        task = path.name.removesuffix(".safetensors")
        if not serves(task):
            continue
        try:
            model = ServingModel.load(path, device=device, task=task)
        except (StateError, ValueError, KeyError, TypeError) as exc:
            log.error("%s: serving model %s not served: %s", device, path.name, exc)
            continue
        if model is not None:
            out[task] = model
    return out
