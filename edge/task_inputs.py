"""The rows a task trains on here: the local dataset's, or a pushed ONNX encoder's embeddings of
them (task hyperparameter ``"features": "onnx:<model>"``), scaled on this device where the task
says ``scaling = "local"`` (its own training rows' statistics) or ``scaling = "fleet"`` (the
transform the aggregator pooled from every device's feature sums: until it has come, the task
has no rows here).  Embeddings and scaled copies are cached until the rows, the encoder's version
or the fleet's transform change."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from edge.models.onnx import LoadedModel, embed_rows
from ioft_protocol.feature_stats import FleetScaling
from sensors.features.scaling import Standardizer
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset

log = logging.getLogger("edge.daemon")  # a round's input checks log as the daemon, whose steps they are
#: Prefix of the ``features`` task hyperparameter naming a pushed ONNX encoder.
ONNX_FEATURES = "onnx:"

#: A task's splits and the encoder version that embedded them (``None``: raw rows).
Rows = tuple[Dataset, Dataset, int | None]


class TaskInputs:
    """One device's task inputs; ``active(name)`` is the model serving under ``name``, if any."""

    def __init__(self, device: str, active: Callable[[str], LoadedModel | None]) -> None:
        self.device = device
        self._active = active
        # Embeddings of the local splits per model name, for the version they were computed with.
        self._embedded: dict[str, tuple[int, Dataset, Dataset]] = {}
        # spec -> (rows it was fitted on, their scaler, the same rows scaled) for scaled tasks
        self._scaled: dict[str, tuple[Dataset, Dataset, Standardizer, Dataset, Dataset]] = {}
        #: task -> the pooled transform its aggregator published (tasks with scaling = "fleet")
        self.fleet: dict[str, FleetScaling] = {}
        self._fleet_scalers: dict[str, tuple[FleetScaling, Standardizer]] = {}

    def take_fleet(self, pooled: FleetScaling) -> bool:
        """Apply the aggregator's pooled transform to its task; ``False`` if it is the one applied already."""
        known = self.fleet.get(pooled.task)
        if (
            known is not None
            and np.array_equal(known.mean, pooled.mean)
            and np.array_equal(known.std, pooled.std)
        ):
            return False
        self.fleet[pooled.task] = pooled
        return True

    def forget_embeddings(self) -> None:
        """The local rows changed: embeddings of the old ones are stale."""
        self._embedded.clear()

    def for_task(self, spec_json: str, algo: ClientAlgorithm, train: Dataset, test: Dataset) -> Rows | None:
        """The local splits a task trains on: raw rows, or a pushed encoder's embeddings of them.

        Returns ``None`` when the task names an encoder this device has no active version of, or
        scales with the fleet's transform and none has come yet.
        """
        rows = self.rows(algo, train, test)
        if rows is None or algo.scaling == "none":
            return rows
        train, test, version = rows
        scaler = self.scaler(spec_json, algo, train)
        if scaler is None:
            return None if algo.scaling == "fleet" else rows  # local: no training rows to fit yet
        cached = self._scaled.get(spec_json)
        if cached is None or cached[0] is not train or cached[1] is not test or cached[2] is not scaler:
            dtype = np.result_type(train.x.dtype, np.float32)
            tx, ex = scaler.transform(train.x, dtype), scaler.transform(test.x, dtype)
            cached = (
                train,
                test,
                scaler,
                Dataset(tx, train.y, train.domain),
                Dataset(ex, test.y, test.domain),
            )
            self._scaled[spec_json] = cached
        return cached[3], cached[4], version

    def scaler(self, spec_json: str, algo: ClientAlgorithm, train: Dataset) -> Standardizer | None:
        """The transform the task's model takes its rows through (``train``: its rows before scaling).

        ``scaling = "local"``: fitted on ``train`` (refitted only on new rows); ``"fleet"``: the
        pooled one, if it has come; ``"none"``: ``None``.  Training and serving both take it from here.
        """
        if algo.scaling == "fleet":
            pooled = self.fleet.get(algo.spec.name)
            return None if pooled is None else self._fleet_scaler(pooled)
        if algo.scaling == "local" and len(train):
            cached = self._scaled.get(spec_json)
            return cached[2] if cached is not None and cached[0] is train else Standardizer.fit(train.x)
        return None

    def _fleet_scaler(self, pooled: FleetScaling) -> Standardizer:
        scaler = self._fleet_scalers.get(pooled.task)
        if scaler is None or scaler[0] is not pooled:
            scaler = self._fleet_scalers[pooled.task] = (pooled, Standardizer(pooled.mean, pooled.std))
        return scaler[1]

    def rows(self, algo: ClientAlgorithm, train: Dataset, test: Dataset) -> Rows | None:
        """The task's rows before scaling: the dataset's, or a pushed encoder's embeddings of them."""
        source = algo.spec.hparams.get("features")
        if source is None:
            return train, test, None
        if not isinstance(source, str) or not source.startswith(ONNX_FEATURES):
            raise ValueError(f"task hparam features={source!r}: expected '{ONNX_FEATURES}<model name>'")
        name = source[len(ONNX_FEATURES) :]
        model = self._active(name)
        if model is None:
            return None
        cached = self._embedded.get(name)
        if cached is None or cached[0] != model.version:
            started = time.perf_counter()
            etrain = Dataset(embed_rows(model, train.x), train.y, train.domain)
            etest = Dataset(embed_rows(model, test.x), test.y, test.domain)
            cached = self._embedded[name] = (model.version, etrain, etest)
            log.info(
                "%s: embedded %d rows with %s v%d in %.3f s",
                self.device,
                len(etrain) + len(etest),
                name,
                model.version,
                time.perf_counter() - started,
            )
        return cached[1], cached[2], cached[0]

    def encode(self, task: str, algo: ClientAlgorithm, x: np.ndarray) -> np.ndarray:
        """Raw rows ``x`` as the task's model takes them (embedded first if the task says so)."""
        source = algo.spec.hparams.get("features")
        if source is None:
            return x
        model = self._active(source[len(ONNX_FEATURES) :])
        if model is None:
            raise ValueError(f"task {task} needs encoder {source}, which is not active on this device")
        return embed_rows(model, x)
