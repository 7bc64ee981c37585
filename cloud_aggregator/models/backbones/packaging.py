"""A trained backbone, or the fleet's shared parameters, to a signed package for the fleet.

``export_run``: a :mod:`cloud_aggregator.models.backbones.train` run folder → its encoder (or
the whole classifier/regressor) → :func:`export.pipeline.export_module` (ONNX, checked and
parity-tested; optional int8 variant with its size/latency/score change; manifest signed
with the fleet key).  ``export_params``: the same from named NumPy parameters of a
``trainer_lite`` model (e.g. a task's final global encoder), via
:func:`cloud_aggregator.models.backbones.assemble.assemble`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_aggregator.models.backbones.assemble import assemble
from cloud_aggregator.models.backbones.data import BackboneData
from cloud_aggregator.models.backbones.train import load_run
from export.onnx_export import DEFAULT_OPSET
from export.package import PARITY_TOLERANCE
from export.pipeline import ExportSummary, ScoreFn, export_module

#: What ``export_run`` can ship: the encoder (heads stay federated) or the whole model.
OUTPUTS = ("embedding", "logits", "regression")


def _score_fn(data: BackboneData, head: torch.nn.Module | None, output: str) -> ScoreFn | None:
    """Task score of model outputs on the held-out split: through the trained head for embeddings."""
    y = data.y_test

    def score(out: np.ndarray) -> tuple[float, str]:
        pred = out
        if output == "embedding":
            with torch.no_grad():
                pred = head(torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))).numpy()
        if data.task == "classification":
            return float(np.mean(pred.argmax(axis=1) == y)), "accuracy"
        sse = float(np.sum((pred - y) ** 2))
        return 1.0 - sse / float(np.sum((y - y.mean(axis=0)) ** 2)), "r2"

    return score if (output != "embedding" or head is not None) else None


def _stamped(metadata: Mapping[str, str], name: str, version: int, **more: str) -> dict[str, str]:
    """A package's metadata: the schema's ``metadata``, then the model's name and version, then ``more``."""
    return dict(metadata) | {"ioft.model.name": name, "ioft.model.version": str(version), **more}


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    version: int,
    key: Ed25519PrivateKey,
    output: str = "embedding",
    quantize: bool = False,
    opset: int = DEFAULT_OPSET,
    tolerance: float = PARITY_TOLERANCE,
    n_heldout: int = 256,
) -> ExportSummary:
    """Export a trained backbone run: ``output="embedding"`` ships the encoder (heads stay federated)."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    model, data, settings, ckpt = load_run(run_dir)
    if output != "embedding" and (output == "logits") != (data.task == "classification"):
        raise ValueError(f"a {data.task} backbone cannot be exported as {output!r}")
    module = model.encoder if output == "embedding" else model
    heldout = data.x_test[:n_heldout]
    metadata = _stamped(data.schema_metadata, name, version, **{"ioft.backbone": settings.backbone})
    final = ckpt["history"][-1] if ckpt["history"] else {}
    extra = {
        "backbone": settings.backbone,
        "data": data.description,
        "epochs": str(ckpt["epoch"]),
        **{k: f"{v:.6f}" for k, v in final.items() if k.startswith("test_")},
    }
    return export_module(module, heldout, metadata, out_dir, name=name, version=version, kind=output, key=key,
                         quantize=quantize, score=_score_fn(data, model.head, output), score_inputs=data.x_test,
                         opset=opset, tolerance=tolerance, extra=extra)  # fmt: skip


def export_params(
    params: Mapping[str, np.ndarray],
    out_dir: str | Path,
    *,
    model: str,
    model_args: Mapping[str, object],
    blocks: Sequence[str] | None,
    schema_metadata: dict[str, str],
    name: str,
    version: int,
    key: Ed25519PrivateKey,
    heldout: np.ndarray | None = None,
    heldout_description: str = "heldout",
    prefix: str = "",
    quantize: bool = False,
    opset: int = DEFAULT_OPSET,
    tolerance: float = PARITY_TOLERANCE,
    seed: int = 0,
    extra: dict[str, str] | None = None,
) -> ExportSummary:
    """Export the leading ``blocks`` of a trainer_lite model holding the fleet's ``params``.

    Parity is tested on ``heldout`` rows (flattened to the model's input width; the
    manifest's ``parity_inputs`` says which, from ``heldout_description``) or, without
    them, on 256 seeded standard-normal rows (``parity_inputs=synthetic-normal``).
    """
    module = assemble(model, model_args, params, blocks=blocks, prefix=prefix).float()
    d_in = next(p for p in module.parameters()).shape[0]
    inputs = heldout_description
    if heldout is None:
        heldout = np.random.default_rng(seed).standard_normal((256, d_in)).astype(np.float32)
        inputs = "synthetic-normal"
    heldout = np.asarray(heldout, dtype=np.float32).reshape(len(heldout), -1)[:256]
    if heldout.shape[1] != d_in:
        raise ValueError(
            f"the model takes {d_in} inputs but the held-out rows ({inputs}) have {heldout.shape[1]}: "
            "name the task's --schema, pass --heldout ROWS.npy, or --heldout synthetic"
        )
    metadata = _stamped(schema_metadata, name, version)
    extra = dict(extra or {}) | {
        "source": f"trainer_lite {model} blocks {list(blocks) if blocks else 'all'}",
        "parity_inputs": inputs,
    }
    return export_module(module, heldout, metadata, out_dir, name=name, version=version, kind="embedding", key=key,
                         quantize=quantize, score=None, score_inputs=heldout, opset=opset, tolerance=tolerance,
                         extra=extra)  # fmt: skip
