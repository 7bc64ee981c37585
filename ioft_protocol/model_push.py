"""Model-push messages: a signed model offer (retained) and the chunks of its ONNX file."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field

import numpy as np
from safetensors.numpy import save as st_save

from ioft_protocol.codec import MAX_PAYLOAD_BYTES, VERSION, WireError, check_id, decode, encode
from ioft_protocol.codec import require_field as _field

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SIGNATURE = re.compile(r"^[0-9a-f]{128}$")
#: A chunk's payload overhead on top of its bytes (safetensors header with our metadata).
CHUNK_OVERHEAD_BYTES = 1024
#: Ceiling on an offer: the manifest plus 65 bytes per chunk hash (a 1 GB model in 128 KiB
#: chunks needs ~0.5 MB).
MAX_OFFER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ModelOffer:
    """A model push, retained on ``model/<name>/manifest``.

    ``manifest`` is the exact JSON text the fleet key signed (``ioft_protocol.manifest``
    parses it only after the signature verifies); ``signature`` is its Ed25519
    signature in hex.  The transfer table is not signed: it lets a device check
    each chunk as it lands, while the signed whole-file sha256 is what decides.
    ``devices`` (empty: the whole fleet) narrows who installs the model.  Every
    chunk of this push carries :attr:`transfer` (a digest of the table), so a device
    can tell a stale retained chunk left by an earlier push of the same version from
    the one this push is about to publish.

    ``withdrawn`` lists versions of this model the fleet took back (a stopped staged
    rollout, ``cloud_aggregator.models.rollout``): a device running one of them goes back to its
    previous version when that is the version this offer's signed manifest names, and
    refuses the withdrawn one from then on.  It can only return a device to a version it
    verified and ran before.  Taking a version back is the fleet key's decision like
    offering it: ``withdrawal_signature`` is the fleet key's Ed25519 signature of
    :func:`withdrawal_text` (this model, these versions), and a device refuses an offer
    whose withdrawal does not verify (else the broker's credential alone could roll the
    fleet back to an older, genuinely signed version).
    """

    name: str
    manifest: str
    signature: str
    chunk_size: int
    chunks: tuple[str, ...]
    devices: tuple[str, ...] = ()
    pushed_at: float = 0.0
    withdrawn: tuple[int, ...] = ()
    withdrawal_signature: str = ""

    @property
    def transfer(self) -> str:
        return transfer_id(self.chunk_size, self.chunks)

    def encode(self) -> bytes:
        fields = {
            "name": self.name,
            "manifest": self.manifest,
            "signature": self.signature,
            "chunk_size": self.chunk_size,
            "chunks": list(self.chunks),
            "devices": list(self.devices),
            "pushed_at": self.pushed_at,
        }
        if self.withdrawn:  # absent otherwise: offers stay byte-identical to earlier ones
            fields["withdrawn"] = list(self.withdrawn)
            fields["withdrawal_signature"] = self.withdrawal_signature
        return encode("model_offer", fields)

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> ModelOffer:
        meta, tensors = decode(payload, max_bytes=max_bytes)
        if meta["kind"] != "model_offer" or tensors:
            raise WireError(f"expected a model offer without tensors, got kind {meta['kind']!r}")
        signature = _field(meta, "signature", str)
        if not _SIGNATURE.match(signature):
            raise WireError("model offer signature must be 128 lowercase hex digits (Ed25519)")
        chunk_size = _field(meta, "chunk_size", int)
        if chunk_size < 1:
            raise WireError(f"chunk_size must be >= 1, got {chunk_size}")
        chunks = _field(meta, "chunks", list)
        if not chunks or not all(isinstance(c, str) and _SHA256.match(c) for c in chunks):
            raise WireError("chunks must be a non-empty list of sha256 hex digests")
        devices = _field(meta, "devices", list)
        withdrawn = meta.get("withdrawn", [])
        if not isinstance(withdrawn, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in withdrawn
        ):
            raise WireError("withdrawn must be a list of model versions (ints >= 1)")
        withdrawal_signature = meta.get("withdrawal_signature", "")
        if not isinstance(withdrawal_signature, str) or not (
            withdrawal_signature == "" or _SIGNATURE.match(withdrawal_signature)
        ):
            raise WireError("withdrawal_signature must be 128 lowercase hex digits (Ed25519)")
        return cls(
            name=check_id("model", _field(meta, "name", str)),
            manifest=_field(meta, "manifest", str),
            signature=signature,
            chunk_size=chunk_size,
            chunks=tuple(chunks),
            devices=tuple(check_id("device", d) for d in devices),
            pushed_at=float(_field(meta, "pushed_at", (int, float))),
            withdrawn=tuple(withdrawn),
            withdrawal_signature=withdrawal_signature,
        )


def withdrawal_text(name: str, versions: tuple[int, ...] | list[int]) -> str:
    """The exact text the fleet key signs to take ``versions`` of model ``name`` back.

    Its ``kind`` keeps it from ever parsing as a manifest, and a manifest from parsing as this.
    """
    body = {"kind": "model_withdrawal", "model": name, "withdrawn": sorted(set(versions))}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def transfer_id(chunk_size: int, chunks: tuple[str, ...] | list[str]) -> str:
    """Digest naming one push's chunking of a file (its chunk size and chunk hashes)."""
    return hashlib.sha256(f"{chunk_size}:{','.join(chunks)}".encode()).hexdigest()


