"""One ONNX model loaded in onnxruntime, and the holdout score a device judges it by.

onnxruntime is imported when a model is opened, so a device that never receives
a model never pays for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ioft_protocol.manifest import ModelManifest
from trainer_lite.data import Dataset

#: Rows per onnxruntime call: bounds the activations a large holdout would need at once.
BATCH_ROWS = 512
#: Rows of each split a smoke test uses at most (keeps activation time bounded).
SMOKE_ROWS = 2048


class ModelLoadError(RuntimeError):
    """onnxruntime could not load the model, or it does not match its manifest."""


class LoadedModel:
    """An onnxruntime session for a verified file and the manifest that describes it."""

    def __init__(self, path: str | Path, manifest: ModelManifest, *, threads: int = 1) -> None:
        # Lazy, as the module docstring says: onnxruntime, and PyWavelets through
        # sensors.features.schema, load only on a device that opens a model.
        import onnxruntime as ort

        from sensors.features.schema import SCHEMA_HASH_KEY

        self.path = Path(path)
        self.manifest = manifest
        options = ort.SessionOptions()
        # Explicit thread counts: the defaults spawn one per core and contend on a Pi.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            raise ModelLoadError(f"onnxruntime cannot load {self.path.name}: {exc}") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or inputs[0].name != manifest.input.name:
            raise ModelLoadError(
                f"model inputs {[i.name for i in inputs]} differ from the manifest's {manifest.input.name!r}"
            )
        if manifest.output.name not in [o.name for o in outputs]:
            raise ModelLoadError(
                f"model outputs {[o.name for o in outputs]} lack the manifest's {manifest.output.name!r}"
            )
        carried = self.session.get_modelmeta().custom_metadata_map.get(SCHEMA_HASH_KEY)
        if carried != manifest.schema_hash:
            raise ModelLoadError(
                f"the ONNX file's {SCHEMA_HASH_KEY} is {carried!r}, the manifest says {manifest.schema_hash}"
            )
        self._in_shape = tuple(manifest.input.shape[1:])
        self._in_dtype = np.dtype(manifest.input.dtype)

    @property
    def version(self) -> int:
        return self.manifest.version

    def run(self, rows: np.ndarray) -> np.ndarray:
        """The model's output for ``rows`` of shape ``(n, input row size)``, as ``(n, output row size)``."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.manifest.input.row_size:
            raise ValueError(
                f"{self.manifest.name} v{self.version} takes rows of {self.manifest.input.row_size} values, "
                f"got shape {rows.shape}"
            )
        name_in, name_out = self.manifest.input.name, self.manifest.output.name
        outs = []
        for start in range(0, max(len(rows), 1), BATCH_ROWS):
            batch = rows[start : start + BATCH_ROWS].astype(self._in_dtype, copy=False)
            batch = np.ascontiguousarray(batch.reshape((len(batch), *self._in_shape)))
            (out,) = self.session.run([name_out], {name_in: batch})
            outs.append(out.reshape(len(batch), -1))
        return np.concatenate(outs) if outs else np.empty((0, self.manifest.output.row_size), np.float32)


def no_worse(metric: float | None, reference: float | None, margin: float) -> bool:
    """The rollback rule: a new model whose score (higher is better) is below the one it would
    replace by more than ``margin`` is refused; without both scores there is nothing to judge by.

    Used for ONNX pushes (``edge.models``) and for the models that answer rows (``edge.serving``).
    """
    return metric is None or reference is None or metric >= reference - margin


def _standardize(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu, sd = train.mean(axis=0), train.std(axis=0)
    sd = np.where(sd > 1e-8, sd, 1.0)
    return (train - mu) / sd, (test - mu) / sd


def _ridge(z: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    z1 = np.hstack([z, np.ones((len(z), 1))])
    reg = lam * np.eye(z1.shape[1])
    reg[-1, -1] = 0.0  # no penalty on the intercept
    return np.linalg.solve(z1.T @ z1 + reg, z1.T @ y)


def probe_score(
    z_train: np.ndarray, y_train: np.ndarray, z_test: np.ndarray, y_test: np.ndarray
) -> tuple[float, str]:
    """How much of the task an embedding carries: a ridge probe fitted on train, scored on test.

    Class-id targets give ``("accuracy", ...)`` (one-hot ridge, argmax); real targets
    give ``R²``.  Higher is better in both, so one rollback margin fits both.
    """
    z_train, z_test = _standardize(z_train.astype(np.float64), z_test.astype(np.float64))
    lam = 1.0
    if y_train.ndim == 1 and y_train.dtype.kind in "iu":
        classes = np.unique(np.concatenate([y_train, y_test]))
        onehot = (y_train[:, None] == classes[None, :]).astype(np.float64)
        w = _ridge(z_train, onehot, lam)
        pred = classes[np.argmax(np.hstack([z_test, np.ones((len(z_test), 1))]) @ w, axis=1)]
        return float(np.mean(pred == y_test)), "probe_accuracy"
    yt = y_train.reshape(len(y_train), -1).astype(np.float64)
    ye = y_test.reshape(len(y_test), -1).astype(np.float64)
    w = _ridge(z_train, yt, lam)
    pred = np.hstack([z_test, np.ones((len(z_test), 1))]) @ w
    sst = float(np.sum((ye - ye.mean(axis=0)) ** 2))
    return (1.0 - float(np.sum((ye - pred) ** 2)) / sst if sst > 0 else 0.0), "probe_r2"


def holdout_score(
    model: LoadedModel, train: Dataset | None, test: Dataset | None
) -> tuple[float | None, str]:
    """Run the model on the device's own data and score it; raises ``ModelLoadError`` on bad output.

    ``embedding`` models get :func:`probe_score`; ``logits`` models their accuracy and
    ``regression`` models their R² on the test split.  Without data, only the output's
    shape and finiteness on a zero batch are checked (score ``None``).
    """
    m = model.manifest
    if test is None or not len(test) or train is None or not len(train):
        out = model.run(np.zeros((2, m.input.row_size), np.float32))
        _check_output(model, out, 2)
        return None, "none"
    xtr, ytr = train.x[:SMOKE_ROWS], train.y[:SMOKE_ROWS]
    xte, yte = test.x[:SMOKE_ROWS], test.y[:SMOKE_ROWS]
    try:
        out_test = model.run(xte)
    except Exception as exc:  # onnxruntime's runtime errors have no common base we can name
        raise ModelLoadError(f"inference failed on the holdout: {exc}") from None
    _check_output(model, out_test, len(xte))
    if m.kind == "logits":
        return float(np.mean(np.argmax(out_test, axis=1) == yte)), "accuracy"
    if m.kind == "regression":
        ye = yte.reshape(len(yte), -1)
        sst = float(np.sum((ye - ye.mean(axis=0)) ** 2))
        return (1.0 - float(np.sum((ye - out_test) ** 2)) / sst if sst > 0 else 0.0), "r2"
    out_train = model.run(xtr)
    _check_output(model, out_train, len(xtr))
    return probe_score(out_train, ytr, out_test, yte)


def _check_output(model: LoadedModel, out: np.ndarray, n: int) -> None:
    want = (n, model.manifest.output.row_size)
    if out.shape != want:
        raise ModelLoadError(f"output has shape {out.shape}, the manifest promises {want}")
    if not np.isfinite(out).all():
        raise ModelLoadError("output holds NaN or Inf on the holdout")


def embed_rows(model: LoadedModel, x: np.ndarray) -> np.ndarray:
    """The model's output rows for ``x``, as float32 (the head's input)."""
    return model.run(x).astype(np.float32, copy=False)
