"""torch → ONNX that a device can run: exact opset, dynamic batch, checked, parity-tested.

Uses the legacy TorchScript exporter (``dynamo=False``): in torch 2.13 the default
dynamo exporter may not reach the requested opset (it builds at 18 and converts
down), writes weights to a side ``.onnx.data`` file and emits IR 10, which older
onnxruntime builds on devices reject; the legacy one gives the exact opset, one
file and IR 8 (see ``shared/NOTES.md``).

The file is written to a temp name and only renamed into place after
``onnx.checker`` passes and onnxruntime reproduces torch's outputs on held-out
inputs within ``tolerance`` × max(1, max |torch output|) (float32 rounding grows with
the outputs' magnitude, and a newer onnxruntime may sum in another order): a failed
check stops the export.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from export.package import PARITY_TOLERANCE, ExportError, graph_io, opset_of
from export.runtime import ort_session
from ioft_protocol.manifest import ModelIOSpec

log = logging.getLogger(__name__)
#: onnxruntime 1.17 (the device extra's floor) runs opset <= 20 and IR <= 9; 17 is also what
#: the legacy exporter emits exactly, with IR 8.
DEFAULT_OPSET = 17


@dataclass(frozen=True)
class ExportResult:
    """An exported file and what was measured about it."""

    path: Path
    input: ModelIOSpec
    output: ModelIOSpec
    opset: int
    ir_version: int
    size: int
    parity_max_abs_diff: float
    parity_n_inputs: int
    parity_tolerance: float
    seconds: float
    #: The largest |torch output| on the held-out inputs: the relative tolerance scales with it.
    parity_scale: float = 1.0

    @property
    def parity_allowed(self) -> float:
        """The absolute difference the check allowed: ``tolerance`` × max(1, output scale)."""
        return self.parity_tolerance * max(1.0, self.parity_scale)

    def parity(self) -> dict[str, float]:
        return {
            "max_abs_diff": self.parity_max_abs_diff,
            "n_inputs": float(self.parity_n_inputs),
            "tolerance": self.parity_tolerance,
            "allowed": self.parity_allowed,
        }

    def parity_line(self) -> str:
        """One line a reader takes as the pass it is: the difference measured against the bound it met."""
        return (
            f"parity passed: max |Δ| {self.parity_max_abs_diff:.3g} <= allowed {self.parity_allowed:.3g} on "
            f"{self.parity_n_inputs} held-out inputs (relative tolerance {self.parity_tolerance:g} "
            f"x max(1, output scale {self.parity_scale:.3g}))"
        )


def parity_check(
    module: torch.nn.Module, path: str | Path, inputs: np.ndarray, *, threads: int = 1
) -> tuple[float, float, int]:
    """``(max abs difference, max |torch output|, n)`` between torch and onnxruntime on ``inputs``,
    whole batch and one row at a time.

    The single-row runs exercise the dynamic batch axis at the size the export traced with.
    """
    session = ort_session(path, threads)
    name_in = session.get_inputs()[0].name
    name_out = session.get_outputs()[0].name
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    with torch.no_grad():
        ref = module(torch.from_numpy(x)).numpy()
    (out,) = session.run([name_out], {name_in: x})
    if out.shape != ref.shape:
        raise ExportError(f"onnxruntime output shape {out.shape} differs from torch's {ref.shape}")
    worst = float(np.max(np.abs(out - ref))) if out.size else 0.0
    for i in range(min(len(x), 8)):
        (row,) = session.run([name_out], {name_in: x[i : i + 1]})
        worst = max(worst, float(np.max(np.abs(row - ref[i : i + 1]))))
    if not np.isfinite(worst):
        raise ExportError("onnxruntime or torch produced NaN/Inf on the held-out inputs")
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return worst, scale, len(x)


def export_onnx(
    module: torch.nn.Module,
    heldout: np.ndarray,
    path: str | Path,
    *,
    metadata: dict[str, str],
    input_name: str = "x",
    output_name: str = "z",
    opset: int = DEFAULT_OPSET,
    tolerance: float = PARITY_TOLERANCE,
    threads: int = 1,
) -> ExportResult:
    """Export ``module`` (float32, CPU) to ``path`` with a dynamic batch axis; check it; test parity.

    Parameters
    ----------
    heldout
        Inputs the module was not trained on, shaped as it takes them (batch first).
    metadata
        ONNX ``metadata_props`` (must include the feature-schema hash the inputs follow).

    Raises
    ------
    ExportError
        If the checker, the opset, or the parity check fails (the file is removed).
    """
    started = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    module = module.eval().cpu().float()
    example = torch.from_numpy(np.ascontiguousarray(heldout[:1], dtype=np.float32))
    try:
        _write_onnx(module, example, tmp, opset, input_name, output_name)
        model, spec_in, spec_out = _stamp_and_check(tmp, metadata, opset)
        parity = _check_parity(module, tmp, heldout, tolerance, threads)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _result(path, model, (spec_in, spec_out), opset, parity, tolerance, started)


def _result(
    path: Path,
    model: onnx.ModelProto,
    io: tuple[ModelIOSpec, ModelIOSpec],
    opset: int,
    parity: tuple[float, float, int],
    tolerance: float,
    started: float,
) -> ExportResult:
    """What was exported and measured (``parity``: worst difference, output scale, inputs), logged."""
    worst, scale, n = parity
    result = ExportResult(
        path=path,
        input=io[0],
        output=io[1],
        opset=opset,
        ir_version=int(model.ir_version),
        size=path.stat().st_size,
        parity_max_abs_diff=worst,
        parity_n_inputs=n,
        parity_tolerance=tolerance,
        seconds=time.perf_counter() - started,
        parity_scale=scale,
    )
    log.info(
        "exported %s: opset %d, IR %d, %d bytes, parity %.2g on %d inputs",
        path.name,
        result.opset,
        result.ir_version,
        result.size,
        worst,
        n,
    )
    return result


def _write_onnx(
    module: torch.nn.Module, example: torch.Tensor, tmp: Path, opset: int, input_name: str, output_name: str
) -> None:
    """Write the module at exactly ``opset`` with a dynamic batch axis.

    The legacy exporter: the dynamo one may build at another opset and convert down.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning, UserWarning))
        torch.onnx.export(
            module,
            (example,),
            str(tmp),
            dynamo=False,
            opset_version=opset,
            input_names=[input_name],
            output_names=[output_name],
            dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
            do_constant_folding=True,
        )


