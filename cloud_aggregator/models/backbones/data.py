"""Training sets for the cloud backbones, built from the machine simulators (NumPy only).

* ``printer-windows``: raw 2-axis vibration windows (227 Hz, 256 samples) of many
  simulated lab printers (``sensors.sim.vibration``), target ``speed / 50``.  Whole
  printers are held out, so the test score is on machines the backbone never saw.
* ``weld-features``: 624 DWT features of simulated welds of FTL-TP's group M (four
  material domains, tool classes TC1-TC4), at the same ``time_scale`` as the
  simulated welder devices, split at random within each domain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ioft_protocol.state import atomic_write_bytes, decode_arrays, encode_arrays
from sensors.features.schema import SCHEMA_HASH_KEY, schema_metadata
from sensors.layers import SPEED_SCALE
from sensors.sim.vibration import WINDOW_SCHEMA, simulate_windows
from sensors.sim.weld_groups import simulate_domain_group


@dataclass(frozen=True)
class BackboneData:
    """Inputs shaped as the model takes them, targets, and the schema the inputs follow."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: str
    n_outputs: int
    schema_metadata: dict[str, str]
    description: str
    classes: tuple[str, ...] = field(default=())

    @property
    def schema_hash(self) -> str:
        return self.schema_metadata[SCHEMA_HASH_KEY]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def save(self, path: str | Path) -> None:
        meta = {
            "task": self.task,
            "n_outputs": self.n_outputs,
            "schema_metadata": self.schema_metadata,
            "description": self.description,
            "classes": list(self.classes),
        }
        arrays = {
            "x_train": self.x_train,
            "y_train": self.y_train,
            "x_test": self.x_test,
            "y_test": self.y_test,
        }
        atomic_write_bytes(path, encode_arrays(arrays, meta))

    @classmethod
    def load(cls, path: str | Path) -> BackboneData:
        arrays, meta = decode_arrays(Path(path).read_bytes())
        return cls(
            arrays["x_train"],
            arrays["y_train"],
            arrays["x_test"],
            arrays["y_test"],
            meta["task"],
            int(meta["n_outputs"]),
            dict(meta["schema_metadata"]),
            meta["description"],
            tuple(meta.get("classes", ())),
        )


def printer_windows(n_printers: int = 24, seed: int = 0, test_printers: int | None = None) -> BackboneData:
    """Raw vibration windows of ``n_printers`` simulated lab printers; the last quarter held out."""
    if n_printers < 2:
        raise ValueError(f"need at least 2 printers (one to hold out), got {n_printers}")
    n_test = max(1, n_printers // 4) if test_printers is None else test_printers
    xs, ys = [], []
    for i in range(n_printers):
        windows, speed, _ = simulate_windows(f"lab-printer-{i}", seed=seed)
        xs.append(windows)
        ys.append((speed / SPEED_SCALE)[:, None].astype(np.float32))
    split = n_printers - n_test
    return BackboneData(
        np.concatenate(xs[:split]),
        np.concatenate(ys[:split]),
        np.concatenate(xs[split:]),
        np.concatenate(ys[split:]),
        task="regression",
        n_outputs=1,
        schema_metadata={
            SCHEMA_HASH_KEY: WINDOW_SCHEMA.schema_hash(),
            "ioft.window_schema.json": WINDOW_SCHEMA.to_json(),
        },
        description=f"printer-windows: {n_printers} simulated printers ({n_test} held out), seed {seed}",
    )


def weld_features(
    n_per_domain: int = 60, seed: int = 0, time_scale: float = 0.3, test_fraction: float = 0.25
) -> BackboneData:
    """DWT features of simulated group-M welds; a seeded ``test_fraction`` of each domain held out."""
    group = simulate_domain_group("M", n_per_domain, seed=seed, time_scale=time_scale)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(group.y), dtype=bool)
    for d in np.unique(group.domain):
        idx = np.flatnonzero(group.domain == d)
        test[rng.choice(idx, size=max(1, round(test_fraction * len(idx))), replace=False)] = True
    x = group.X.astype(np.float32)
    y = group.y.astype(np.int64)
    return BackboneData(
        x[~test],
        y[~test],
        x[test],
        y[test],
        task="classification",
        n_outputs=len(group.classes),
        schema_metadata=schema_metadata(group.schema),
        description=f"weld-features: group M, {n_per_domain} welds per domain, time_scale {time_scale}, seed {seed}",
        classes=tuple(group.classes),
    )


BUILDERS = {"printer-windows": printer_windows, "weld-features": weld_features}


def build_data(kind: str, **kwargs: Any) -> BackboneData:
    """The named training set; the error lists the valid names."""
    try:
        builder = BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown backbone data {kind!r}; choose one of {sorted(BUILDERS)}") from None
    return builder(**kwargs)


def describe(data: BackboneData) -> str:
    return json.dumps(
        {
            "description": data.description,
            "train": list(data.x_train.shape),
            "test": list(data.x_test.shape),
            "task": data.task,
            "schema": data.schema_hash[:12],
        }
    )
