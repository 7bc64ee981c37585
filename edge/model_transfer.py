"""One model file being assembled from pushed chunks: a sparse temp file in bounded memory.

Chunks are written at their offsets as they come (one at a time in memory); a
restarted device re-hashes the chunks already in the file and keeps those that
match, so it fetches only what it lacks.  ``edge.models`` decides what to fetch and
what to do with the finished file; this module only assembles and checks bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from edge import wire
from edge.manifest import ModelManifest, file_sha256


class RefusedError(Exception):
    """A model offer or file this device will not use; the message is the reason it reports."""


@dataclass
class Transfer:
    """A model being fetched: the offer, the sparse temp file, and which chunks are in."""

    offer: wire.ModelOffer
    manifest: ModelManifest
    digest: str
    part: Path
    fh: BinaryIO
    have: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)
    started: float = 0.0
    last_progress: float = 0.0
    resumed: int = 0
    reported: int = 0
    # While chunks land in order from the first, the file's sha256 is computed as they are
    # written, saving a re-read of the whole file at the end (a third hash pass per byte).
    running: Any = field(default_factory=hashlib.sha256)
    next_in_order: int = 0

    @classmethod
    def open(
        cls, part: Path, offer: wire.ModelOffer, manifest: ModelManifest, digest: str, now: float
    ) -> Transfer:
        """Open (or resume) the temp file: chunks already in it that hash right count as received."""
        part.parent.mkdir(parents=True, exist_ok=True)
        fh = part.open("r+b" if part.exists() else "w+b")
        t = cls(offer, manifest, digest, part, fh, started=now, last_progress=now)
        for i in range(t.n_chunks):
            fh.seek(i * offer.chunk_size)
            data = fh.read(t.chunk_len(i))
            if len(data) == t.chunk_len(i) and hashlib.sha256(data).hexdigest() == offer.chunks[i]:
                t.have.add(i)
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
        for i in range(self.n_chunks):
            if len(self.inflight) >= window:
                break
            if i not in self.have and i not in self.inflight:
                self.inflight.add(i)
                out.append(i)
        return out

    def accept(self, chunk: wire.ModelChunk, now: float) -> bool:
        """Write ``chunk`` if it belongs here; ``False`` for a stale copy of an earlier push.

        Raises
        ------
        RefusedError
            If the chunk claims to be another one, has the wrong length, or its bytes
            differ from the offer's table (altered in transit).
        """
        m, index = self.manifest, chunk.index
        if chunk.transfer != self.offer.transfer:
            return False
        if (chunk.name, chunk.version) != (m.name, m.version) or not 0 <= index < self.n_chunks:
            raise RefusedError(f"chunk says it is {chunk.name} v{chunk.version} #{index}")
        if len(chunk.data) != self.chunk_len(index):
            raise RefusedError(f"chunk {index} has {len(chunk.data)} bytes, expected {self.chunk_len(index)}")
        if chunk.sha256 != self.offer.chunks[index]:  # decode hashed the bytes already
            raise RefusedError(f"chunk {index}'s sha256 differs from the offer's table (altered in transit)")
        self.fh.seek(index * self.offer.chunk_size)
        self.fh.write(chunk.data)
        if index == self.next_in_order:
            self.running.update(chunk.data)
            self.next_in_order += 1
        self.have.add(index)
        self.inflight.discard(index)
        self.last_progress = now
        return True

    def finish(self) -> tuple[int, str]:
        """Flush, fsync and close the file; its size and sha256."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.close()
        in_order = self.next_in_order == self.n_chunks  # every byte went through the running hash
        return self.part.stat().st_size, self.running.hexdigest() if in_order else file_sha256(self.part)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
