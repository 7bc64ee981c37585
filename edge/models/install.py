"""What a device keeps of its models on disk: the active version, the previous one, the refusals.

``<root>/<name>/active.json`` names the serving version (rewritten by rename, the previous
version's record inside it, kept for a rollback); ``rejections.json`` the recent refusals.
A finished file is activated only if onnxruntime loads it and its holdout score is no worse
than the active version's by more than ``rollback_margin``; at start-up the active version
is re-verified (signature, file hash, load) and rolled back to the previous one if it fails.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge.config import ModelConfig
from edge.models.onnx import LoadedModel, ModelLoadError, holdout_score, no_worse
from ioft_protocol import model_push
from ioft_protocol.manifest import ManifestError, ModelManifest, file_sha256, verify_manifest
from ioft_protocol.state import atomic_write_json
from trainer_lite.data import Dataset

log = logging.getLogger("edge.models")  # fetch, install and the manager log under one name
ACTIVE = "active.json"
REJECTIONS = "rejections.json"
#: Refusals kept per model (on disk and in the status).
KEEP_REJECTIONS = 20


class Installed:
    """The installed models under ``root`` (one folder per name): activation, rollback, refusals."""

    def __init__(
        self,
        root: str | Path,
        cfg: ModelConfig,
        public_key: Ed25519PublicKey,
        holdout: tuple[Dataset, Dataset] | None,
    ) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.public_key = public_key
        self.holdout = holdout
        self._lock = threading.RLock()
        self.records: dict[str, dict[str, Any]] = {}
        self.loaded: dict[str, LoadedModel] = {}
        self.rejections: dict[str, list[dict[str, Any]]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        self._load_all()

    def _activate(
        self, name: str, offer: model_push.ModelOffer, m: ModelManifest, digest: str, path: Path
    ) -> None:
        current = self.records.get(name)
        try:
            model = LoadedModel(path, m, threads=self.cfg.threads)
            train, test = self.holdout if self.holdout is not None else (None, None)
            metric, metric_name = holdout_score(model, train, test)
        except (ModelLoadError, ValueError) as exc:
            path.unlink(missing_ok=True)
            keep = f"; v{current['version']} keeps serving" if current else ""
            self._refuse(name, m.version, f"failed its smoke test: {exc}{keep}", digest)
            return
        old_metric = current.get("metric") if current else None
        if not no_worse(metric, old_metric, self.cfg.rollback_margin):
            path.unlink(missing_ok=True)
            self._refuse(
                name,
                m.version,
                f"holdout {metric_name} {metric:.4f} is below active v{current['version']}'s "
                f"{old_metric:.4f} by more than the margin {self.cfg.rollback_margin}; rolled back to "
                f"v{current['version']}",
                digest,
            )
            return
        record = {
            "version": m.version,
            "file": path.name,
            "sha256": m.sha256,
            "metric": metric,
            "metric_name": metric_name,
            "activated_at": time.time(),
            "manifest": offer.manifest,
            "signature": offer.signature,
            "offer_digest": digest,
            "previous": _without_previous(current),
        }
        atomic_write_json(self.root / name / ACTIVE, record, keep_previous=True)
        self.records[name], self.loaded[name] = record, model
        self._prune(name)
        log.info(
            "%s v%d active (holdout %s %s; previous %s)",
            name,
            m.version,
            metric_name,
            "n/a" if metric is None else f"{metric:.4f}",
            f"v{current['version']}" if current else "none",
        )

    def _prune(self, name: str) -> None:
        """Keep the active and previous files; delete older versions."""
        rec = self.records[name]
        keep = {rec["file"]} | ({rec["previous"]["file"]} if rec.get("previous") else set())
        for path in (self.root / name).glob("v*.onnx"):
            if path.name not in keep:
                path.unlink(missing_ok=True)

    def _open(self, rec: dict[str, Any]) -> LoadedModel:
        """Re-verify a stored version (signature, file hash) and load it."""
        m = verify_manifest(rec["manifest"], rec["signature"], self.public_key)
        path = self.root / m.name / rec["file"]
        if not path.exists():
            raise ModelLoadError(f"{path.name} is missing")
        if file_sha256(path) != m.sha256:
            raise ModelLoadError(f"{path.name} no longer matches its signed sha256 (corrupted on disk)")
        return LoadedModel(path, m, threads=self.cfg.threads)

    def _load_all(self) -> None:
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            name = folder.name
            self.rejections[name] = _read_json(folder / REJECTIONS, default=[])
            rec = _read_json(folder / ACTIVE, default=None)
            if rec is None:
                continue
            try:
                self.loaded[name], self.records[name] = self._open(rec), rec
                continue
            except (ModelLoadError, ManifestError, KeyError, OSError) as exc:
                failure = f"active v{rec.get('version')} fails at start-up: {exc}"
            prev = rec.get("previous")
            if prev is None:
                self._refuse(name, rec.get("version"), failure + "; no previous version to roll back to", "")
                continue
            try:
                self.loaded[name] = self._open(prev)
            except (ModelLoadError, ManifestError, KeyError, OSError) as exc:
                self._refuse(
                    name, rec.get("version"), f"{failure}; previous v{prev['version']} too: {exc}", ""
                )
                continue
            self.records[name] = dict(prev, previous=None)
            atomic_write_json(folder / ACTIVE, self.records[name], keep_previous=True)
            self._refuse(name, rec.get("version"), f"{failure}; rolled back to v{prev['version']}", "")

    def _refuse(self, name: str, version: int | None, reason: str, digest: str) -> bool:
        log.warning("refused model %s v%s: %s", name, version, reason)
        entries = self.rejections.setdefault(name, [])
        entries.append({"version": version, "reason": reason, "time": time.time(), "digest": digest})
        del entries[:-KEEP_REJECTIONS]
        atomic_write_json(self.root / name / REJECTIONS, entries)
        return True


def _without_previous(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if rec is None else {k: v for k, v in rec.items() if k != "previous"}


def _read_json(path: Path, default: Any) -> Any:
    """A JSON state file, falling back to its ``.prev`` copy if torn or corrupt."""
    for candidate in (path, path.with_name(path.name + ".prev")):
        try:
            return json.loads(candidate.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            log.error("state file %s unreadable (%s); trying its previous copy", candidate, exc)
    return default
