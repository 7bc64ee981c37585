"""`cloud-aggregator fleet init`: what it writes, with which permissions, and what it refuses."""

from __future__ import annotations

import base64
import hashlib
import shutil
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloud_aggregator import fleet_init
from cloud_aggregator.cli import main as cli_main
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.fleet_init import (
    AGGREGATOR,
    OPERATOR,
    FleetInitError,
    acl_text,
    init_fleet,
    mosquitto_password_hash,
)
from edge.config import DeviceConfig
from ioft_protocol.config import build, load_toml

DEVICES = ["printer1", "welder1"]


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_certificates_are_a_fleet_ca_a_broker_and_one_identity_each(tmp_path):
    layout = init_fleet(
        tmp_path / "f", "plant", DEVICES, hosts=["broker.plant.example", "10.0.0.5"], port=8884
    )
    ca = _cert(layout.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = _cert(layout.root / "broker" / "server.crt")
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.plant.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]
    for name in [*DEVICES, AGGREGATOR, OPERATOR]:
        cert = _cert(layout.cert(name))
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH
        ]
        assert _mode(layout.key(name)) == 0o600 and _mode(layout.cert(name)) == 0o644
    assert _mode(layout.root / "ca" / "ca.key") == 0o600
    assert _mode(layout.root / "broker" / "server.key") == 0o600
    assert layout.broker_url == "mqtts://broker.plant.example:8884"


