"""The rows a task trains on here: the local dataset's, or a pushed ONNX encoder's embeddings of
them (task hyperparameter ``"features": "onnx:<model>"``), scaled on this device where the task
says ``scaling = "local"``.  Embeddings and scaled copies are cached until the rows or the
encoder's version change."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from edge.models.onnx import LoadedModel, embed_rows
from sensors.features.scaling import standardize_locally
from trainer_lite.algorithms import ClientAlgorithm
from trainer_lite.data import Dataset

log = logging.getLogger("edge.daemon")  # its lines read as the daemon's, as before the move
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
        # spec -> (rows it was fitted on, the same rows scaled) for tasks with scaling = "local"
        self._scaled: dict[str, tuple[Dataset, Dataset, Dataset, Dataset]] = {}

    def forget_embeddings(self) -> None:
        """The local rows changed: embeddings of the old ones are stale."""
        self._embedded.clear()

    def for_task(self, spec_json: str, algo: ClientAlgorithm, train: Dataset, test: Dataset) -> Rows | None:
        """The local splits a task trains on: raw rows, or a pushed encoder's embeddings of them.

        Returns ``None`` when the task names an encoder this device has no active version of.
        """
        rows = self.rows(algo, train, test)
        if rows is None or algo.scaling != "local":
            return rows
        train, test, version = rows
        cached = self._scaled.get(spec_json)
        if cached is None or cached[0] is not train or cached[1] is not test:  # refit on new rows only
            tx, ex = standardize_locally(train.x, test.x)
            cached = (train, test, Dataset(tx, train.y, train.domain), Dataset(ex, test.y, test.domain))
            self._scaled[spec_json] = cached
        return cached[2], cached[3], version

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
