"""The device's local dataset: kept in its state directory, never uploaded.

Stored as append-only segments in ``dataset.segments/`` (:mod:`edge.segments`: each a
verified array file of train/test inputs and targets, written atomically).  ``edge-recorder``
(:mod:`edge.recording`) appends one segment per stored batch of layers or welds from the
machine's sensors, and the trainer reads only the new ones.  The single file
``dataset.safetensors`` of older versions still loads, as the oldest segment.  With a simulated
``[data] source`` the trainer creates the dataset once instead, seeded by the device id
(:mod:`edge.simulated`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge.config import DataConfig
from edge.segment_writer import write_base
from edge.segments import LEGACY_FILE, SEGMENT_DIR, DatasetReader
from edge.simulated import (
    simulated_printer_dataset,
    simulated_printer_raw_dataset,
    simulated_welder_dataset,
)
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)
#: The single-file dataset: read, so that a device's dataset in that form still loads; never written.
FILE = LEGACY_FILE
#: The folder of the dataset's segments.
DIR = SEGMENT_DIR


def save_dataset(state_dir: Path, train: Dataset, test: Dataset, meta: dict) -> None:
    """Replace the whole dataset (one ``base`` segment; the older segments are deleted after it)."""
    arrays = {"train_x": train.x, "train_y": train.y, "test_x": test.x, "test_y": test.y}
    if train.domain is not None and test.domain is not None:
        arrays |= {"train_domain": train.domain, "test_domain": test.domain}
    write_base(Path(state_dir), arrays, meta)


def load_dataset(state_dir: Path) -> tuple[Dataset, Dataset, dict] | None:
    """The verified dataset, ``None`` if never written.

    A segment that fails verification (or lacks an array, or holds inconsistent ones)
    is set aside as ``*.corrupt`` and the rest loads; a single-file dataset (:data:`FILE`) falls
    back to its ``.prev``.  ``StateError`` when files exist but none is usable.
    """
    return DatasetReader(Path(state_dir)).load()


def prepare_dataset(
    state_dir: Path, device: str, cfg: DataConfig, *, reader: DatasetReader | None = None
) -> tuple[Dataset, Dataset, dict]:
    """Load the dataset from the state directory, creating it from the simulator if asked.

    ``reader`` (the trainer's, which later reads only new segments) is left holding the
    dataset, also one just created.
    """
    reader = reader if reader is not None else DatasetReader(Path(state_dir))
    existing = reader.load()
    if existing is not None:
        return existing
    if cfg.source == "simulate-printer":
        train, test, meta = simulated_printer_dataset(device, cfg)
    elif cfg.source == "simulate-welder":
        train, test, meta = simulated_welder_dataset(state_dir, device, cfg)
    elif cfg.source == "simulate-printer-raw":
        train, test, meta = simulated_printer_raw_dataset(device, cfg)
    else:
        raise FileNotFoundError(
            f"no local dataset in {state_dir / DIR}; record some data first or start with --simulate printer"
        )
    save_dataset(state_dir, train, test, meta)
    reader.load()
    log.info("created local dataset: %d train / %d test rows (%s)", len(train), len(test), meta)
    return train, test, meta


def first_dataset(
    state_dir: Path, device: str, cfg: DataConfig, reader: DatasetReader
) -> tuple[Dataset, Dataset, dict]:
    """The local dataset at the daemon's start; with ``[data] source = "state"`` it may not exist
    yet (empty then): edge-recorder appends segments while the daemon runs, and ``reader`` reads them."""
    try:
        return prepare_dataset(state_dir, device, cfg, reader=reader)
    except FileNotFoundError:
        if cfg.source != "state":
            raise
    log.warning(
        "%s: no local dataset in %s yet; rounds are skipped until edge-recorder writes one",
        device,
        Path(state_dir) / DIR,
    )
    empty = Dataset(np.empty((0, 1)), np.empty((0, 1)))
    return empty, empty, {}