def _stamp_and_check(
    tmp: Path, metadata: dict[str, str], opset: int
) -> tuple[onnx.ModelProto, ModelIOSpec, ModelIOSpec]:
    """Add ``metadata`` to the file; the model and its input and output once the checker, the
    opset and the dynamic batch axis pass."""
    model = onnx.load(str(tmp))
    for key, value in sorted(metadata.items()):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(tmp))
    try:
        onnx.checker.check_model(str(tmp), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected the export: {exc}") from None
    got = opset_of(model)
    if got != opset:
        raise ExportError(f"asked for opset {opset}, the exporter wrote {got}")
    spec_in, spec_out = graph_io(model)
    if spec_in.shape[0] is not None or spec_out.shape[0] is not None:
        raise ExportError("the batch axis did not come out dynamic")
    return model, spec_in, spec_out


def _check_parity(
    module: torch.nn.Module, tmp: Path, heldout: np.ndarray, tolerance: float, threads: int
) -> tuple[float, float, int]:
    """onnxruntime against torch on the held-out inputs: ``(worst difference, output scale, inputs)``."""
    worst, scale, n = parity_check(module, tmp, heldout, threads=threads)
    if worst > tolerance * max(1.0, scale):
        raise ExportError(
            f"parity check failed: onnxruntime differs from torch by up to {worst:.3g} on {n} held-out "
            f"inputs whose outputs reach {scale:.3g} (tolerance {tolerance:g} x max(1, {scale:.3g})); "
            "not exporting"
        )
    return worst, scale, n
