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

The manager (offers, status) is this module; the fetch is :mod:`edge.models.fetch`, the files on
disk and their activation :mod:`edge.models.install`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge.config import ModelConfig
from edge.models.fetch import Fetcher
from edge.models.install import ACTIVE, log
from edge.models.onnx import LoadedModel, ModelLoadError
from edge.models.transfer import RefusedError
from ioft_protocol import codec, model_push
from ioft_protocol.manifest import ManifestError, ModelManifest, verify_manifest, verify_signed_text
from ioft_protocol.state import atomic_write_json
from trainer_lite.data import Dataset

STATUS_REJECTIONS = 5


class ModelManager(Fetcher):
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
        self.device, self.fleet = device, fleet
        self.data_schema_hash = data_schema_hash
        super().__init__(
            root, cfg, public_key, holdout, subscribe=subscribe, unsubscribe=unsubscribe, tap=tap, clock=clock
        )

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
            if self._seen(name, digest):
                return False
            t = self.transfers.get(name)
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

    def _seen(self, name: str, digest: str) -> bool:
        """Whether the offer of this ``digest`` came before: refused (already reported), active, or
        being fetched (a reconnect re-delivers retained messages)."""
        if any(r.get("digest") == digest for r in self.rejections.get(name, [])):
            return True
        rec = self.records.get(name)
        if rec is not None and rec.get("offer_digest") == digest:
            return True
        t = self.transfers.get(name)
        return t is not None and t.digest == digest

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


def _claimed_version(manifest_json: str) -> int | None:
    """The version an unverified manifest claims (for the refusal report only)."""
    try:
        version = json.loads(manifest_json).get("version")
    except (ValueError, AttributeError):
        return None
    return version if isinstance(version, int) and not isinstance(version, bool) else None
