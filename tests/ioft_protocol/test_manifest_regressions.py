"""Inputs the fuzzer (checks.fuzz_decoders) found that once escaped their decoder's documented error type."""

from __future__ import annotations

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ioft_protocol.manifest import ManifestError, ModelIOSpec, ModelManifest, verify_manifest


def manifest_dict() -> dict:
    m = ModelManifest(
        "enc", 1, "embedding", ModelIOSpec("x", (None, 4)), ModelIOSpec("z", (None, 2)), "ab" * 32, "cd" * 32,
        10, 17, 8, {}, "2026-01-01T00:00:00+00:00", "0" * 16,
    )  # fmt: skip
    return json.loads(m.to_json())


@pytest.mark.parametrize("field", ["parity", "extra"])
def test_manifest_with_a_non_object_table_is_a_manifest_error(field):
    with pytest.raises(ManifestError, match="malformed"):
        ModelManifest.from_dict({**manifest_dict(), field: 1})


def test_manifest_with_a_lone_surrogate_is_a_manifest_error():
    # A hostile offer's JSON can carry "\udc80": a str with no UTF-8 encoding.
    text = json.loads(json.dumps({"m": json.dumps(manifest_dict())[:-1] + ', "x": "\udc80"}'}))["m"]
    assert "\udc80" in text
    key = Ed25519PrivateKey.generate()
    with pytest.raises(ManifestError, match="signature does not verify"):
        verify_manifest(text, "00" * 64, key.public_key())
