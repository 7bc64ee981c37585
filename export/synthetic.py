"""Synthetic ONNX encoders of any size, built with ``onnx.helper`` (no torch), for push tests and benchmarks.

Real ONNX files that onnxruntime runs on a device's raw vibration windows
``(batch, 2, 256)`` (``sensors.sim.vibration``), small or padded to a given size:

* ``log_power``: per axis log mean power (the vibration level, which tracks speed) — a
  useful embedding; a linear probe on it predicts speed well.
* ``mean``: per axis mean of the zero-mean window — carries almost nothing, so its holdout
  score collapses (the rollback case).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from export.package import Package, package_model
from sensors.features.schema import SCHEMA_HASH_KEY
from sensors.sim.vibration import WINDOW_SCHEMA

PAD_NAME = "pad"


def window_encoder(
    path: Path,
    *,
    kind: str = "log_power",
    schema_hash: str | None = None,
    opset: int = 17,
    pad_bytes: int = 0,
    seed: int = 0,
) -> Path:
    """Write an encoder ``x (N, 2, 256) -> z (N, 2)``; ``pad_bytes`` adds a weight of that size.

    The pad weight takes part in the graph (its sum times zero is added to the
    output), so no optimizer drops it and the file has the size asked for.
    """
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 256])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 2])
    nodes, inits = [], []
    if kind == "log_power":
        nodes += [
            helper.make_node("Mul", ["x", "x"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[2], keepdims=0),
            helper.make_node("Log", ["ms"], ["core"]),
        ]
    elif kind == "mean":
        nodes += [helper.make_node("ReduceMean", ["x"], ["core"], axes=[2], keepdims=0)]
    else:
        raise ValueError(kind)
    if pad_bytes:
        n = max(1, pad_bytes // 4)
        values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        inits.append(helper.make_tensor(PAD_NAME, TensorProto.FLOAT, [n], values.tobytes(), raw=True))
        inits.append(helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]))
        nodes += [
            helper.make_node("ReduceSum", [PAD_NAME], ["padsum"], keepdims=0),
            helper.make_node("Mul", ["padsum", "zero"], ["padzero"]),
            helper.make_node("Add", ["core", "padzero"], ["z"]),
        ]
    else:
        nodes += [helper.make_node("Identity", ["core"], ["z"])]
    graph = helper.make_graph(nodes, "encoder", [x], [z], initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="ioft-tests"
    )
    model.ir_version = 8
    entry = model.metadata_props.add()
    entry.key, entry.value = SCHEMA_HASH_KEY, schema_hash or WINDOW_SCHEMA.schema_hash()
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def signed(onnx_path: Path, out_dir: Path, key, *, name: str = "enc", version: int = 1) -> Package:
    """Package and sign ``onnx_path`` (no torch twin, so the parity figures are zeros)."""
    return package_model(
        onnx_path,
        out_dir,
        name=name,
        version=version,
        kind="embedding",
        key=key,
        parity={"max_abs_diff": 0.0, "n_inputs": 0.0, "tolerance": 1e-5},
    )
