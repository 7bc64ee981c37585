"""The device's model manager: fetch pushed ONNX models, verify, activate, roll back.

A push is a retained offer (``ioft_protocol.model_push.ModelOffer``: the signed manifest and a
table of chunk hashes) plus retained chunks.  The manager:

1. verifies the offer's Ed25519 signature with the fleet key, then checks the
   manifest against this device (feature-schema hash of its data, row size,
   opset and IR version its onnxruntime runs, size limit) before fetching anything;
2. fetches only the chunks it lacks, checking each against the table and writing it
   at its offset in a sparse temp file — a restarted device re-hashes what it
   already has and resumes.  Where the session can hand a topic filter's messages
   over on its network thread (``tap``), a fresh fetch takes the chunks as they
   stream in on one subscription to the version's chunk topics (``.../chunk/+``),
   each written as it is read, so the device holds one chunk at a time and the
   network thread reads the next only once it is on disk; the last chunk goes to the
   daemon's thread, which finishes the file.  When that stream goes quiet with
   chunks missing (a broker that sends no retained messages to wildcard
   subscriptions, as RabbitMQ; one that dropped some over its queue limit, as
   mosquitto past ``max_queued_messages``; a device that came late), and for a
   resumed fetch or a session without taps, it asks for the missing chunks a bounded
   window at a time (it subscribes to each one's retained topic and drops the
   subscription once the chunk is on disk); memory stays within ``window_bytes``
   whatever the model size;
3. checks the whole file's sha256 and size against the signed manifest, loads it in
   onnxruntime, checks its declared inputs/outputs and schema metadata, and scores
   it on the device's own holdout;
4. activates it atomically (``active.json`` rewritten by rename, the previous
   version kept on disk), or refuses it — a load failure, a bad output, or a
   holdout score lower than the active version's by more than ``rollback_margin``
   — and the active version keeps serving.

Every refusal is kept with its reason (``rejections.json``) and reported on the
device's retained status; a refused offer is not fetched again (a re-push with a
new offer is).  At start-up the active version is re-verified (signature, file
hash, load); if it no longer loads the manager rolls back to the previous one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge.config import ModelConfig
from edge.model_transfer import RefusedError, Transfer
from edge.onnx_model import LoadedModel, ModelLoadError, holdout_score, no_worse
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import (
    ManifestError,
    ModelManifest,
    file_sha256,
    verify_manifest,
    verify_signed_text,
)
from ioft_protocol.state import atomic_write_json
from trainer_lite.data import Dataset

log = logging.getLogger(__name__)
ACTIVE = "active.json"
REJECTIONS = "rejections.json"
#: Refusals kept per model (on disk and in the status).
KEEP_REJECTIONS = 20
#: A streamed fetch with chunks missing and none received for this long asks for the rest one
#: window at a time (checked by ``tick``, once a second).
STREAM_QUIET_S = 1.0
STATUS_REJECTIONS = 5


class ModelManager:
    """Models of one device, under ``<state_dir>/models/<name>/``.

    Parameters
    ----------
    root
        The models folder.
    cfg
        The device's ``[model]`` settings.
    device, fleet
        Who we are (offers may address a subset of devices).
    public_key
        The fleet's Ed25519 public key.
    data_schema_hash
        Feature-schema hash of this device's data (``None``: it has none, and every
        model is refused, since nothing could check that the inputs match).
    holdout
        ``(train, test)`` splits of the local dataset, for the smoke test and score.
    subscribe, unsubscribe
        Follow / drop a chunk topic or topic filter (the daemon's MQTT session).
    tap
        ``tap(topic_filter, callback)`` (``MqttSession.tap``): messages matching the filter go to
        ``callback`` on the session's network thread, or to the daemon's queue where it returns
        ``False``; ``callback=None`` removes it.  Without it every chunk is fetched by its own
        subscription, a window at a time, and handled on the daemon's thread.
    """

    def __init__(
        self,
        root: str | Path,
        cfg: ModelConfig,
        *,
        device: str,
        fleet: str,
        public_key: Ed25519PublicKey,
        data_schema_hash: str | None,
        holdout: tuple[Dataset, Dataset] | None,
        subscribe: Callable[[str], None],
        unsubscribe: Callable[[str], None],
        tap: Callable[[str, Callable[[Any], bool] | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.cfg = cfg
        self.device, self.fleet = device, fleet
        self.public_key = public_key
        self.data_schema_hash = data_schema_hash
        self.holdout = holdout
        self._subscribe, self._unsubscribe, self._tap = subscribe, unsubscribe, tap
        self._clock = clock
        self._lock = threading.RLock()
        self.records: dict[str, dict[str, Any]] = {}
        self.loaded: dict[str, LoadedModel] = {}
        self.transfers: dict[str, Transfer] = {}
        self.rejections: dict[str, list[dict[str, Any]]] = {}
        self.last_transfer: dict[str, dict[str, Any]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        self._load_all()

    # -- queries -----------------------------------------------------------------------
    def active(self, name: str) -> LoadedModel | None:
        """The model serving under ``name``, if any."""
        with self._lock:
            return self.loaded.get(name)

    def status(self) -> dict[str, Any]:
        """Per model: active and previous version, score, transfer progress, recent refusals."""
        with self._lock:
            out: dict[str, Any] = {}
            names = set(self.records) | set(self.transfers) | set(self.rejections) | set(self.last_transfer)
            for name in sorted(names):
                rec = self.records.get(name)
                prev = rec.get("previous") if rec else None
                entry: dict[str, Any] = {
                    "active": rec["version"] if rec else None,
                    "previous": prev["version"] if prev else None,
                    "metric": rec.get("metric") if rec else None,
                    # The previous version's holdout score: a staged rollout compares the two.
                    "previous_metric": prev.get("metric") if prev else None,
                    "metric_name": rec.get("metric_name") if rec else None,
                    "activated_at": rec.get("activated_at") if rec else None,
                }
                t = self.transfers.get(name)
                if t is not None:
                    entry["transfer"] = {"version": t.manifest.version, "have": len(t.have), "of": t.n_chunks}
                if name in self.last_transfer:
                    entry["last_transfer"] = dict(self.last_transfer[name])
                if self.rejections.get(name):
                    entry["rejected"] = [
                        {k: r[k] for k in ("version", "reason", "time")}
                        for r in self.rejections[name][-STATUS_REJECTIONS:]
                    ]
                out[name] = entry
            return out

    # -- offers -------------------------------------------------------------------------
    def handle_offer(self, name: str, payload: bytes) -> bool:
        """Act on a retained offer; returns whether the status changed."""
        if not payload:
            return False  # a cleared retained offer
        if self.cfg.names and name not in self.cfg.names:
            log.info("ignoring model %s: not in this device's model.names %s", name, self.cfg.names)
            return False
        digest = hashlib.sha256(payload).hexdigest()
        with self._lock:
            if any(r.get("digest") == digest for r in self.rejections.get(name, [])):
                return False  # refused before: already reported
            rec = self.records.get(name)
            if rec is not None and rec.get("offer_digest") == digest:
                return False
            t = self.transfers.get(name)
            if t is not None and t.digest == digest:
                return False  # the same offer again (a reconnect re-delivers retained messages)
            try:
                offer = model_push.ModelOffer.decode(payload, max_bytes=model_push.MAX_OFFER_BYTES)
                if offer.name != name:
                    raise RefusedError(f"offer for model {offer.name!r} on the topic of {name!r}")
            except (codec.WireError, RefusedError) as exc:
                return self._refuse(name, None, f"malformed offer: {exc}", digest)
            if offer.withdrawn:
                try:
                    verify_signed_text(
                        model_push.withdrawal_text(name, offer.withdrawn),
                        offer.withdrawal_signature,
                        self.public_key,
                        f"withdrawal of {name} v{list(offer.withdrawn)}",
                    )
                except ManifestError as exc:  # the broker's credential alone must not roll the fleet back
                    return self._refuse(
                        name, _claimed_version(offer.manifest), f"offer refused: {exc}", digest
                    )
            withdrew = bool(offer.withdrawn) and self._withdraw(name, offer)
            rec = self.records.get(name)  # a withdrawal may have rolled it back
            if offer.devices and self.device not in offer.devices:
                log.info("model %s is pushed to %s, not to this device", name, list(offer.devices))
                return withdrew
            try:
                manifest = verify_manifest(offer.manifest, offer.signature, self.public_key)
            except ManifestError as exc:
                return self._refuse(name, _claimed_version(offer.manifest), str(exc), digest)
            if rec is not None and manifest.version <= rec["version"]:
                log.info("ignoring %s v%d: v%d is active", name, manifest.version, rec["version"])
                return withdrew
            try:
                self._check(name, manifest, offer)
            except RefusedError as exc:
                return self._refuse(name, manifest.version, str(exc), digest)
            if t is not None:
                self._close_transfer(name, delete=False)
            self._start(name, offer, manifest, digest)
            return True

    def _withdraw(self, name: str, offer: model_push.ModelOffer) -> bool:
        """Leave a version the fleet withdrew (a stopped rollout) for the previous one; whether it did.

        Only to the version this device ran before, and only when the offer's signed
        manifest names that very file: a withdrawal never installs anything new.
        """
        t = self.transfers.get(name)
        changed = False
        if t is not None and t.manifest.version in offer.withdrawn:
            self._close_transfer(name, delete=True)
            reason = "withdrawn by the fleet (staged rollout stopped) before it was installed"
            changed = self._refuse(name, t.manifest.version, reason, t.digest)
        rec = self.records.get(name)
        if rec is None or rec["version"] not in offer.withdrawn:
            return changed
        prev = rec.get("previous")
        try:
            m = verify_manifest(offer.manifest, offer.signature, self.public_key)
            if prev is None or (m.version, m.sha256) != (prev["version"], prev["sha256"]):
                raise ModelLoadError(f"the offer names v{m.version}, not this device's previous version")
            model = self._open(prev)
        except (ManifestError, ModelLoadError, KeyError, OSError) as exc:
            log.error(
                "%s v%d is withdrawn but cannot roll back (%s); it keeps serving", name, rec["version"], exc
            )
            return changed
        restored = dict(prev, previous=None)
        atomic_write_json(self.root / name / ACTIVE, restored, keep_previous=True)
        self.records[name], self.loaded[name] = restored, model
        (self.root / name / rec["file"]).unlink(missing_ok=True)
        # Refused under its offer's digest: that offer is never fetched again.
        reason = f"withdrawn by the fleet (staged rollout stopped); rolled back to v{prev['version']}"
        return self._refuse(name, rec["version"], reason, rec.get("offer_digest", ""))

    def _check(self, name: str, m: ModelManifest, offer: model_push.ModelOffer) -> None:
        if m.name != name:
            raise RefusedError(f"manifest names model {m.name!r}, pushed as {name!r}")
        if self.data_schema_hash is None:
            raise RefusedError(
                "this device's data carries no feature-schema hash, so nothing can check that the model's "
                f"input (schema {m.schema_hash[:12]}) matches it; use a data source with a schema"
            )
        if m.schema_hash != self.data_schema_hash:
            raise RefusedError(
                f"model expects feature schema {m.schema_hash[:12]}..., this device's data follow "
                f"{self.data_schema_hash[:12]}...; export the model for this device's schema"
            )
        if self.holdout is not None and m.input.row_size != self.holdout[1].x.shape[1]:
            raise RefusedError(
                f"model input rows have {m.input.row_size} values, this device's rows "
                f"{self.holdout[1].x.shape[1]}"
            )
        if m.opset > self.cfg.max_opset or m.ir_version > self.cfg.max_ir_version:
            raise RefusedError(
                f"opset {m.opset} / IR {m.ir_version} exceed what this device runs "
                f"(opset {self.cfg.max_opset}, IR {self.cfg.max_ir_version}); export at a lower opset"
            )
        if m.size > self.cfg.max_model_bytes:
            raise RefusedError(
                f"model of {m.size} bytes exceeds model.max_model_bytes {self.cfg.max_model_bytes}"
            )
        if offer.chunk_size > self.cfg.window_bytes:
            raise RefusedError(
                f"chunk size {offer.chunk_size} exceeds model.window_bytes {self.cfg.window_bytes}; "
                "push with smaller chunks"
            )
        if len(offer.chunks) != -(-m.size // offer.chunk_size):
            raise RefusedError(
                f"{len(offer.chunks)} chunks of {offer.chunk_size} bytes cannot hold {m.size} bytes"
            )

    # -- transfer ---------------------------------------------------------------------------
    def _start(self, name: str, offer: model_push.ModelOffer, m: ModelManifest, digest: str) -> None:
        incoming = self.root / name / "incoming"
        part = incoming / f"v{m.version}-{m.sha256[:16]}.part"
        for other in incoming.glob("*.part"):
            if other != part:
                other.unlink(missing_ok=True)
        t = self.transfers[name] = Transfer.open(part, offer, m, digest, self._clock())
        log.info(
            "fetching %s v%d: %d bytes in %d chunks%s",
            name,
            m.version,
            m.size,
            t.n_chunks,
            f" (resuming: {t.resumed} already on disk)" if t.resumed else "",
        )
        if t.complete:
            self._complete(name)
            return
        if self._tap is not None:
            # This version's chunks are handled as the network thread reads them (take_chunk).
            self._tap(self._chunk_filter(name, m.version), self._take)
            if not t.resumed:  # a fresh fetch: every chunk, as the push streams them
                t.stream = self._chunk_filter(name, m.version)
                self._subscribe(t.stream)
                return
        self._fill_window(name, t)

    def _chunk_filter(self, name: str, version: int) -> str:
        """The topic filter of every chunk of ``name`` v``version``."""
        return topics.topic_model_chunk(self.fleet, name, version, 0).rpartition("/")[0] + "/+"

    def _fill_window(self, name: str, t: Transfer) -> None:
        if t.stream:
            return  # the stream subscription brings them
        for i in t.to_request(max(1, self.cfg.window_bytes // t.offer.chunk_size)):
            self._subscribe(topics.topic_model_chunk(self.fleet, name, t.manifest.version, i))

    def _take(self, msg: Any) -> bool:
        """The session's tap on a version's chunk topics (network thread): see :meth:`take_chunk`."""
        try:
            parsed = topics.parse_topic(msg.topic)
        except codec.WireError:
            return False  # the daemon's thread logs and drops it
        if parsed.kind != "model_chunk" or parsed.model is None or parsed.fleet != self.fleet:
            return False
        return self.take_chunk(parsed.model, int(parsed.version), int(parsed.index), msg.payload)

    def take_chunk(self, name: str, version: int, index: int, payload: bytes) -> bool:
        """Write one chunk on the session's network thread, straight from its payload.

        Returns ``False`` for what the daemon's thread must do instead (it then gets the
        message and calls :meth:`handle_chunk`): the transfer's last chunk (finishing the
        file: fsync, hash check, onnxruntime load, holdout score, activation) and a chunk
        that is refused (the refusal is reported with the status).  ``True`` otherwise,
        including for the chunks :meth:`handle_chunk` would ignore.
        """
        with self._lock:
            t = self.transfers.get(name)
            if t is None or t.manifest.version != version or index in t.have or index >= t.n_chunks:
                return True
            if not payload:
                return True
            if len(t.have) + 1 >= t.n_chunks:
                return False
            requested = index in t.inflight  # by its own subscription (not the stream's)
            try:
                chunk = model_push.ModelChunk.decode(payload, max_bytes=t.offer.chunk_size, verify=False)
                if chunk.index != index:
                    return False
                if not t.accept(chunk, self._clock()):
                    return True  # a stale copy from an earlier push: ignored (this push's copy follows)
            except (codec.WireError, RefusedError):
                return False  # handle_chunk refuses it (nothing was written)
            if requested:
                self._unsubscribe(topics.topic_model_chunk(self.fleet, name, version, index))
            self._fill_window(name, t)
            return True

    def handle_chunk(self, name: str, version: int, index: int, payload: bytes) -> bool:
        """Act on one chunk; returns whether the status changed."""
        with self._lock:
            t = self.transfers.get(name)
            if t is None or t.manifest.version != version or index in t.have or index >= t.n_chunks:
                return False
            if not payload:
                return False
            requested = index in t.inflight  # by its own subscription (not the stream's)
            try:
                # A view of the payload, hashed once into the file's sha256 (model_transfer).
                chunk = model_push.ModelChunk.decode(payload, max_bytes=t.offer.chunk_size, verify=False)
                if chunk.index != index:
                    raise RefusedError(f"chunk on the topic of #{index} says it is #{chunk.index}")
                if not t.accept(chunk, self._clock()):
                    # A stale retained copy from an earlier push of this version: the push now under
                    # way publishes its own copy on this topic, and we stay subscribed for it.
                    log.info(
                        "%s v%d chunk %d is from another push; waiting for this one's", name, version, index
                    )
                    return False
            except (codec.WireError, RefusedError) as exc:
                self._close_transfer(name, delete=True)
                return self._refuse(name, version, f"bad chunk: {exc}", t.digest)
            if requested:
                self._unsubscribe(topics.topic_model_chunk(self.fleet, name, version, index))
            if t.complete:
                self._complete(name)
                return True
            self._fill_window(name, t)
            return False

    def tick(self) -> bool:
        """Abandon transfers that made no progress for ``transfer_timeout_s``.

        Returns whether the status changed: a transfer was abandoned, or one progressed
        since the last tick (progress is reported once per tick, not once per chunk).
        """
        changed = False
        with self._lock:
            now = self._clock()
            for name, t in list(self.transfers.items()):
                if len(t.have) != t.reported:
                    t.reported, changed = len(t.have), True
                if t.stream and now - t.last_progress >= STREAM_QUIET_S:
                    # The stream went quiet with chunks missing: ask for them from their retained topics.
                    log.info(
                        "%s v%d: %d of %d chunks streamed in; fetching the rest a window at a time",
                        name,
                        t.manifest.version,
                        len(t.have),
                        t.n_chunks,
                    )
                    self._unsubscribe(t.stream)
                    t.stream = ""
                    self._fill_window(name, t)
                if now - t.last_progress > self.cfg.transfer_timeout_s:
                    self._close_transfer(name, delete=False)  # kept: a re-push resumes from it
                    changed |= self._refuse(
                        name,
                        t.manifest.version,
                        f"transfer stalled at {len(t.have)} of {t.n_chunks} chunks for "
                        f"{self.cfg.transfer_timeout_s:g} s (chunks missing on the broker?); push again",
                        t.digest,
                    )
        return changed

    def _close_transfer(self, name: str, *, delete: bool) -> None:
        t = self.transfers.pop(name, None)
        if t is None:
            return
        for i in t.inflight:
            self._unsubscribe(topics.topic_model_chunk(self.fleet, name, t.manifest.version, i))
        if t.stream:
            self._unsubscribe(t.stream)
        if self._tap is not None:
            self._tap(self._chunk_filter(name, t.manifest.version), None)
        t.close()
        if delete:
            t.part.unlink(missing_ok=True)

    def close(self) -> None:
        """Close open transfer files (their progress stays on disk for the next start)."""
        with self._lock:
            for name in list(self.transfers):
                self._close_transfer(name, delete=False)

    def _complete(self, name: str) -> None:
        t = self.transfers[name]
        m = t.manifest
        size, digest = t.finish()
        self._close_transfer(name, delete=False)
        seconds = self._clock() - t.started
        if size != m.size or digest != m.sha256:
            bad = t.altered() if size == m.size else []
            t.part.unlink(missing_ok=True)
            self._refuse(
                name,
                m.version,
                f"chunk {bad[0]}'s bytes differ from the offer's table (altered in transit)"
                if bad
                else f"assembled file ({size} bytes, sha256 {digest[:12]}) does not match the signed manifest "
                f"({m.size} bytes, sha256 {m.sha256[:12]}): truncated or tampered",
                t.digest,
            )
            return
        final = self.root / name / f"v{m.version}.onnx"
        # The data are fsynced (finish); the rename becomes durable with active.json's, written in the
        # same folder by the activation (a crash before that leaves the finished .part or a stray file).
        os.replace(t.part, final)
        self.last_transfer[name] = {
            "version": m.version,
            "bytes": m.size,
            "chunks": t.n_chunks,
            "resumed_chunks": t.resumed,
            "seconds": round(seconds, 4),
            # The whole process's CPU (MQTT receive included) from the offer to the verified file.
            "cpu_s": round(time.process_time() - t.started_cpu, 4),
            "completed_at": time.time(),
        }
        log.info("%s v%d received (%d bytes, %.3f s); verifying", name, m.version, m.size, seconds)
        self._activate(name, t.offer, m, t.digest, final)

    # -- activation and rollback ------------------------------------------------------------
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


def _claimed_version(manifest_json: str) -> int | None:
    """The version an unverified manifest claims (for the refusal report only)."""
    try:
        version = json.loads(manifest_json).get("version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


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


def embed_rows(model: LoadedModel, x: np.ndarray) -> np.ndarray:
    """The model's output rows for ``x``, as float32 (the head's input)."""
    return model.run(x).astype(np.float32, copy=False)
