"""The fleet's certificate authority: EC P-256 certificates for the broker and each client, and its CRL.

``cloud-aggregator fleet init`` creates it; ``fleet add-device``, ``renew-device`` and
``revoke-device`` load it from ``ca/ca.crt`` and ``ca/ca.key`` to issue and revoke.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _san(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def pem_cert(cert: x509.Certificate) -> bytes:
    """A certificate as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as unencrypted PKCS#8 PEM (the files are 0600)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


class FleetCA:
    """The fleet CA, with EC P-256 keys throughout.

    mosquitto 2.0.11 on OpenSSL 3 also takes Ed25519 (TLS 1.2 and 1.3, checked by hand),
    but P-256 is what every TLS stack and every hardware key store a Pi may carry
    (TPM 2.0, ATECC608 secure elements) supports.

    Parameters
    ----------
    cert, key
        The CA's certificate and private key.
    """

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key
        self.name = cert.subject

    @classmethod
    def create(cls, fleet: str, days: int) -> FleetCA:
        """A new self-signed CA for ``fleet``, valid ``days``."""
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ioft"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"ioft fleet {fleet} CA"),
            ]
        )
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> FleetCA:
        """The CA from its PEM files (``ca/ca.crt``, ``ca/ca.key``)."""
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path} is not the fleet CA's EC key")
        return cls(x509.load_pem_x509_certificate(cert_path.read_bytes()), key)

    def issue(
        self, cn: str, *, server_hosts: Sequence[str] = (), days: int, minutes: int | None = None
    ) -> tuple[bytes, bytes]:
        """A leaf ``(cert PEM, key PEM)``: a server certificate when ``server_hosts`` is given, else a
        client one.  The extended key usage matters: OpenSSL refuses a server certificate offered as
        a client's, so the broker's key cannot log in as a device named after it.  ``minutes``: valid
        that long instead of ``days`` (a one-off login, ``cloud_aggregator.fleet.sessions``)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + (dt.timedelta(minutes=minutes) if minutes else dt.timedelta(days=days)))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(ca=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        if server_hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(_san(server_hosts)), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return pem_cert(cert), pem_key(key)

    def crl(self, serials: Iterable[int], *, days: int) -> bytes:
        """A CRL (PEM) revoking ``serials``, next update in ``days`` (an expired CRL refuses everyone)."""
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.name)
            .last_update(now - dt.timedelta(minutes=5))
            .next_update(now + dt.timedelta(days=days))
        )
        for serial in sorted(set(serials)):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
            )
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def cert_serial(cert_pem: bytes) -> int:
    """A certificate's serial number."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number


def cert_expiry(cert_pem: bytes) -> dt.datetime:
    """When a certificate stops being valid (UTC)."""
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc


def cert_name(cert_pem: bytes) -> str:
    """A certificate's CN ("" without one)."""
    names = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""
