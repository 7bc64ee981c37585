"""Model manifests and their Ed25519 signatures: what a device checks before it trusts a model.

The exporter (``export.package``) writes a manifest as canonical JSON and signs
those exact bytes with the fleet's private key; the device verifies the signature
over the same bytes with the fleet's public key (provisioned on each Pi) and only
then parses them.  Nothing here imports torch: this is the device's half.

A manifest names the model and its version, the ONNX file's sha256 and size, the
input it expects (shape with a dynamic batch, dtype and the feature-schema hash
of the data it was trained on), the output it gives, the opset and IR version,
the parity figures measured at export, and when it was made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

FORMAT = "ioft.model/1"
KINDS = ("embedding", "logits", "regression")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that is malformed, unsigned by the fleet key, or not for this device."""


@dataclass(frozen=True)
class ModelIOSpec:
    """One model input or output: ``shape[0]`` is ``None`` (the dynamic batch axis)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or shape[0] is not None:
            raise ManifestError(
                f"{self.name!r}: the first axis must be the dynamic batch (null), got {shape}"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape[1:]):
            raise ManifestError(f"{self.name!r}: axes after the batch must be positive ints, got {shape}")
        if self.dtype not in ("float32", "float64"):
            raise ManifestError(f"{self.name!r}: dtype must be float32 or float64, got {self.dtype!r}")

    @property
    def row_size(self) -> int:
        """Values per sample (the product of the non-batch axes)."""
        out = 1
        for d in self.shape[1:]:
            out *= int(d)
        return out


@dataclass(frozen=True)
class ModelManifest:
    """What the fleet key vouches for.

    Parameters
    ----------
    name, version
        Topic-safe model name and a version that increases with every push.
    kind
        ``"embedding"`` (an encoder whose output feeds the devices' NumPy heads),
        ``"logits"`` (a classifier) or ``"regression"``.
    input, output
        Tensor specs; ``schema_hash`` is the feature schema the input rows follow
        (a device refuses a model for another schema).
    sha256, size
        Of the ONNX file.
    opset, ir_version
        Of the ONNX file (the device refuses what its onnxruntime cannot run).
    parity
        Export-time checks, e.g. ``{"max_abs_diff": 3e-8, "n_inputs": 256, "tolerance": 1e-5}``.
    quantization
        ``None`` for float32, else e.g. ``"int8-dynamic"``.
    created_at
        ISO-8601 UTC.
    key_id
        First 16 hex digits of the sha256 of the signing public key (names the key in errors).
    extra
        Free-form string facts (backbone, training figures, source parameters).
    """

    name: str
    version: int
    kind: str
    input: ModelIOSpec
    output: ModelIOSpec
    schema_hash: str
    sha256: str
    size: int
    opset: int
    ir_version: int
    parity: dict[str, float]
    created_at: str
    key_id: str
    quantization: str | None = None
    format: str = FORMAT
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            problems.append(f"name {self.name!r} must match [a-z0-9][a-z0-9_-]{{0,62}}")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            problems.append(f"version must be an int >= 1, got {self.version!r}")
        if self.kind not in KINDS:
            problems.append(f"kind must be one of {KINDS}, got {self.kind!r}")
        for key in ("schema_hash", "sha256"):
            if not isinstance(getattr(self, key), str) or not _SHA256.match(getattr(self, key)):
                problems.append(f"{key} must be a sha256 hex digest")
        for key in ("size", "opset", "ir_version"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{key} must be a positive int, got {value!r}")
        if self.format != FORMAT:
            problems.append(f"format {self.format!r} is not {FORMAT!r}")
        if problems:
            raise ManifestError("invalid manifest: " + "; ".join(problems))

    # -- canonical form ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input"]["shape"] = list(self.input.shape)
        out["output"]["shape"] = list(self.output.shape)
        return out

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): the bytes that get signed."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelManifest:
        if not isinstance(raw, dict):
            raise ManifestError("a manifest must be a JSON object")
        try:
            data = dict(raw)
            data["input"] = ModelIOSpec(**data["input"])
            data["output"] = ModelIOSpec(**data["output"])
            data["parity"] = {str(k): float(v) for k, v in data.get("parity", {}).items()}
            data["extra"] = {str(k): str(v) for k, v in data.get("extra", {}).items()}
            return cls(**data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # e.g. "parity": 1
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"malformed manifest: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> ModelManifest:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        return cls.from_dict(raw)


# -- keys and signatures -------------------------------------------------------------
def key_id(public_key: Ed25519PublicKey) -> str:
    """16 hex digits naming a public key (sha256 of its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The fleet's Ed25519 public key from a PEM file (``cloud-aggregator keygen`` writes one)."""
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        raise ManifestError(f"fleet public key {path} not found; copy the fleet's .pub file there") from None
    except ValueError as exc:
        raise ManifestError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ManifestError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def verify_manifest(manifest_json: str, signature_hex: str, public_key: Ed25519PublicKey) -> ModelManifest:
    """Check the signature over the exact manifest bytes, then parse them.

    Raises
    ------
    ManifestError
        If the signature does not verify with ``public_key`` (wrong key or altered
        manifest) or the manifest is malformed.
    """
    try:
        signature = bytes.fromhex(signature_hex)
    except ValueError:
        raise ManifestError("signature is not hex") from None
    try:
        # JSON may carry lone surrogates ("\udc80"), which have no UTF-8 form: nobody signed those bytes.
        public_key.verify(signature, manifest_json.encode())
    except (InvalidSignature, UnicodeEncodeError):
        claimed = ""
        with contextlib.suppress(ValueError, AttributeError):
            claimed = f" (it claims key {json.loads(manifest_json).get('key_id')!r})"
        raise ManifestError(
            f"signature does not verify with the fleet key {key_id(public_key)}{claimed}: "
            "signed with another key, or altered after signing"
        ) from None
    return ModelManifest.from_json(manifest_json)


def verify_signed_text(text: str, signature_hex: str, public_key: Ed25519PublicKey, what: str) -> None:
    """Check the fleet key's Ed25519 signature over ``text`` (e.g. a model withdrawal).

    Raises
    ------
    ManifestError
        If it is absent, not hex, or does not verify with ``public_key``.
    """
    if not signature_hex:
        raise ManifestError(f"{what} carries no signature; the fleet key must sign it")
    try:
        public_key.verify(bytes.fromhex(signature_hex), text.encode())
    except ValueError:
        raise ManifestError(f"{what}: signature is not hex") from None
    except InvalidSignature:
        raise ManifestError(
            f"{what}: signature does not verify with the fleet key {key_id(public_key)}"
        ) from None


def file_sha256(path: str | Path, block: int = 1 << 20) -> str:
    """sha256 of a file, read in blocks (bounded memory)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()
