"""The primitives: X25519 agreement, HKDF, ChaCha20-Poly1305 for shares, AES-256-CTR masks.

Masks come from a cryptographic PRG (AES-CTR keyed by a 32-byte seed), not NumPy's
generators: a predictable mask would unmask an update.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
_NONCE = 12
_RAW = (serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class KeyPair:
    """An X25519 key pair; ``secret`` is the raw 32-byte private key (it may be secret-shared)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._sk = X25519PrivateKey.from_private_bytes(secret) if secret else X25519PrivateKey.generate()
        self.public = self._sk.public_key().public_bytes(*_RAW)

    @property
    def secret(self) -> bytes:
        return self._sk.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def agree(self, peer_public: bytes, *, salt: bytes, info: bytes) -> bytes:
        """A 32-byte key both ends derive: HKDF-SHA256 over the X25519 shared secret."""
        if len(peer_public) != KEY_BYTES:
            raise ValueError(f"a public key is {KEY_BYTES} bytes, got {len(peer_public)}")
        shared = self._sk.exchange(X25519PublicKey.from_public_bytes(peer_public))
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(shared)


def random_seed() -> bytes:
    return os.urandom(KEY_BYTES)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, ciphertext: bytes, aad: bytes) -> bytes | None:
    """The plaintext, or None when the ciphertext was not sealed with this key and ``aad``."""
    try:
        return ChaCha20Poly1305(key).decrypt(ciphertext[:_NONCE], ciphertext[_NONCE:], aad)
    except (InvalidTag, ValueError):
        return None


def mask(seed: bytes, length: int, dtype: np.dtype) -> np.ndarray:
    """``length`` uniform elements of Z/2^r (r = 8 × itemsize) from AES-256-CTR keyed by ``seed``."""
    dtype = np.dtype(dtype)
    enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = enc.update(bytes(length * dtype.itemsize)) + enc.finalize()
    return np.frombuffer(stream, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
