"""Manifests, signatures and the model topics/payloads on the wire (device side: no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from export.keys import generate_keypair, load_private_key, sign
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import (
    ManifestError,
    ModelIOSpec,
    ModelManifest,
    key_id,
    load_public_key,
    verify_manifest,
)

SHA = "ab" * 32


def manifest(**changes) -> ModelManifest:
    base = ModelManifest(
        name="weld-encoder",
        version=3,
        kind="embedding",
        input=ModelIOSpec("x", (None, 624)),
        output=ModelIOSpec("z", (None, 50)),
        schema_hash=SHA,
        sha256="cd" * 32,
        size=557_396,
        opset=17,
        ir_version=8,
        parity={"max_abs_diff": 1e-6, "n_inputs": 256.0, "tolerance": 1e-5},
        created_at="2026-01-01T00:00:00+00:00",
        key_id="0" * 16,
    )
    return replace(base, **changes)


@pytest.fixture(scope="module")
def keypair(tmp_path_factory):
    priv, pub = generate_keypair(tmp_path_factory.mktemp("k") / "fleet.key")
    return load_private_key(priv), load_public_key(pub), priv


def test_a_signed_manifest_verifies_and_round_trips(keypair):
    key, public, _ = keypair
    m = manifest(key_id=key_id(public))
    text = m.to_json()
    assert json.loads(text)["input"]["shape"] == [None, 624]
    back = verify_manifest(text, sign(text, key), public)
    assert back == m and back.input.row_size == 624


def test_wrong_key_and_any_altered_byte_fail_verification(keypair, tmp_path):
    key, public, _ = keypair
    other, _ = generate_keypair(tmp_path / "other.key")
    text = manifest().to_json()
    with pytest.raises(ManifestError, match="signature does not verify"):
        verify_manifest(text, sign(text, load_private_key(other)), public)
    signature = sign(text, key)
    with pytest.raises(ManifestError, match="signature does not verify"):
        verify_manifest(text.replace('"size":557396', '"size":557397'), signature, public)


def test_key_files_refuse_to_be_overwritten_and_are_private(keypair):
    _, _, priv = keypair
    assert priv.stat().st_mode & 0o077 == 0
    with pytest.raises(FileExistsError, match="refusing to replace"):
        generate_keypair(priv)


def test_manifests_that_cannot_be_served_are_malformed():
    with pytest.raises(ManifestError, match="dynamic batch"):
        ModelIOSpec("x", (1, 624))
    with pytest.raises(ManifestError, match="version"):
        manifest(version=0)
    with pytest.raises(ManifestError, match="sha256"):
        manifest(sha256="xyz")
    with pytest.raises(ManifestError, match="malformed"):
        ModelManifest.from_json(json.dumps({"name": "a"}))


def test_model_topics_parse_and_reject_odd_numbers():
    t = topics.parse_topic(topics.topic_model_chunk("plant", "weld-encoder", 12, 0))
    assert (t.kind, t.model, t.version, t.index) == ("model_chunk", "weld-encoder", 12, 0)
    assert topics.parse_topic(topics.topic_model_offer("plant", "enc")).kind == "model_offer"
    for bad in (
        "ioft/v1/plant/model/enc/01/chunk/1",
        "ioft/v1/plant/model/enc/0/chunk/1",
        "ioft/v1/plant/model/enc/1/chunk/-1",
        "ioft/v1/plant/model/enc/1/chunk/²",
    ):
        with pytest.raises(codec.WireError):
            topics.parse_topic(bad)


def test_chunks_carry_their_bytes_and_refuse_corruption_and_oversize():
    chunk = model_push.ModelChunk("enc", 2, 5, bytes(range(256)) * 4)
    payload = chunk.encode()
    assert model_push.ModelChunk.decode(payload, max_bytes=1024) == chunk
    with pytest.raises(codec.WireError, match="exceeds"):
        model_push.ModelChunk.decode(payload, max_bytes=16)
    with pytest.raises(codec.WireError, match="malformed"):
        model_push.ModelChunk.decode(payload[:-7], max_bytes=1024)
    flipped = payload[:-1] + bytes([payload[-1] ^ 1])
    with pytest.raises(codec.WireError, match="own sha256"):
        model_push.ModelChunk.decode(flipped, max_bytes=1024)
    assert (
        model_push.ModelChunk.decode(model_push.ModelChunk("enc", 1, 0, b"").encode(), max_bytes=8).data
        == b""
    )


def test_offers_validate_their_fields():
    offer = model_push.ModelOffer("enc", "{}", "ab" * 64, 128, ("cd" * 32,), ("printer1",), 1.5)
    assert model_push.ModelOffer.decode(offer.encode()) == offer
    with pytest.raises(codec.WireError, match="signature"):
        model_push.ModelOffer.decode(replace(offer, signature="zz").encode())
    with pytest.raises(codec.WireError, match="chunks"):
        model_push.ModelOffer.decode(replace(offer, chunks=("nothex",)).encode())
    with pytest.raises(codec.WireError, match="device id"):
        model_push.ModelOffer.decode(replace(offer, devices=("Bad Device",)).encode())


DEVICE_SIDE = """
import json, sys
import edge.daemon, edge.models.manager, edge.models.onnx, ioft_protocol.manifest
import export.keys, export.package, export.quantize, export.runtime, export.cli
import cloud_aggregator.models.push, cloud_aggregator.console.fleet_status, cloud_aggregator.cli, cloud_aggregator.models.backbones.cli
import cloud_aggregator.models.backbones.data
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def test_the_device_side_and_the_push_never_import_torch():
    out = subprocess.run(
        [sys.executable, "-c", DEVICE_SIDE], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == []
