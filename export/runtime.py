"""onnxruntime sessions as the cloud side measures them (no torch here)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort


def ort_session(path: str | Path, threads: int = 1):
    """An onnxruntime CPU session with explicit thread counts (the default oversubscribes small CPUs)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
