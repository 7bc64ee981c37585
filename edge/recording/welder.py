"""The welder recorder: watched folder + label log -> one labelled 624-feature DWT row per weld."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np

from edge.config import SensorsConfig
from edge.dataset import DIR as DATASET_DIR
from edge.recording.base import DatasetAppender, RecorderError, RecorderLoop, split_for
from edge.rows import Row
from ioft_protocol.state import StateError, load_arrays, save_arrays
from sensors.files import printable

log = logging.getLogger(__name__)

PENDING_FILE = "weld-pending.safetensors"
WELDER_SOURCE = "record-welder"


class WelderRecorder(RecorderLoop):
    """Watched folder + label log → one labelled DWT feature row per weld (``source``: as the printer's)."""

    kind = "welder"
    max_welds_per_step = 16

    def __init__(
        self,
        device: str,
        state_dir: Path,
        cfg: SensorsConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        schema=None,
        source: str = WELDER_SOURCE,
    ) -> None:
        from sensors.features.infer import configured_schema
        from sensors.welding.folder import FolderSourceConfig, WatchedFolderSource
        from sensors.welding.labels import SURFACES, TOOL_CLASSES_M, TOOL_CLASSES_S
        from sensors.welding.recording import WeldDataError

        super().__init__(device, state_dir, cfg, clock)
        if schema is not None:
            self.schema, self.schema_info = schema, {"source": "code", "schema_hash": schema.schema_hash()}
        else:  # [sensors] schema: a file, "infer", or the default weld schema
            try:
                self.schema, self.schema_info = configured_schema(cfg.schema, cfg.weld_folder, self.state_dir)
            except (WeldDataError, OSError) as exc:  # FeatureInputError is a WeldDataError
                raise RecorderError(f"[sensors] schema = {cfg.schema!r}: {exc}") from None
            log.info("feature schema (%s): %s", self.schema_info["source"], self.schema.describe())
        self.schema_hash = self.schema.schema_hash()
        self.classes = list(
            {"tool_m": TOOL_CLASSES_M, "tool_s": TOOL_CLASSES_S, "surface": dict.fromkeys(SURFACES)}[
                cfg.target
            ]
        )
        self.interval_s = cfg.poll_s
        self.source = WatchedFolderSource(
            FolderSourceConfig(
                Path(cfg.weld_folder),
                state_dir=self.state_dir / "weld-ledger",
                settle_s=cfg.settle_s,
                max_file_bytes=cfg.max_file_bytes,
                # a new sensor's rate is its schema's (a 10 Hz IMU), not the weld's 200 kHz
                min_sample_rate=cfg.min_sample_rate or self.schema.sample_rate,
                default_channels=self.schema.channels,
            ),
            clock=clock,
        )
        self._source_ready = False
        self._retry_at = -math.inf
        self._backoff = 1.0
        self.label_path = Path(cfg.label_log)
        self.labels = None
        self._label_sig: tuple | None = None
        self._labels_changed = False
        self.label_errors = 0
        self.skipped = 0

        def check(meta: dict) -> list[str]:
            out = []
            if meta.get("schema_hash") != self.schema_hash:
                out.append(
                    f"its feature schema {str(meta.get('schema_hash'))[:12]}... is not this recorder's "
                    f"{self.schema_hash[:12]}..."
                )
            if meta.get("target") != cfg.target or meta.get("classes") != self.classes:
                out.append(
                    f"it is labelled for {meta.get('target')!r} {meta.get('classes')}, not {cfg.target!r}"
                )
            return out

        self.data = DatasetAppender(
            self.state_dir,
            source=source,
            x_dim=self.schema.n_features,
            y_dtype=np.int64,
            y_1d=True,
            meta={
                "source": source,
                "schema_hash": self.schema_hash,
                "target": cfg.target,
                "classes": self.classes,
                "split": "weld",
                "test_fraction": cfg.test_fraction,
            },
            check_meta=check,
            max_rows=cfg.row_limit,
        )
        self._load_pending()

    # -- pending (welds the log does not label yet) -------------------------------------
    def _load_pending(self) -> None:
        self.pending: list[dict] = []
        try:
            loaded = load_arrays(self.state_dir / PENDING_FILE)
        except StateError as exc:
            log.error("pending welds unreadable (%s); starting without them", exc)
            loaded = None
        if loaded is None:
            return
        arrays, meta = loaded
        done = set(self.data.meta.get("last_weld_ids", []))
        for i, info in enumerate(meta.get("welds", [])):
            if info["weld_id"] not in done:  # a crash after the dataset write, before this file's
                self.pending.append({**info, "features": arrays["x"][i]})
        if len(self.pending) != len(meta.get("welds", [])):
            self._save_pending()

    def _save_pending(self) -> None:
        keep = self.pending[-self.cfg.max_pending_welds :] if self.cfg.max_pending_welds else []
        if len(keep) < len(self.pending):
            log.warning("dropping %d unlabelled welds (max_pending_welds)", len(self.pending) - len(keep))
        self.pending = keep
        x = np.stack([p["features"] for p in keep]) if keep else np.empty((0, self.data.x_dim))
        meta = {"welds": [{k: v for k, v in p.items() if k != "features"} for p in keep]}
        try:
            save_arrays(self.state_dir / PENDING_FILE, {"x": x}, meta)
        except OSError as exc:
            log.error("could not write %s: %s", PENDING_FILE, exc)

    # -- labels ------------------------------------------------------------------------
    def _reload_labels(self) -> bool:
        """Re-read the label log when it changed; ``True`` if a new version was loaded."""
        from sensors.welding.labels import LabelLog, LabelLogError

        try:
            st = self.label_path.stat()
        except OSError:
            if self._label_sig != ("missing",):
                log.warning("label log %s not found; welds wait unlabelled until it exists", self.label_path)
                self._label_sig = ("missing",)
            return False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._label_sig:
            return False
        self._label_sig = sig
        try:
            self.labels = LabelLog.load(self.label_path)
        except (LabelLogError, OSError) as exc:
            self.label_errors += 1
            log.error("label log %s unusable, keeping the previous version: %s", self.label_path, exc)
            return False
        self._labels_changed = True  # pending welds get another look at the next step
        return True

    def _class_of(self, label) -> int | None:
        """The class index of ``label`` for the configured task, ``None`` if it does not say."""
        name = {"tool_m": label.tool_class_m, "tool_s": label.tool_class_s, "surface": label.surface}[
            self.cfg.target
        ]
        return self.classes.index(name) if name in self.classes else None

    # -- loop --------------------------------------------------------------------------
    def start(self) -> None:
        log.info(
            "recording welder %s: welds from %s, labels %s (%s), into %s",
            self.device,
            self.cfg.weld_folder,
            self.label_path,
            self.cfg.target,
            self.state_dir / DATASET_DIR,
        )
        self._reload_labels()

    def _ensure_source(self) -> bool:
        if self._source_ready:
            return True
        if self.clock() < self._retry_at:
            return False
        try:
            self.source.setup()
        except OSError as exc:
            log.warning("weld folder not usable (%s); retry in %.0f s", exc, self._backoff)
            self._retry_at = self.clock() + self._backoff
            self._backoff = min(self._backoff * 2, 60.0)
            return False
        self._source_ready, self._backoff = True, 1.0
        return True

    def step(self) -> int:
        from sensors.features.pipeline import labelled_rows

        self._reload_labels()
        relabel, self._labels_changed = self._labels_changed and bool(self.pending), False
        stored: list[str] = []
        pending_changed = False
        if relabel:
            still = []
            for p in self.pending:
                label = self.labels.label(p["weld_id"], datetime.fromisoformat(p["started_at"]))
                k = self._class_of(label)
                if k is None:
                    still.append(p)
                else:
                    self._add(p["weld_id"], p["features"], k)
                    stored.append(p["weld_id"])
            pending_changed = len(still) != len(self.pending)
            self.pending = still
        if self._ensure_source():
            for _ in range(self.max_welds_per_step):
                try:
                    rec = self.source.read()
                except OSError as exc:  # the folder went away (network share): set up again later
                    log.warning("weld folder read failed (%s); will set it up again", exc)
                    self.source.close()
                    self._source_ready = False
                    break
                if rec is None:
                    break
                try:
                    rows = list(labelled_rows([rec], self.labels, self.schema))
                except (ValueError, ArithmeticError, MemoryError) as exc:
                    # a weld that passed the reader but not the features: one line, the folder goes on
                    self.skipped += 1
                    log.warning(
                        "weld %s from %s: features failed (%s), not stored",
                        rec.weld_id,
                        printable(Path(rec.source).name),
                        type(exc).__name__,
                    )
                    continue
                if not rows:
                    self.skipped += 1  # logged by labelled_rows: does not fit the schema
                    continue
                row = rows[0]
                if row.schema_hash != self.schema_hash or not np.isfinite(row.features).all():
                    self.skipped += 1
                    log.warning("weld %s: features unusable, not stored", row.weld_id)
                    continue
                # answered now, labelled or not (a weld waiting for its label is not stored yet)
                x = tuple(row.features.tolist())
                self.feed.put(Row("weld", row.weld_id, time.time(), x, schema_hash=row.schema_hash))
                k = self._class_of(row.label)
                if k is None:
                    log.info("weld %s not labelled for %s yet; kept pending", row.weld_id, self.cfg.target)
                    self.pending.append(
                        {
                            "weld_id": row.weld_id,
                            "started_at": row.started_at.isoformat(),
                            "source": str(row.source),
                            "features": row.features,
                        }
                    )
                    pending_changed = True
                else:
                    self._add(row.weld_id, row.features, k)
                    stored.append(row.weld_id)
        if stored:
            if not self.data.flush({"last_weld_ids": stored}):
                return 0
            log.info(
                "stored %d weld row(s): %d train / %d test",
                len(stored),
                self.data.stored("train"),
                self.data.stored("test"),
            )
        elif self.data.pending:
            self.data.flush()
        if pending_changed:
            self._save_pending()
        self._stored(len(stored))
        return len(stored)

    def _add(self, weld_id: str, features: np.ndarray, k: int) -> None:
        self.feed.put_label(weld_id, self.classes[k])  # scores the answer made to it (field accuracy)
        split = split_for(
            self.device, weld_id, self.cfg.test_fraction, train_empty=self.data.rows("train") == 0
        )
        self.data.add(split, features, k)

    def finish(self) -> None:
        try:
            self.data.flush()
        finally:
            self.source.close()

    def status(self) -> dict:
        stats = self.source.stats
        return {
            "state": "ok" if self._source_ready and self.labels is not None else "fault",
            "folder": {
                "path": str(self.cfg.weld_folder),
                "ready": self._source_ready,
                "delivered": stats.delivered,
                "rejected": stats.rejected,
                "duplicates": stats.duplicates,
            },
            "labels": {
                "path": str(self.label_path),
                "loaded": self.labels is not None,
                "errors": self.label_errors,
            },
            "rows": {"train": self.data.rows("train"), "test": self.data.rows("test")},
            "pending_welds": len(self.pending),
            "skipped_welds": self.skipped,
            "write_errors": self.data.write_errors,
            "schema_hash": self.schema_hash,
            "schema": self.schema_info,
        }
