"""Welding signal sources: per-weld recordings from exported files, live ALSA capture and labels.

See :mod:`sensors.welding.recording` for the recording type, :mod:`.folder` for the
watched export folder, :mod:`.alsa` for live capture and :mod:`.labels` for the
operator/maintenance log.
"""

from sensors.welding.alsa import AlsaCaptureError, AlsaConfig, AlsaWeldSource
from sensors.welding.folder import FolderSourceConfig, WatchedFolderSource
from sensors.welding.formats import read_weld_file, write_weld_file
from sensors.welding.labels import LabelLog, LabelLogError, WeldLabel
from sensors.welding.recording import (
    MIN_SAMPLE_RATE,
    WELD_CHANNELS,
    SourceConfigError,
    WeldDataError,
    WeldRecording,
)
from sensors.welding.segment import EnergySegmenter, Segment, SegmenterConfig
from sensors.welding.wavfile import IncompleteWeldFileError

__all__ = [
    "MIN_SAMPLE_RATE",
    "WELD_CHANNELS",
    "AlsaCaptureError",
    "AlsaConfig",
    "AlsaWeldSource",
    "EnergySegmenter",
    "FolderSourceConfig",
    "IncompleteWeldFileError",
    "LabelLog",
    "LabelLogError",
    "Segment",
    "SegmenterConfig",
    "SourceConfigError",
    "WatchedFolderSource",
    "WeldDataError",
    "WeldLabel",
    "WeldRecording",
    "read_weld_file",
    "write_weld_file",
]
