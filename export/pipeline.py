"""From a torch module to a signed package, in one call: :func:`export_module`.

The module → ONNX (checked, parity-tested on held-out rows) → optional int8 variant
with its size/latency/score change → manifest signed with the fleet key.  What the
module is (a trained cloud backbone, or the fleet's shared parameters assembled in
torch) is the caller's business: ``cloud_aggregator.models.backbones.packaging`` exports
both, so this package imports nothing of the cloud's.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from export.onnx_export import DEFAULT_OPSET, ExportResult, export_onnx
from export.package import PARITY_TOLERANCE, Package, package_model
from export.quantize import VariantReport, compare_variants, quantize_int8, report_table

log = logging.getLogger(__name__)

#: A task score of model outputs on the held-out rows: ``(score, its name)``.
ScoreFn = Callable[[np.ndarray], tuple[float, str]]


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_module` produced: the package, the ONNX export's checks, the
    variants compared (float32, and int8 when quantized) and the report printed for people."""

    package: Package
    export: ExportResult
    variants: list[VariantReport]
    report: str


def export_module(
    module: torch.nn.Module,
    heldout: np.ndarray,
    metadata: dict[str, str],
    out_dir: str | Path,
    *,
    name: str,
    version: int,
    kind: str,
    key: Ed25519PrivateKey,
    quantize: bool = False,
    score: ScoreFn | None = None,
    score_inputs: np.ndarray | None = None,
    opset: int = DEFAULT_OPSET,
    tolerance: float = PARITY_TOLERANCE,
    extra: dict[str, str] | None = None,
) -> ExportSummary:
    """Export ``module`` to ONNX, optionally quantize it, and package it signed in ``out_dir``.

    Parameters
    ----------
    module
        The torch module to ship (in eval mode, float32).
    heldout
        Rows the ONNX graph's parity with ``module`` is tested on.
    metadata
        ONNX metadata props (the input schema's hash, the model's name and version).
    kind
        What the model outputs (``embedding``, ``logits``, ``regression``), for the manifest.
    score, score_inputs
        A task score of outputs on ``score_inputs`` (default: ``heldout``), reported per variant.
    extra
        Further manifest fields; each variant's held-out score is added.

    Returns
    -------
    ExportSummary
        The package, the export's checks, the variants and the report (also in ``<name>.report.md``).
    """
    with tempfile.TemporaryDirectory(prefix="ioft-export-") as tmp:
        fp32, int8 = Path(tmp) / f"{name}-float32.onnx", Path(tmp) / f"{name}-int8.onnx"
        result = export_onnx(module, heldout, fp32, metadata=metadata, opset=opset, tolerance=tolerance)
        inputs = heldout if score_inputs is None else score_inputs
        chosen, variants, parity = _variants(result, fp32, int8 if quantize else None, inputs, score)
        package = package_model(
            chosen, Path(out_dir), name=name, version=version, kind=kind, key=key, parity=parity,
            quantization="int8-dynamic" if quantize else None, extra=dict(extra or {}) | _heldout_scores(variants),
        )  # fmt: skip
    report = _write_report(package, result, variants, f"{name} v{version} ({kind})")
    return ExportSummary(package, result, variants, report)


def _variants(
    result: ExportResult, fp32: Path, int8: Path | None, score_inputs: np.ndarray, score: ScoreFn | None
) -> tuple[Path, list[VariantReport], dict[str, float]]:
    """The file to ship (``int8``, quantized, unless ``None``), every variant compared, and the parity."""
    files = {"float32": fp32}
    if int8 is not None:
        files["int8 (dynamic)"] = quantize_int8(fp32, int8)
    variants = compare_variants(files, score_inputs, score, repeats=100)
    parity = result.parity()
    if int8 is not None:
        parity["int8_max_abs_diff_vs_float32"] = variants[1].max_abs_diff_vs_float32
    return files.get("int8 (dynamic)", fp32), variants, parity


def _heldout_scores(variants: list[VariantReport]) -> dict[str, str]:
    """Each scored variant's held-out score as a manifest field (``heldout_<score>_<variant>``)."""
    return {
        f"heldout_{v.score_name}_{v.label.split()[0]}": f"{v.score:.6f}"
        for v in variants
        if v.score is not None
    }


def _write_report(package: Package, result: ExportResult, variants: list[VariantReport], title: str) -> str:
    """The export's report, also written beside the package's ONNX file as ``<name>.report.md``."""
    report = (
        f"{title}: opset {result.opset}, IR {result.ir_version}, "
        f"{result.parity_line()}\n\n{report_table(variants)}\n"
    )
    package.onnx_path.with_name(package.onnx_path.name.removesuffix(".onnx") + ".report.md").write_text(
        report
    )
    return report