def test_client_configs_load_against_the_schemas(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    for d in DEVICES:
        cfg = build(DeviceConfig, load_toml(layout.toml(d)))
        assert (cfg.device, cfg.fleet, cfg.broker, cfg.allow_plaintext) == (
            d,
            "plant",
            layout.broker_url,
            False,
        )
        assert (cfg.tls.ca_file, cfg.tls.cert_file, cfg.tls.key_file) == (
            str(layout.ca_cert),
            str(layout.cert(d)),
            str(layout.key(d)),
        )
    for name in (AGGREGATOR, OPERATOR):
        cfg = build(AggregatorConfig, load_toml(layout.toml(name)))
        assert cfg.tls.cert_file == str(layout.cert(name)) and cfg.username is None
    assert str(layout.signing_key) in layout.toml(OPERATOR).read_text()


def test_devices_trust_the_fleets_model_signing_key_and_no_other(tmp_path):
    from export.keys import load_private_key, sign
    from ioft_protocol.manifest import ManifestError, load_public_key, verify_manifest

    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    assert _mode(layout.signing_key) == 0o600
    other = init_fleet(tmp_path / "g", "plant", DEVICES)
    for d in DEVICES:
        public = load_public_key(build(DeviceConfig, load_toml(layout.toml(d))).model.public_key)
        text = '{"name": "enc", "version": 1}'
        public.verify(bytes.fromhex(sign(text, load_private_key(layout.signing_key))), text.encode())
        with pytest.raises(ManifestError, match="does not verify"):
            verify_manifest(text, sign(text, load_private_key(other.signing_key)), public)
    conf = layout.mosquitto_conf.read_text()
    for line in (
        "allow_anonymous false",
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
        f"acl_file {layout.acl}",
        "listener 8883",
    ):
        assert f"\n{line}\n" in conf, line
    assert "password_file" not in conf


def test_the_acl_lets_devices_write_only_their_own_topics():
    acl = acl_text("plant")
    rules = [line for line in acl.splitlines() if line and not line.startswith("#")]
    device = rules[: rules.index(f"user {AGGREGATOR}")]
    # Every device rule is a pattern; the only writes are on the device's own uplink and status.
    assert all(r.startswith("pattern ") for r in device)
    assert [r for r in device if r.startswith(("pattern write", "pattern readwrite"))] == [
        "pattern write ioft/v1/plant/task/+/up/%u",
        "pattern write ioft/v1/plant/status/%u",
    ]
    # What a device reads naming one device names itself.
    assert "pattern read ioft/v1/plant/task/+/down/%u" in device
    assert not [r for r in device if "/up/" in r and "read" in r.split()[1]]
    aggregator = rules[rules.index(f"user {AGGREGATOR}") + 1 : rules.index(f"user {OPERATOR}")]
    assert "topic read ioft/v1/plant/task/+/up/+" in aggregator
    assert not [r for r in aggregator if "write" in r.split()[1] and "/down" not in r]


def test_passwords_are_hashed_as_mosquitto_2_expects(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, auth="passwords")
    lines = (layout.root / "broker" / "passwd").read_text().splitlines()
    assert _mode(layout.root / "broker" / "passwd") == 0o600
    assert sorted(line.split(":")[0] for line in lines) == sorted([*DEVICES, AGGREGATOR, OPERATOR])
    for line in lines:
        user, hashed = line.split(":", 1)
        _, seven, iterations, salt, digest = hashed.split("$")
        assert seven == "7" and len(base64.b64decode(salt)) == 12
        password = load_toml(layout.toml(user))["password"]
        assert base64.b64decode(digest) == hashlib.pbkdf2_hmac(
            "sha512", password.encode(), base64.b64decode(salt), int(iterations)
        )
        assert _mode(layout.toml(user)) == 0o600  # it holds the password
    conf = layout.mosquitto_conf.read_text()
    assert (
        "require_certificate false" in conf and f"password_file {layout.root / 'broker' / 'passwd'}" in conf
    )
    dev = build(DeviceConfig, load_toml(layout.toml("printer1")))
    assert dev.username == "printer1" and dev.tls.cert_file is None


def test_our_hash_matches_mosquitto_passwd(tmp_path):
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd is not installed")
    passwd = tmp_path / "passwd"
    subprocess.run([tool, "-c", "-b", str(passwd), "printer1", "s3cret pass"], check=True)
    line = passwd.read_text().strip()
    _, hashed = line.split(":", 1)
    _, _, iterations, salt, _ = hashed.split("$")
    ours = mosquitto_password_hash("s3cret pass", salt=base64.b64decode(salt), iterations=int(iterations))
    assert ours == hashed


def test_an_existing_fleet_is_replaced_only_with_force(tmp_path):
    out = tmp_path / "f"
    init_fleet(out, "plant", DEVICES)
    ca_before = (out / "ca" / "ca.crt").read_bytes()
    with pytest.raises(FleetInitError, match="--force"):
        init_fleet(out, "plant", ["printer9"])
    assert (out / "ca" / "ca.crt").read_bytes() == ca_before and not (out / "devices" / "printer9").exists()
    init_fleet(out, "plant", ["printer9"], force=True)
    assert (out / "ca" / "ca.crt").read_bytes() != ca_before
    assert sorted(p.name for p in (out / "devices").iterdir()) == ["printer9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no temp or old folders left


def test_a_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    real = fleet_init._Issuer.issue
    calls = []

    def flaky(self, cn, **kw):
        calls.append(cn)
        if cn == "welder1":
            raise OSError("disk full")
        return real(self, cn, **kw)

    monkeypatch.setattr(fleet_init._Issuer, "issue", flaky)
    with pytest.raises(OSError, match="disk full"):
        init_fleet(tmp_path / "f", "plant", DEVICES)
    assert "printer1" in calls and list(tmp_path.iterdir()) == []


def test_every_bad_argument_is_listed_at_once(tmp_path):
    with pytest.raises(FleetInitError) as info:
        init_fleet(tmp_path / "f", "Plant!", ["printer1", "printer1", AGGREGATOR, "Bad Id"], auth="psk")
    text = str(info.value)
    for part in (
        "fleet id 'Plant!'",
        "auth must be one of certs, passwords",
        "reserved",
        "repeated: printer1",
        "'Bad Id'",
    ):
        assert part in text, part
    assert not (tmp_path / "f").exists()


def test_command_line(tmp_path, capsys):
    out = tmp_path / "f"
    args = ["fleet", "init", "--fleet", "plant", "--devices", "printer1,printer2", "--devices", "welder1"]
    assert cli_main([*args, "--out", str(out), "--host", "broker.lan,192.168.1.10", "--port", "8885"]) == 0
    assert sorted(p.name for p in (out / "devices").iterdir()) == ["printer1", "printer2", "welder1"]
    assert "mqtts://broker.lan:8885" in capsys.readouterr().out
    assert cli_main([*args, "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
