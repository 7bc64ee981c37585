"""Fetching a pushed model's chunks into a sparse file, in bounded memory.

A fresh fetch, where the session can hand a topic filter's messages over on its network thread
(``tap``), takes the chunks as they stream in on one subscription to the version's chunk topics
(``.../chunk/+``), each written as it is read (:meth:`Fetcher.take_chunk`); the last chunk goes to
the daemon's thread, which finishes the file.  When that stream goes quiet with chunks missing,
and for a resumed fetch or a session without taps, the missing chunks are asked for a bounded
window at a time, each on its own retained topic.  The bytes are assembled and checked by
:mod:`edge.models.transfer`; the finished file is activated by :mod:`edge.models.install`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edge.config import ModelConfig
from edge.models.install import Installed, log
from edge.models.transfer import RefusedError, Transfer
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import ModelManifest
from trainer_lite.data import Dataset

#: A streamed fetch with chunks missing and none received for this long asks for the rest one
#: window at a time (checked by ``tick``, once a second).
STREAM_QUIET_S = 1.0


class Fetcher(Installed):
    """Transfers in progress, one per model name, over the daemon's MQTT session."""

    def __init__(
        self,
        root: str | Path,
        cfg: ModelConfig,
        public_key: Ed25519PublicKey,
        holdout: tuple[Dataset, Dataset] | None,
        *,
        subscribe: Callable[[str], None],
        unsubscribe: Callable[[str], None],
        tap: Callable[[str, Callable[[Any], bool] | None], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self._subscribe, self._unsubscribe, self._tap = subscribe, unsubscribe, tap
        self._clock = clock
        self.transfers: dict[str, Transfer] = {}
        self.last_transfer: dict[str, dict[str, Any]] = {}
        super().__init__(root, cfg, public_key, holdout)

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

    def _wanted(self, name: str, version: int, index: int, payload: bytes) -> Transfer | None:
        """The open transfer this chunk belongs to, unless it is one to ignore: no such transfer or
        version, a chunk already written or out of range, an empty payload (a cleared retained copy)."""
        t = self.transfers.get(name)
        if t is None or t.manifest.version != version or index in t.have or index >= t.n_chunks:
            return None
        return t if payload else None

    def take_chunk(self, name: str, version: int, index: int, payload: bytes) -> bool:
        """Write one chunk on the session's network thread, straight from its payload.

        Returns ``False`` for what the daemon's thread must do instead (it then gets the
        message and calls :meth:`handle_chunk`): the transfer's last chunk (finishing the
        file: fsync, hash check, onnxruntime load, holdout score, activation) and a chunk
        that is refused (the refusal is reported with the status).  ``True`` otherwise,
        including for the chunks :meth:`handle_chunk` would ignore.
        """
        with self._lock:
            t = self._wanted(name, version, index, payload)
            if t is None:
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
            t = self._wanted(name, version, index, payload)
            if t is None:
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
