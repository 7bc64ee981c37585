"""Optional int8 dynamic quantization (onnxruntime.quantization) and its price, side by side.

Dynamic quantization stores weights as int8 and quantizes activations on the fly,
so no calibration data is needed.  What it costs is measured, not assumed: file
size, onnxruntime latency at batch 1 and 64, the output drift against float32,
and the task score (accuracy or R² through the trained head) on held-out data.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.runtime import ort_session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VariantReport:
    """One ONNX file's size, latency and task score."""

    label: str
    size: int
    latency_ms_b1: float
    latency_ms_b64: float
    score: float | None
    score_name: str
    max_abs_diff_vs_float32: float


def quantize_int8(src: str | Path, dst: str | Path) -> Path:
    """Dynamic int8 quantization of ``src`` into ``dst``, keeping its metadata (schema hash)."""
    src, dst = Path(src), Path(dst)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    original = onnx.load(str(src))
    quantized = onnx.load(str(dst))
    have = {p.key for p in quantized.metadata_props}
    for prop in original.metadata_props:
        if prop.key not in have:
            entry = quantized.metadata_props.add()
            entry.key, entry.value = prop.key, prop.value
    onnx.save(quantized, str(dst))
    onnx.checker.check_model(str(dst))
    return dst


def ort_latency_ms(session, x: np.ndarray, *, repeats: int = 200, warmup: int = 20) -> float:
    """Median wall time of one ``session.run`` on ``x``, in milliseconds."""
    name_in = session.get_inputs()[0].name
    name_out = session.get_outputs()[0].name
    feed = {name_in: np.ascontiguousarray(x, dtype=np.float32)}
    for _ in range(warmup):
        session.run([name_out], feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run([name_out], feed)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def run_all(session, x: np.ndarray, batch: int = 512) -> np.ndarray:
    name_in = session.get_inputs()[0].name
    name_out = session.get_outputs()[0].name
    outs = [
        session.run([name_out], {name_in: np.ascontiguousarray(x[i : i + batch], dtype=np.float32)})[0]
        for i in range(0, len(x), batch)
    ]
    return np.concatenate(outs)


def compare_variants(
    files: dict[str, Path],
    heldout: np.ndarray,
    score: Callable[[np.ndarray], tuple[float, str]] | None = None,
    *,
    threads: int = 1,
    repeats: int = 200,
) -> list[VariantReport]:
    """Size, latency and score of each file (the first is the float32 reference for drift)."""
    reports, reference = [], None
    for label, path in files.items():
        session = ort_session(path, threads)
        out = run_all(session, heldout)
        if reference is None:
            reference = out
        b1 = ort_latency_ms(session, heldout[:1], repeats=repeats)
        b64 = ort_latency_ms(
            session, np.resize(heldout, (64, *heldout.shape[1:])), repeats=max(20, repeats // 4)
        )
        value, name = score(out) if score is not None else (None, "none")
        reports.append(
            VariantReport(
                label,
                Path(path).stat().st_size,
                b1,
                b64,
                value,
                name,
                float(np.max(np.abs(out - reference))),
            )
        )
    return reports


def report_table(reports: list[VariantReport]) -> str:
    """A markdown table of :func:`compare_variants` output, the float32 row first."""
    base = reports[0]
    lines = [
        "| variant | size (KiB) | ORT batch 1 (ms) | ORT batch 64 (ms) | score | Δ score vs float32 | max abs Δ output vs float32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        score = "n/a" if r.score is None else f"{r.score_name} {r.score:.4f}"
        delta = "n/a" if r.score is None or base.score is None else f"{r.score - base.score:+.4f}"
        lines.append(
            f"| {r.label} | {r.size / 1024:.1f} | {r.latency_ms_b1:.4f} | {r.latency_ms_b64:.4f} | {score} | "
            f"{delta} | {r.max_abs_diff_vs_float32:.3g} |"
        )
    return "\n".join(lines)
