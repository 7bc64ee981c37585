"""Advertised SecAgg keys bound to a device's enrolled identity (Bonawitz et al., CCS 2017, §6).

Without a signature, the aggregator relays each device's neighbours' public keys and may swap
in keys of its own: the device then seals its shares to the aggregator and agrees its pairwise
masks with it.  Here each device signs its two advertised keys, with the scope they are for
(fleet, task, round, phase, session) and its own id, using the private key of its TLS client
certificate; it sends the certificate along.  A neighbour uses the keys only when the
certificate chains to the fleet CA (device.toml ``[tls] ca_file``), is valid now, is a
client certificate issued to the device id the keys are for, and the signature verifies.

The fleet CA (``cloud-aggregator fleet init``) issues EC P-256 keys: ECDSA with SHA-256;
Ed25519 keys are taken too.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ioft_protocol.codec import WireError, check_id

#: Names the fleet CA gives to identities that are not devices (``fleet init``'s reserved ids:
#: ``cloud_aggregator.fleet.layout.RESERVED``); workers and bridges carry a dot, outside device ids.
NOT_DEVICES = frozenset({"aggregator", "operator", "ha"})  # ha: Home Assistant's login
#: Bounds an aggregator must respect when relaying a certificate and a signature.
MAX_CERT_BYTES = 8192
MAX_SIGNATURE_BYTES = 512
_DOMAIN = b"ioft-secagg advertised keys v1\x00"

SigningKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


class KeyBindingError(ValueError):
    """An advertisement whose keys are not bound to the device it claims; the message says why."""


def binding(scope: str, session: str, device: str, c_pk: bytes, s_pk: bytes) -> bytes:
    """The bytes a device signs: its keys for this scope and session, under its id (unambiguous JSON)."""
    return _DOMAIN + json.dumps([scope, session, device, c_pk.hex(), s_pk.hex()]).encode()


def certificate_cn(cert: x509.Certificate) -> str | None:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else None
    return value if isinstance(value, str) else None


class KeySigner:
    """This device's signing half: its certificate (DER, sent along) and its private key."""

    def __init__(self, cert: x509.Certificate, key: SigningKey) -> None:
        if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
            raise ValueError("the certificate's key must be EC (as the fleet CA issues) or Ed25519")
        if cert.public_key() != key.public_key():
            raise ValueError("the private key is not the certificate's")
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.name = certificate_cn(cert)
        self._key = key

    @classmethod
    def load(cls, cert_file: str | Path, key_file: str | Path) -> KeySigner:
        """From the PEM files device.toml's ``[tls]`` names; ``ValueError`` naming the file on failure."""
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"tls.cert_file {cert_file}: not a readable PEM certificate ({exc})") from None
        try:
            key = serialization.load_pem_private_key(Path(key_file).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"tls.key_file {key_file}: not a readable, unencrypted PEM key ({exc})"
            ) from None
        return cls(cert, key)  # type: ignore[arg-type]

    def sign(self, message: bytes) -> bytes:
        if isinstance(self._key, ec.EllipticCurvePrivateKey):
            return self._key.sign(message, ec.ECDSA(hashes.SHA256()))
        return self._key.sign(message)


class FleetTrust:
    """The fleet CA a device checks its neighbours' certificates against."""

    def __init__(self, cas: list[x509.Certificate]) -> None:
        if not cas:
            raise ValueError("no CA certificate to check neighbours' keys against")
        self.cas = cas

    @classmethod
    def load(cls, ca_file: str | Path) -> FleetTrust:
        try:
            return cls(x509.load_pem_x509_certificates(Path(ca_file).read_bytes()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"tls.ca_file {ca_file}: not a readable PEM certificate ({exc})") from None

    def check(
        self,
        device: str,
        message: bytes,
        cert_der: bytes,
        signature: bytes,
        *,
        now: dt.datetime | None = None,
    ) -> None:
        """Return when ``signature`` over ``message`` is ``device``'s, by a certificate of the fleet CA.

        Raises
        ------
        KeyBindingError
            Saying which check failed.
        """
        if not cert_der or not signature:
            raise KeyBindingError("its keys came unsigned")
        try:
            cert = x509.load_der_x509_certificate(cert_der)
        except ValueError:
            raise KeyBindingError("its certificate does not parse") from None
        if not any(_issued_by(cert, ca) for ca in self.cas):
            raise KeyBindingError("its certificate is not issued by the fleet CA")
        now = now or dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise KeyBindingError(
                f"its certificate is valid {cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now"
            )
        name = certificate_cn(cert)
        if name != device:
            raise KeyBindingError(f"its certificate is issued to {name!r}, not to {device!r}")
        try:
            check_id("device", name)
        except WireError:
            raise KeyBindingError(f"{name!r} is not a device id") from None
        if name in NOT_DEVICES:
            raise KeyBindingError(f"{name!r} is the {name}'s identity, not a device's")
        if not _client_certificate(cert):
            raise KeyBindingError("its certificate is not a client certificate that may sign")
        key = cert.public_key()
        try:
            if isinstance(key, ec.EllipticCurvePublicKey):
                key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
            elif isinstance(key, ed25519.Ed25519PublicKey):
                key.verify(signature, message)
            else:
                raise KeyBindingError(f"its certificate's {type(key).__name__} cannot sign keys here")
        except InvalidSignature:
            raise KeyBindingError("the signature over its keys does not verify (keys substituted?)") from None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _client_certificate(cert: x509.Certificate) -> bool:
    """Not a CA, may sign, and (where it says) for client authentication: the broker's is not one."""
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return False
    except x509.ExtensionNotFound:
        pass
    try:
        if not cert.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature:
            return False
    except x509.ExtensionNotFound:
        pass
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.CLIENT_AUTH in usages
