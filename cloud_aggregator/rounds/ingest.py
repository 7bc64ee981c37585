"""Ingesting a round's uploads: admitted (``cloud_aggregator.rounds.admission``), stored, folded
and filed in the round's collector, in that order, whatever brought them (MQTT, a worker).

An upload counts once it is durable: the admitted ones and the refusals of a batch are stored
in one transaction, and only then folded (a streaming round: one NumPy pass over the batch)
and filed, so a kill at any instant leaves an upload stored or uncounted (its device re-sends
it).  A streaming round checkpoints its partial sum every ``checkpoint_every`` admitted uploads
and drops their stored payloads; :meth:`Ingest.restore` continues a round after a restart.
"""

from __future__ import annotations

import logging
import threading

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, file_verdict
from cloud_aggregator.rounds.collector import RoundCollector
from cloud_aggregator.rounds.types import (
    CollectRequest,
    LateUpdate,
    Reason,
    Refusal,
    RoundStore,
    StoredRefusal,
    StoredUpload,
)

log = logging.getLogger(__name__)

#: Refusals that are the protocol at work, logged at INFO (counted and stored like any other): a
#: device re-sending an upload already counted (after an aggregator restart it re-sends its answer
#: to the round it sees re-announced, which may close on the stored copy before the re-send
#: lands; ``resent`` where it is a copy of the counted one), or answering a round already closed.
ROUTINE_REFUSALS = frozenset({Reason.REPLAY, Reason.STALE_ROUND, Reason.RESENT})
#: Uploads ingested together at most (:meth:`Ingest.take`: one transaction, one fold), and
#: their payload bytes at most: a batch is whatever waited in the queue, up to these.
INGEST_MAX, INGEST_BYTES = 512, 32 * 1024 * 1024
#: An upload to ingest: ``(device, payload, outside, held_out)``: ``outside`` says why the device
#: is outside the task's selection (``None``: it is not), ``held_out`` that it only scores the global.
Upload = tuple[str, bytes, str | None, bool]


