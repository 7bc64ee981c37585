"""Settings of the watched export folder (:class:`sensors.welding.folder.WatchedFolderSource`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sensors.files import DEFAULT_MAX_FILE_BYTES
from sensors.welding.recording import MIN_SAMPLE_RATE, WELD_CHANNELS, SourceConfigError

ON_DONE = ("keep", "move", "delete")


@dataclass(frozen=True)
class FolderSourceConfig:
    """Settings of a :class:`WatchedFolderSource`.

    Parameters
    ----------
    folder
        The folder the welder's monitoring system exports into.
    state_dir
        Where the ledger lives; default ``<folder>/.ioft``.  Put it on the Pi's state
        directory when the export folder is a network share.
    settle_s
        A file (and its sidecar) must stay unchanged this long to count as complete.
    marker_suffix
        A ``<file><suffix>`` or ``<stem><suffix>`` file marks a weld complete at once.
    require_marker
        Only pick up files that have a marker (for exporters that always write one).
    incomplete_timeout_s
        A stable file that still looks truncated is rejected after this long.
    on_done
        What to do with a delivered file: ``"keep"`` it, ``"move"`` it to ``done_dir``
        or ``"delete"`` it (with its sidecar and marker).
    done_dir, rejected_dir
        Sub-folders (relative to ``folder``) for delivered and rejected files.
    default_channels
        Channel order for WAV files without a sidecar naming them.
    min_sample_rate
        Lowest acceptable sample rate.
    max_file_bytes
        Largest weld file read (its size, and the data its header declares); larger ones are
        rejected before anything is allocated.
    """

    folder: Path
    state_dir: Path | None = None
    settle_s: float = 2.0
    marker_suffix: str = ".done"
    require_marker: bool = False
    incomplete_timeout_s: float = 300.0
    on_done: Literal["keep", "move", "delete"] = "keep"
    done_dir: str = "processed"
    rejected_dir: str = "rejected"
    default_channels: tuple[str, ...] = WELD_CHANNELS
    min_sample_rate: float = MIN_SAMPLE_RATE
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", Path(self.folder))
        if self.state_dir is not None:
            object.__setattr__(self, "state_dir", Path(self.state_dir))
        object.__setattr__(self, "default_channels", tuple(self.default_channels))
        errors = []
        if not self.settle_s >= 0:
            errors.append(f"settle_s must be >= 0 (got {self.settle_s})")
        if not self.incomplete_timeout_s >= self.settle_s:
            errors.append(f"incomplete_timeout_s must be >= settle_s (got {self.incomplete_timeout_s})")
        if self.on_done not in ON_DONE:
            errors.append(f"on_done must be one of {ON_DONE} (got {self.on_done!r})")
        if not self.marker_suffix.startswith(".") or len(self.marker_suffix) < 2:
            errors.append(f"marker_suffix must look like '.done' (got {self.marker_suffix!r})")
        for name in ("done_dir", "rejected_dir"):
            value = getattr(self, name)
            if not value or Path(value).is_absolute() or ".." in Path(value).parts:
                errors.append(f"{name} must be a plain sub-folder name (got {value!r})")
        if not self.min_sample_rate > 0:
            errors.append(f"min_sample_rate must be > 0 (got {self.min_sample_rate})")
        if not self.max_file_bytes >= 1024:
            errors.append(f"max_file_bytes must be >= 1024 (got {self.max_file_bytes})")
        if errors:
            raise SourceConfigError("invalid FolderSourceConfig: " + "; ".join(errors))

    @property
    def ledger_path(self) -> Path:
        """The ledger file."""
        return (self.state_dir or self.folder / ".ioft") / "weld_ledger.jsonl"
