"""A signed model package: the ONNX file and its manifest, ready to push (no torch here).

``<out>/<name>-v<version>.onnx`` and ``<out>/<name>-v<version>.manifest.json``; the
latter holds ``{"manifest": <canonical JSON text>, "signature": <hex>}``, the exact
bytes the fleet key signed, so the push forwards them untouched.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from export.keys import sign, signing_key_id
from ioft_protocol.manifest import ManifestError, ModelIOSpec, ModelManifest, file_sha256, verify_manifest
from ioft_protocol.state import atomic_write_json
from sensors.features.schema import SCHEMA_HASH_KEY

if TYPE_CHECKING:  # onnx is loaded where a file is read: `push` and every CLI start go without it
    import onnx

#: Parity bound of an export: max |onnxruntime − torch| ≤ this × max(1, max |torch output|).
PARITY_TOLERANCE = 1e-5


class ExportError(RuntimeError):
    """The export failed a check; no file was left at the target path."""


def _spec(value_info: onnx.ValueInfoProto) -> ModelIOSpec:
    dims = value_info.type.tensor_type.shape.dim
    shape = tuple(
        None if d.HasField("dim_param") or not d.HasField("dim_value") else int(d.dim_value) for d in dims
    )
    import onnx

    elem = value_info.type.tensor_type.elem_type
    dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}.get(elem)
    if dtype is None:
        raise ExportError(
            f"{value_info.name!r} has ONNX element type {elem}; only float32/float64 are served"
        )
    return ModelIOSpec(value_info.name, shape, dtype)


def graph_io(model: onnx.ModelProto) -> tuple[ModelIOSpec, ModelIOSpec]:
    """The single input and first output of a graph, as manifest tensor specs."""
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise ExportError(f"devices feed one input; the graph has {[i.name for i in inputs]}")
    return _spec(inputs[0]), _spec(model.graph.output[0])


def opset_of(model: onnx.ModelProto) -> int:
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


@dataclass(frozen=True)
class Package:
    """A packaged model on disk."""

    onnx_path: Path
    manifest_path: Path
    manifest_json: str
    signature: str

    @property
    def manifest(self) -> ModelManifest:
        return ModelManifest.from_json(self.manifest_json)


def package_model(
    onnx_path: str | Path,
    out_dir: str | Path,
    *,
    name: str,
    version: int,
    kind: str,
    key: Ed25519PrivateKey,
    parity: dict[str, float],
    quantization: str | None = None,
    extra: dict[str, str] | None = None,
) -> Package:
    """Describe ``onnx_path`` in a manifest, sign it, and write both under ``out_dir``.

    The input spec, opset and IR version are read from the file itself, and the
    feature-schema hash from its ``metadata_props``, so the manifest cannot claim
    what the file does not say.
    """
    import onnx

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path))
    schema_hash = _schema_hash(model, onnx_path)
    spec_in, spec_out = graph_io(model)
    out_dir = Path(out_dir)
    stem = f"{name}-v{version}"
    target = _copy_into(onnx_path, out_dir / f"{stem}.onnx")
    manifest = ModelManifest(
        name=name,
        version=version,
        kind=kind,
        input=spec_in,
        output=spec_out,
        schema_hash=schema_hash,
        sha256=file_sha256(target),
        size=target.stat().st_size,
        opset=opset_of(model),
        ir_version=int(model.ir_version),
        parity={k: float(v) for k, v in parity.items()},
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        key_id=signing_key_id(key),
        quantization=quantization,
        extra=dict(extra or {}),
    )
    text = manifest.to_json()
    signature = sign(text, key)
    verify_manifest(text, signature, key.public_key())  # a package that does not verify is never written
    manifest_path = out_dir / f"{stem}.manifest.json"
    atomic_write_json(manifest_path, {"manifest": text, "signature": signature})
    return Package(target, manifest_path, text, signature)


def _schema_hash(model: onnx.ModelProto, onnx_path: Path) -> str:
    """The feature-schema hash in the model's ``metadata_props``; refuses a model without one."""
    meta = {p.key: p.value for p in model.metadata_props}
    if SCHEMA_HASH_KEY not in meta:
        raise ExportError(
            f"{onnx_path.name} carries no {SCHEMA_HASH_KEY}; export it with the schema metadata"
        )
    return meta[SCHEMA_HASH_KEY]


def _copy_into(onnx_path: Path, target: Path) -> Path:
    """``onnx_path`` copied to ``target`` (its folder made), unless it is already there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.resolve() != onnx_path.resolve():
        shutil.copyfile(onnx_path, target)
    return target


def load_package(path: str | Path) -> Package:
    """A package from its manifest file, its ONNX file, or their common stem."""
    path = Path(path)
    stem = path.name.removesuffix(".manifest.json").removesuffix(".onnx")
    manifest_path = path.with_name(f"{stem}.manifest.json")
    onnx_path = path.with_name(f"{stem}.onnx")
    try:
        body = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no {manifest_path}; export the model first (cloud-aggregator export)"
        ) from None
    except (
        ValueError,
        UnicodeDecodeError,
    ) as exc:  # cut short (a full disk, a copy interrupted), or not ours
        raise ManifestError(
            f"{manifest_path} is not a package manifest (not JSON: {exc}); export the model again"
        ) from None
    if not isinstance(body, dict) or not {"manifest", "signature"} <= body.keys():
        raise ManifestError(
            f"{manifest_path} is not a package manifest (no manifest and signature); export the model again"
        )
    if not onnx_path.exists():
        raise FileNotFoundError(f"{manifest_path} has no {onnx_path.name} beside it")
    return Package(onnx_path, manifest_path, body["manifest"], body["signature"])