class Ingest:
    """The uploads of a fleet's rounds into ``admission``, ``store`` and each round's collector."""

    def __init__(self, admission: Admission, store: RoundStore | None, checkpoint_every: int = 256) -> None:
        self.admission, self.store, self.checkpoint_every = admission, store, checkpoint_every
        self.lock = threading.Lock()  # admission and its counts are shared by every task

    def refusal_row(
        self,
        device: str,
        request: CollectRequest | None,
        verdict: Refusal,
        answering: tuple[str, int | None] | None = None,
    ) -> StoredRefusal:
        """Log a refused upload (admission counted it); the row that stores it, filed under
        ``answering`` (task, round) where given (a worker's batch says which), else ``request``'s round."""
        level = logging.INFO if verdict.reason in ROUTINE_REFUSALS else logging.WARNING
        log.log(level, "dropped update from %s: %s", device, verdict)
        if answering is None:
            answering = (request.spec.name, request.round) if request is not None else ("", None)
        return (*answering, device, verdict.reason, verdict.detail)

    def record_refusal(
        self,
        device: str,
        request: CollectRequest | None,
        verdict: Refusal,
        *,
        answering: tuple[str, int | None] | None = None,
    ) -> None:
        """Log and store a refused upload (admission counted it)."""
        row = self.refusal_row(device, request, verdict, answering)
        if self.store is not None:
            self.store.put_rejection(*row)

    def take(
        self,
        rnd: RoundCollector | None,
        uploads: list[Upload],
        *,
        persist: bool = True,
    ) -> None:
        """Admit a batch of uplinks ``(device, payload, outside, held_out)`` into ``rnd``; never raises.

        Admission judges each in arrival order (one decode, one tensor check); the admitted ones
        and the refusals are stored in one transaction; only then is each admitted upload folded
        (a streaming round: one NumPy pass over the batch) and filed: an upload counts once it is
        durable, so a kill at any instant leaves it stored or uncounted (its device re-sends it).
        ``persist`` ``False``: they were read back from the store.  ``outside`` (why the device is
        outside the task's selection) and ``held_out`` go to admission.
        """
        request = None if rnd is None else rnd.request
        with self.lock:
            verdicts = [
                self.admission.verdict(d, p, request, restored=not persist, outside=o, held_out=h)
                for d, p, o, h in uploads
            ]
        keep: list[StoredUpload] = []
        refusals: list[StoredRefusal] = []
        for (device, payload, _, _), verdict in zip(uploads, verdicts, strict=True):
            if isinstance(verdict, Refusal):
                refusals.append(self.refusal_row(device, request, verdict))
                continue
            if isinstance(verdict, LateUpdate):
                log.info(
                    "late update from %s for round %d counts in round %d",
                    device,
                    verdict.round,
                    request.round,
                )
            if persist:  # durable like any upload: a restart keeps it
                keep.append(self._stored(request, device, verdict, payload))
        if self.store is not None:
            self.store.put_batch(keep, refusals)
        if request is not None and request.fold is not None:
            verdicts = self._fold(request, verdicts)
        if rnd is not None:
            for (device, *_), verdict in zip(uploads, verdicts, strict=True):
                file_verdict(rnd.inbox, device, verdict)  # what rnd.file does, without a call per upload

    @staticmethod
    def _stored(
        request: CollectRequest, device: str, verdict: Update | LateUpdate, payload: bytes
    ) -> StoredUpload:
        """The row that keeps an admitted upload, under the round it answers (a straggler's: its own)."""
        if isinstance(verdict, LateUpdate):
            late = request.late
            return (request.spec.name, late.round, late.phase, device, late.global_hash, payload)
        return (request.spec.name, request.round, request.phase, device, request.global_hash, payload)

    def _fold(
        self, request: CollectRequest, verdicts: list[Update | LateUpdate | Refusal]
    ) -> list[Update | LateUpdate | Refusal]:
        """Fold the admitted uploads among ``verdicts`` into the round's running sum, checkpointing
        every ``checkpoint_every``; the verdicts to file (admitted ones without their params)."""
        fold, every = request.fold, self.checkpoint_every
        out = list(verdicts)
        fresh = [i for i, v in enumerate(verdicts) if isinstance(v, Update)]
        while fresh:
            room = max(1, every - len(fold.pending)) if self.store is not None else len(fresh)
            chunk, fresh = fresh[:room], fresh[room:]
            fold.add_many([verdicts[i] for i in chunk])
            for i in chunk:  # what dataclasses.replace(v, params={}) makes, without its Python
                v = verdicts[i]
                out[i] = Update(v.device, {}, v.n_samples, v.metrics)
            if self.store is not None and len(fold.pending) >= every:
                self.checkpoint(request)
        return out

    def checkpoint(self, request: CollectRequest) -> None:
        """Store the round's partial sum; the uploads it covers leave the store."""
        fold = request.fold
        folded = dict(fold.pending)
        self.store.put_partial(
            request.spec.name, request.round, request.phase, request.global_hash, fold.checkpoint(), folded
        )

    def restore(self, rnd: RoundCollector) -> None:
        """File what the store kept of this round: a streaming round's checkpoint, then the uploads
        that arrived before a restart (no device needs to resend them)."""
        if self.store is None:
            return
        request = rnd.request
        if request.fold is not None:
            self._restore_fold(rnd)
        name, late = request.spec.name, request.late
        stored = self.store.stored_updates(name, request.round, request.phase, request.global_hash)
        if late is not None:
            stored += self.store.stored_updates(name, late.round, late.phase, late.global_hash)
        for chunk in chunks([(device, payload, None, False) for device, payload in stored]):
            self.take(rnd, chunk, persist=False)
        if stored:
            log.info(
                "round %d/%s: %d uploads restored from the store", request.round, request.phase, len(stored)
            )

    def _restore_fold(self, rnd: RoundCollector) -> None:
        """Continue a streaming round from its last checkpoint (a restart): the devices folded in
        it count with their stored sample counts and metrics, and their re-sends are replays."""
        request = rnd.request
        kept = self.store.partial(request.spec.name, request.round, request.phase, request.global_hash)
        if kept is None:
            return
        state, folded = kept
        request.fold.restore(state, folded)
        with self.lock:
            self.admission.restore_folded(request, sorted(folded))
        for device, (n_samples, metrics) in folded.items():
            rnd.file(device, Update(device, {}, n_samples, metrics))
        log.info(
            "round %d/%s: partial sum of %d uploads restored from the store",
            request.round,
            request.phase,
            len(folded),
        )


def chunks(
    uploads: list[Upload],
) -> list[list[Upload]]:
    """``uploads`` in batches of at most ``INGEST_MAX`` uploads and about ``INGEST_BYTES`` bytes."""
    out: list[list[Upload]] = []
    size = INGEST_BYTES
    for upload in uploads:
        if not out or size + len(upload[1]) > INGEST_BYTES or len(out[-1]) >= INGEST_MAX:
            out.append([])
            size = 0
        out[-1].append(upload)
        size += len(upload[1])
    return out
