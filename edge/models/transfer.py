"""One model file being assembled from pushed chunks: a sparse temp file in bounded memory.

Chunks are written at their offsets as they come (one at a time in memory, straight
from the received payload: ``ModelChunk.decode(verify=False)`` is a view of it).  Each
byte is hashed once, into the whole file's running sha256 as the prefix grows, and
that signed hash decides; a chunk is matched to the offer's table by the hash it
claims, and only when the file's hash is wrong are the chunks on disk hashed one by
one to name the one altered in transit.  A restarted device re-hashes the chunks
already in the file and keeps those that match, so it fetches only what it lacks.  ``edge.models.fetch`` decides what to fetch and
what to do with the finished file; this module only assembles and checks bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ioft_protocol import model_push
from ioft_protocol.manifest import ModelManifest, file_sha256


class RefusedError(Exception):
    """A model offer or file this device will not use; the message is the reason it reports."""


@dataclass
class Transfer:
    """A model being fetched: the offer, the sparse temp file, and which chunks are in."""

    offer: model_push.ModelOffer
    manifest: ModelManifest
    digest: str
    part: Path
    fh: BinaryIO
    have: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    #: Missing chunks not yet asked for, in file order (``to_request`` takes from the front).
    todo: deque[int] = field(default_factory=deque)
    #: The push's ``model_push.transfer_id``, computed once (chunks are checked against it).
    transfer_id: str = ""
    #: The version's chunk-topic filter while the chunks stream in on one subscription to it
    #: (``edge.models.fetch``); empty once the fetch asks for the missing chunks one window at a time.
    stream: str = ""
    started: float = 0.0
    #: The process's CPU time at the start (``last_transfer.cpu_s``: what fetching cost this device).
    started_cpu: float = field(default_factory=time.process_time)
    last_progress: float = 0.0
    resumed: int = 0
    reported: int = 0
    # The file's sha256 is computed as the chunks from the first on are in (each chunk's bytes
    # once, in file order), saving a re-read of the whole file at the end.
    running: Any = field(default_factory=lambda: hashlib.sha256())
    next_in_order: int = 0

    @classmethod
    def open(
        cls, part: Path, offer: model_push.ModelOffer, manifest: ModelManifest, digest: str, now: float
    ) -> Transfer:
        """Open (or resume) the temp file: chunks already in it that hash right count as received."""
        part.parent.mkdir(parents=True, exist_ok=True)
        fh = part.open("r+b" if part.exists() else "w+b")
        t = cls(offer, manifest, digest, part, fh, transfer_id=offer.transfer, started=now, last_progress=now)
        if part.stat().st_size:  # resuming: keep the chunks already in the file that hash right
            for i in range(t.n_chunks):
                fh.seek(i * offer.chunk_size)
                data = fh.read(t.chunk_len(i))
                if len(data) == t.chunk_len(i) and hashlib.sha256(data).hexdigest() == offer.chunks[i]:
                    t.have.add(i)
            t._advance()
        t.todo.extend(i for i in range(t.n_chunks) if i not in t.have)
        t.resumed = len(t.have)
        return t

    @property
    def n_chunks(self) -> int:
        return len(self.offer.chunks)

    @property
    def complete(self) -> bool:
        return len(self.have) == self.n_chunks

    def chunk_len(self, index: int) -> int:
        return min(self.offer.chunk_size, self.manifest.size - index * self.offer.chunk_size)

    def to_request(self, window: int) -> list[int]:
        """Missing chunks to ask for now so that at most ``window`` are in flight (marked in flight)."""
        out = []
        while self.todo and len(self.inflight) < window:
            i = self.todo.popleft()
            if i not in self.have:
                self.inflight.add(i)
                out.append(i)
        return out

    def accept(self, chunk: model_push.ModelChunk, now: float) -> bool:
        """Write ``chunk`` if it belongs here; ``False`` for a stale copy of an earlier push.

        Raises
        ------
        RefusedError
            If the chunk claims to be another one, has the wrong length, or its bytes
            differ from the offer's table (altered in transit).
        """
        m, index = self.manifest, chunk.index
        if chunk.transfer != self.transfer_id:
            return False
        if (chunk.name, chunk.version) != (m.name, m.version) or not 0 <= index < self.n_chunks:
            raise RefusedError(f"chunk says it is {chunk.name} v{chunk.version} #{index}")
        if len(chunk.data) != self.chunk_len(index):
            raise RefusedError(f"chunk {index} has {len(chunk.data)} bytes, expected {self.chunk_len(index)}")
        if chunk.sha256 != self.offer.chunks[index]:  # the hash it claims (its bytes: the file's hash)
            raise RefusedError(f"chunk {index}'s sha256 differs from the offer's table (altered in transit)")
        self.fh.seek(index * self.offer.chunk_size)
        self.fh.write(chunk.data)
        self.have.add(index)
        self.inflight.discard(index)
        self.last_progress = now
        if index == self.next_in_order:
            self.running.update(chunk.data)
            self.next_in_order += 1
            self._advance()
        return True

    def _advance(self) -> None:
        """Feed the chunks now contiguous with the hashed prefix (ones that came early) to the running sha256."""
        while self.next_in_order in self.have:
            self.fh.seek(self.next_in_order * self.offer.chunk_size)
            self.running.update(self.fh.read(self.chunk_len(self.next_in_order)))
            self.next_in_order += 1

    def altered(self) -> list[int]:
        """Chunks whose bytes in the file differ from the offer's table (after a wrong file hash)."""
        bad = []
        with self.part.open("rb") as fh:
            for i in range(self.n_chunks):
                fh.seek(i * self.offer.chunk_size)
                if hashlib.sha256(fh.read(self.chunk_len(i))).hexdigest() != self.offer.chunks[i]:
                    bad.append(i)
        return bad

    def finish(self) -> tuple[int, str]:
        """Flush, fsync and close the file; its size and sha256."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.close()
        hashed = self.next_in_order == self.n_chunks  # every chunk went through the running hash
        return self.part.stat().st_size, self.running.hexdigest() if hashed else file_sha256(self.part)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
