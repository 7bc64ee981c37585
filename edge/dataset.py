"""The device's local dataset: kept in its state directory, never uploaded.

Stored as one verified array file (``dataset.safetensors``: train/test inputs and
targets), written atomically.  The simulators fill it once, seeded by the device
id; real sensors append to it as layers or welds complete.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge.config import DataConfig
from edge.state import load_arrays, save_arrays
from trainer_lite.client import derive_rng
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)
FILE = "dataset.safetensors"


def save_dataset(state_dir: Path, train: Dataset, test: Dataset, meta: dict) -> None:
    arrays = {"train_x": train.x, "train_y": train.y, "test_x": test.x, "test_y": test.y}
    if train.domain is not None and test.domain is not None:
        arrays |= {"train_domain": train.domain, "test_domain": test.domain}
    save_arrays(state_dir / FILE, arrays, meta)


def load_dataset(state_dir: Path) -> tuple[Dataset, Dataset, dict] | None:
    loaded = load_arrays(state_dir / FILE)
    if loaded is None:
        return None
    a, meta = loaded
    train = Dataset(a["train_x"], a["train_y"], a.get("train_domain"))
    test = Dataset(a["test_x"], a["test_y"], a.get("test_domain"))
    return train, test, meta


def simulated_printer_dataset(device: str, cfg: DataConfig) -> tuple[Dataset, Dataset, dict]:
    """A simulated printer that has printed at only ``cfg.train_speeds`` speed settings.

    The test split is every other setting: the model must generalise to speeds
    this printer never ran, which is where borrowing the fleet's curve pays off.
    """
    from sensors.layers import to_xy
    from sensors.sim.printer import SPEED_SETTINGS, simulate_layers

    runs = simulate_layers(device, seed=cfg.seed)
    rng = derive_rng(cfg.seed, device, "train-speeds")
    k = min(max(1, cfg.train_speeds), len(SPEED_SETTINGS) - 1)
    # One setting from each of k equal bands of the speed range: every printer has
    # seen slow, middle and fast printing, but only a few runs of each.
    bands = np.array_split(np.array(SPEED_SETTINGS), k)
    train_speeds = sorted(int(rng.choice(band)) for band in bands)
    train = np.concatenate([runs[s] for s in train_speeds])
    test = np.concatenate([t for s, t in runs.items() if s not in train_speeds])
    meta = {"source": "simulate-printer", "train_speeds": train_speeds, "seed": cfg.seed}
    return Dataset(*to_xy(train)), Dataset(*to_xy(test)), meta


def prepare_dataset(state_dir: Path, device: str, cfg: DataConfig) -> tuple[Dataset, Dataset, dict]:
    """Load the dataset from the state directory, creating it from the simulator if asked."""
    existing = load_dataset(state_dir)
    if existing is not None:
        return existing
    if cfg.source == "simulate-printer":
        train, test, meta = simulated_printer_dataset(device, cfg)
    elif cfg.source == "simulate-welder":
        raise NotImplementedError("the welder simulator source is added with the sensors welding issue")
    else:
        raise FileNotFoundError(
            f"no local dataset in {state_dir / FILE}; record some data first or start with --simulate printer"
        )
    save_dataset(state_dir, train, test, meta)
    log.info("created local dataset: %d train / %d test rows (%s)", len(train), len(test), meta)
    return train, test, meta