@dataclass(frozen=True)
class ModelChunk:
    """One chunk of a model file, retained on ``model/<name>/<version>/chunk/<index>``.

    ``transfer`` names the push it belongs to (:func:`transfer_id`); ``sha256`` is
    filled in by :meth:`decode`, which has checked it against ``data``.
    """

    name: str
    version: int
    index: int
    data: bytes | memoryview
    transfer: str = ""
    sha256: str = field(default="", compare=False)

    def encode(self, digest: str | None = None) -> bytes:
        """The payload; ``digest`` is the data's sha256 when the caller has just computed it."""
        meta = {
            "v": VERSION,
            "kind": "model_chunk",
            "name": self.name,
            "version": self.version,
            "index": self.index,
            "transfer": self.transfer,
            "sha256": digest or hashlib.sha256(self.data).hexdigest(),
        }
        arr = np.frombuffer(self.data, dtype=np.uint8)
        return st_save(
            {"data": arr}, metadata={"ioft": json.dumps(meta, separators=(",", ":"), sort_keys=True)}
        )

    @classmethod
    def decode(cls, payload: bytes, *, max_bytes: int, verify: bool = True) -> ModelChunk:
        """Parse a chunk (the safetensors layout :meth:`encode` writes, read in place).

        With ``verify`` its own sha256 must match its bytes, and ``data`` is a copy.
        Without, ``sha256`` is the one the chunk claims and ``data`` a zero-copy view of
        ``payload``: the device's path, where the bytes go once through the whole file's
        running sha256 and that signed hash decides (``edge.models.transfer``).
        """
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise WireError(f"payload must be bytes, got {type(payload).__name__}")
        if len(payload) > max_bytes + CHUNK_OVERHEAD_BYTES:
            raise WireError(f"chunk payload of {len(payload)} bytes exceeds the limit of {max_bytes}")
        view = memoryview(payload).cast("B")
        try:
            (header_len,) = struct.unpack_from("<Q", view)
            if not 0 < header_len <= min(len(view) - 8, CHUNK_OVERHEAD_BYTES):
                raise ValueError(f"header length {header_len} does not fit the payload")
            header = json.loads(bytes(view[8 : 8 + header_len]))
            meta = json.loads(header.pop("__metadata__")["ioft"])
            (tensor,) = header.values() if set(header) == {"data"} else (None,)
            if (
                not isinstance(tensor, dict)
                or tensor.get("dtype") != "U8"
                or len(tensor.get("shape", ())) != 1
            ):
                raise ValueError("a model chunk carries exactly one 1-D uint8 tensor named 'data'")
            begin, end = tensor["data_offsets"]
            base = 8 + header_len
            if not (begin == 0 and end == tensor["shape"][0] and base + end == len(view)):
                raise ValueError(f"tensor offsets {tensor['data_offsets']} do not match the payload's size")
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
            raise WireError(f"malformed model chunk: {exc}") from None
        if not isinstance(meta, dict) or meta.get("v") != VERSION or meta.get("kind") != "model_chunk":
            raise WireError(f"not a model chunk: {str(meta)[:200]!r}")
        data = view[base:]
        digest = _field(meta, "sha256", str)
        if verify:
            data = bytes(data)
            if hashlib.sha256(data).hexdigest() != digest:
                raise WireError("model chunk bytes do not match their own sha256 (corrupted or truncated)")
        return cls(
            name=check_id("model", _field(meta, "name", str)),
            version=_field(meta, "version", int),
            index=_field(meta, "index", int),
            data=data,
            transfer=_field(meta, "transfer", str),
            sha256=digest,
        )
