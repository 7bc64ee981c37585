"""The fleet's Ed25519 signing key: generate, load, sign (cloud side; no torch).

The private key stays with the operator (file mode 0600); the public key is
copied to every device (``[model] public_key`` in its config).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ioft_protocol.manifest import ManifestError, key_id


def generate_keypair(private_path: str | Path, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write a new key pair: ``private_path`` (PKCS#8 PEM, 0600) and ``<private_path stem>.pub``.

    Returns
    -------
    (private key path, public key path)
    """
    private_path = Path(private_path)
    public_path = private_path.with_suffix(".pub")
    if not overwrite and (private_path.exists() or public_path.exists()):
        raise FileExistsError(
            f"{private_path} or {public_path} exists; refusing to replace a fleet key "
            "(devices would reject every model signed with the new one). Pass overwrite to rotate it"
        )
    key = Ed25519PrivateKey.generate()
    private_path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """The fleet's private key from a PEM file."""
    path = Path(path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise ManifestError(
            f"signing key {path} not found; create one with `cloud-aggregator keygen`"
        ) from None
    except (ValueError, TypeError) as exc:
        raise ManifestError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ManifestError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def signing_key_id(private_key: Ed25519PrivateKey) -> str:
    return key_id(private_key.public_key())


def sign(text: str, private_key: Ed25519PrivateKey) -> str:
    """Ed25519 signature of ``text``'s UTF-8 bytes, hex."""
    return private_key.sign(text.encode()).hex()
