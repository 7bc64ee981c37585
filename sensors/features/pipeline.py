"""From weld recordings to labelled feature rows: what the device daemon stores locally.

::

    from sensors.welding import WatchedFolderSource, FolderSourceConfig, LabelLog
    from sensors.features.pipeline import labelled_rows

    labels = LabelLog.load("/var/lib/ioft/welder-3/maintenance.csv")
    with WatchedFolderSource(FolderSourceConfig("/srv/welder-export")) as src:
        for row in labelled_rows(src.read_all(), labels):
            store(row.features, row.target("tool_m"), row.schema_hash)

The same works for :class:`~sensors.welding.alsa.AlsaWeldSource` (iterate it) and
for simulated recordings.  It lives in :mod:`sensors.features`, above the welding stack it
reads (the features take a :class:`~sensors.welding.recording.WeldRecording`), so that
``sensors.welding`` never imports the features.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import numpy as np

from sensors.features.dwt import extract_features
from sensors.features.schema import DEFAULT_SCHEMA, FeatureSchema
from sensors.welding.labels import LabelLog, WeldLabel
from sensors.welding.recording import WeldDataError, WeldRecording

log = logging.getLogger(__name__)

TASKS = ("tool_m", "tool_s", "surface")


@dataclass(frozen=True)
class LabelledRow:
    """One weld's feature vector with whatever labels the log gives it."""

    weld_id: str
    started_at: datetime
    features: np.ndarray
    label: WeldLabel
    schema_hash: str
    source: str

    def target(self, task: Literal["tool_m", "tool_s", "surface"]) -> str | None:
        """The class name for an FTL-TP task, or ``None`` if this weld is unlabelled for it.

        ``tool_m``: TC1..TC4 (domain group M); ``tool_s``: New/Worn/DMGD (group S);
        ``surface``: clean/polished/contaminated (group T).
        """
        if task == "tool_m":
            return self.label.tool_class_m
        if task == "tool_s":
            return self.label.tool_class_s
        if task == "surface":
            return self.label.surface
        raise ValueError(f"unknown task {task!r}; use one of {TASKS}")


def labelled_rows(
    recordings: Iterable[WeldRecording],
    labels: LabelLog | None = None,
    schema: FeatureSchema = DEFAULT_SCHEMA,
    *,
    on_error: Literal["skip", "raise"] = "skip",
) -> Iterator[LabelledRow]:
    """Extract features and attach labels, one row per usable weld.

    Parameters
    ----------
    recordings
        Any iterable of welds (a source's ``read_all()``, an ALSA source, the simulator).
    labels
        The tool/surface log; ``None`` gives unlabelled rows (inference only).
    schema
        Feature recipe; every row carries its hash.
    on_error
        ``"skip"`` logs and skips welds that do not fit the schema (a 50 ms blip, a
        wrong rate); ``"raise"`` re-raises.
    """
    digest = schema.schema_hash()
    for rec in recordings:
        try:
            features = extract_features(rec, schema)
        except WeldDataError as exc:
            if on_error == "raise":
                raise
            log.warning("skipped weld %s from %s: %s", rec.weld_id, rec.source, exc)
            continue
        label = labels.label_recording(rec) if labels is not None else WeldLabel(rec.weld_id)
        yield LabelledRow(rec.weld_id, rec.started_at, features, label, digest, rec.source)
