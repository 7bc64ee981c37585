"""`cloud-aggregator fleet init`: what it writes, with which permissions, and what it refuses."""

from __future__ import annotations

import base64
import hashlib
import importlib
import shutil
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloud_aggregator.cli import main as cli_main
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.fleet import devices as fleet_devices
from cloud_aggregator.fleet import init as fleet_init
from cloud_aggregator.fleet import layout as fleet_layout
from cloud_aggregator.fleet import sessions as fleet_sessions
from cloud_aggregator.fleet.init import (
    AGGREGATOR,
    OPERATOR,
    FleetInitError,
    acl_text,
    init_fleet,
    mosquitto_password_hash,
)
from cloud_aggregator.fleet.layout import HOME_ASSISTANT
from cloud_aggregator.local.broker import free_port
from cloud_aggregator.operator import OPERATOR_LOGIN, OPERATOR_SLOTS, claim_operator_login, operator_slot
from edge.config import DeviceConfig, resolve_relative_files
from ioft_protocol.config import ConfigError, build, load_toml

DEVICES = ["printer1", "welder1"]


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _device_config(toml) -> DeviceConfig:
    """A device.toml read the way ``edge-trainer --config`` reads it (paths relative to its folder)."""
    return build(DeviceConfig, resolve_relative_files(load_toml(toml), toml.parent))


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
        cfg = _device_config(layout.toml(d))
        assert (cfg.device, cfg.fleet, cfg.broker, cfg.allow_plaintext, cfg.state_dir) == (
            d,
            "plant",
            layout.broker_url,
            False,
            f"/var/lib/ioft/{d}",
        )
        assert (cfg.tls.ca_file, cfg.tls.cert_file, cfg.tls.key_file) == (
            str(layout.device_ca(d)),
            str(layout.cert(d)),
            str(layout.key(d)),
        )
    for name in (AGGREGATOR, OPERATOR):
        raw = load_toml(layout.toml(name))
        raw.pop("model", None)  # the operator's key for push's check (operator_session drops it)
        cfg = build(AggregatorConfig, raw)
        assert cfg.tls.cert_file == str(layout.cert(name))
        # The operator's own listener wants its password too; the aggregator has none.
        assert cfg.username == (None if name == AGGREGATOR else OPERATOR_LOGIN)  # any free operator.<k>
    assert str(layout.signing_key) in layout.toml(OPERATOR).read_text()
    assert load_toml(layout.toml(OPERATOR))["broker"] == "mqtts://localhost:8884"  # --port + 1


def test_devices_trust_the_fleets_model_signing_key_and_no_other(tmp_path):
    from export.keys import load_private_key, sign
    from ioft_protocol.manifest import ManifestError, load_public_key, verify_manifest

    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    assert _mode(layout.signing_key) == 0o600
    other = init_fleet(tmp_path / "g", "plant", DEVICES)
    for d in DEVICES:
        public = load_public_key(_device_config(layout.toml(d)).model.public_key)
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
        f"crlfile {layout.crl}",
        "listener 8883 localhost",  # loopback unless --bind says otherwise (issue 33)
        "listener 8884 localhost",  # the operator's own
    ):
        assert f"\n{line}\n" in conf, line
    # Each listener makes the login the client id: the operator's too (issue 32 item 3).
    assert conf.count("\nuse_username_as_clientid true\n") == 2
    # Certificate auth: the password file holds the operator's password only (its listener's logins).
    assert f"password_file {layout.operator_passwd}" in conf
    users = [line.split(":")[0] for line in layout.operator_passwd.read_text().splitlines()]
    assert users == [operator_slot(k) for k in range(1, OPERATOR_SLOTS + 1)]
    wide = init_fleet(tmp_path / "w", "plant", DEVICES, bind="all").mosquitto_conf.read_text()
    assert "\nlistener 8883\n" in wide and "\nlistener 8884\n" in wide


def test_the_acl_lets_devices_write_only_their_own_topics():
    acl = acl_text("plant", ["printer1", "welder1"])
    rules = [line for line in acl.splitlines() if line and not line.startswith("#")]
    # No patterns: mosquitto applies one to every login, the aggregator's and operator's included.
    assert not [r for r in rules if r.startswith("pattern ")]

    def block(user: str) -> list[str]:
        start = rules.index(f"user {user}") + 1
        end = next((i for i in range(start, len(rules)) if rules[i].startswith("user ")), len(rules))
        return rules[start:end]

    for device in ("printer1", "welder1"):
        lines = block(device)
        assert "topic read ioft/v1/plant/task/+/down" in lines
        assert "topic read ioft/v1/plant/model/+/manifest" in lines
        assert [r for r in lines if not r.startswith("topic read ")] == [
            f"topic write ioft/v1/plant/task/+/up/{device}",
            f"topic write ioft/v1/plant/task/+/stats/{device}",  # its feature sums (scaling = "fleet")
            f"topic write ioft/v1/plant/status/{device}",
            f"topic write ioft/v1/plant/answer/{device}/+",  # its answers to its own rows (edge.serving)
            f"topic write ioft/v1/plant/alert/{device}/+",  # its alerts (edge.serving.alerts)
            f"topic write ioft/v1/plant/ha/{device}/+/+",  # its Home Assistant configs: serve republishes them
            f"topic write ioft/v1/plant/task/+/secagg/up/{device}",
        ]
        assert f"topic read ioft/v1/plant/task/+/down/{device}" in lines
        assert f"topic read ioft/v1/plant/task/+/secagg/down/{device}" in lines  # SecAgg shares: its own only
    # The operator's certificate alone (CN operator, on the devices' listener) gets nothing; its
    # listener's logins get the operator's rights.
    assert "user operator" not in rules
    # No device writes under Home Assistant's prefix (serve publishes the configs, rebuilt).
    assert not [r for r in rules if r.startswith("topic write homeassistant")]
    # A revoked device: its own status only, which `fleet end-sessions` leaves as revoked.
    revoked = acl_text("plant", ["printer1"], revoked=["welder1"]).split("user welder1\n")[1]
    assert revoked.split("\n\n")[0].strip().splitlines() == ["topic write ioft/v1/plant/status/welder1"]
    assert "user printer2" not in rules  # not enrolled: no reads
    aggregator = block(AGGREGATOR)
    assert "topic read ioft/v1/plant/task/+/up/+" in aggregator
    # Its writes: the downlinks, its own one-aggregator lock, its roll call (ioft_protocol.restate),
    # the pooled feature scaling of scaling = "fleet" tasks and, coordinating plant workers, their
    # control topic.
    assert not [
        r
        for r in aggregator
        if "write" in r.split()[1]
        and "/down" not in r
        and "/aggregator" not in r
        and "/rollcall" not in r
        and not r.endswith("/scaling")
        and not r.endswith("/agg/ctl")
        and r != "topic readwrite homeassistant/#"  # the devices' discovery configs, rebuilt
    ]
    # The devices' answers (edge.serving): the aggregator (and its console) and the operator read them.
    assert "topic read ioft/v1/plant/answer/+/+" in aggregator
    assert "topic read ioft/v1/plant/answer/+/+" in block(operator_slot(1))
    # Their alerts too (edge.serving.alerts): the console shows them.
    assert "topic read ioft/v1/plant/alert/+/+" in aggregator
    assert "topic read ioft/v1/plant/alert/+/+" in block(operator_slot(1))
    # Home Assistant reads the discovery configs and the state topics, and writes nothing.
    assert block(HOME_ASSISTANT) == [
        "topic read homeassistant/#",
        "topic read ioft/v1/plant/status/+",
        "topic read ioft/v1/plant/answer/+/+",
        "topic read ioft/v1/plant/alert/+/+",
    ]


def test_a_device_folder_is_complete_and_works_where_it_is_copied(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    pi = shutil.copytree(layout.identity_dir("printer1"), tmp_path / "elsewhere" / "ioft")
    shutil.rmtree(layout.root)  # nothing may point back into the fleet folder
    cfg = _device_config(pi / "device.toml")
    for path in (cfg.tls.ca_file, cfg.tls.cert_file, cfg.tls.key_file, cfg.model.public_key):
        assert path.startswith(str(pi)) and (tmp_path / path).exists(), path
    assert "fleet.key" not in {p.name for p in pi.iterdir()} and "ca.key" not in {
        p.name for p in pi.iterdir()
    }


def test_edge_resolves_only_relative_paths_against_the_toml_folder(tmp_path):
    raw = {"tls": {"ca_file": "ca.crt", "cert_file": "/abs/d.crt", "key_file": "k/d.key"}, "device": "d"}
    out = resolve_relative_files(raw, tmp_path)
    assert out["tls"] == {
        "ca_file": str(tmp_path / "ca.crt"),
        "cert_file": "/abs/d.crt",
        "key_file": str(tmp_path / "k" / "d.key"),
    }
    assert raw["tls"]["ca_file"] == "ca.crt"  # the caller's dict is not changed


def test_passwords_are_hashed_as_mosquitto_2_expects(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, auth="passwords")
    lines = (layout.root / "broker" / "passwd").read_text().splitlines()
    assert _mode(layout.root / "broker" / "passwd") == 0o600
    slots = [operator_slot(k) for k in range(1, OPERATOR_SLOTS + 1)]
    assert sorted(line.split(":")[0] for line in lines) == sorted(
        [*DEVICES, AGGREGATOR, HOME_ASSISTANT, *slots]
    )
    for line in lines:
        user, hashed = line.split(":", 1)
        _, seven, iterations, salt, digest = hashed.split("$")
        assert seven == "7" and len(base64.b64decode(salt)) == 12
        if user == HOME_ASSISTANT:  # its settings page holds its password
            settings = layout.identity_dir(HOME_ASSISTANT) / "home-assistant.txt"
            password = settings.read_text().split("Password:")[1].split()[0]
            assert _mode(settings) == 0o600
        else:  # the operator's logins share operator.toml's password
            toml = layout.toml(OPERATOR if user in slots else user)
            password = load_toml(toml)["password"]
            assert _mode(toml) == 0o600  # it holds the password
        assert base64.b64decode(digest) == hashlib.pbkdf2_hmac(
            "sha512", password.encode(), base64.b64decode(salt), int(iterations)
        )
    conf = layout.mosquitto_conf.read_text()
    assert (
        "require_certificate false" in conf and f"password_file {layout.root / 'broker' / 'passwd'}" in conf
    )
    dev = _device_config(layout.toml("printer1"))
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
    real = fleet_init.FleetCA.issue
    calls = []

    def flaky(self, cn, **kw):
        calls.append(cn)
        if cn == "welder1":
            raise OSError("disk full")
        return real(self, cn, **kw)

    monkeypatch.setattr(fleet_init.FleetCA, "issue", flaky)
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
    printed = capsys.readouterr().out
    assert "mqtts://broker.lan:8885" in printed
    # The printed command runs as written: it names the device.
    assert "edge-trainer --device printer1 --config" in printed
    assert cli_main([*args, "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["init", "add-device", "renew-device", "revoke-device"])
def test_help_shows_the_defaults(command, capsys):
    with pytest.raises(SystemExit):
        cli_main(["fleet", command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    if command in ("init", "add-device", "renew-device"):
        assert "(default: 825)" in text
    if command == "init":
        assert "(default: 8883)" in text and "(default: certs)" in text


def test_add_renew_and_revoke_rewrite_the_acl_crl_and_folders(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    assert fleet_layout.open_fleet(layout.root).devices == tuple(sorted(DEVICES))
    fleet_devices.add_devices(layout.root, ["printer3"])
    assert "user printer3" in layout.acl.read_text()
    _cert(layout.cert("printer3")).verify_directly_issued_by(_cert(layout.ca_cert))
    with pytest.raises(FleetInitError, match="printer3 is already enrolled"):
        fleet_devices.add_devices(layout.root, ["printer3"])
    serial = _cert(layout.cert("printer1")).serial_number
    fleet_devices.renew_devices(layout.root, ["printer1"])
    renewed = _cert(layout.cert("printer1")).serial_number
    assert renewed != serial
    fleet_devices.revoke_devices(layout.root, ["printer1"])
    crl = x509.load_pem_x509_crl(layout.crl.read_bytes())
    crl.is_signature_valid(_cert(layout.ca_cert).public_key())
    canary = _cert(fleet_sessions.canary_files(layout)[0]).serial_number  # end-sessions' reload check
    assert {r.serial_number for r in crl} == {serial, renewed, canary}  # every certificate it was issued
    # Revoked: its own status only (`fleet end-sessions` leaves it as revoked), no device rights.
    stanza = layout.acl.read_text().split("user printer1\n")[1].split("\n\n")[0]
    assert stanza.strip().splitlines() == ["topic write ioft/v1/plant/status/printer1"]
    assert "user localhost" not in layout.acl.read_text()  # the broker's own certificate is no device
    assert not layout.identity_dir("printer1").exists()
    assert fleet_layout.open_fleet(layout.root).devices == ("printer3", "welder1")
    with pytest.raises(FleetInitError, match="printer1 is not enrolled"):
        fleet_devices.revoke_devices(layout.root, ["printer1"])
    assert not [p for p in (layout.root / "devices").iterdir() if p.name.startswith(".")]  # no temp left


def test_password_devices_are_added_and_revoked_in_the_password_file(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, auth="passwords")
    fleet_devices.add_devices(layout.root, ["printer3"])
    users = [line.split(":")[0] for line in layout.passwd.read_text().splitlines()]
    assert "printer3" in users and _mode(layout.passwd) == 0o600
    password = load_toml(layout.toml("printer3"))["password"]
    line = next(x for x in layout.passwd.read_text().splitlines() if x.startswith("printer3:"))
    _, _, iterations, salt, digest = line.split(":", 1)[1].split("$")
    assert base64.b64decode(digest) == hashlib.pbkdf2_hmac(
        "sha512", password.encode(), base64.b64decode(salt), int(iterations)
    )
    fleet_devices.revoke_devices(layout.root, ["printer1"])
    assert "printer1" not in [x.split(":")[0] for x in layout.passwd.read_text().splitlines()]


def test_the_operator_toml_names_the_key_push_checks_with(tmp_path):
    from argparse import Namespace

    from cloud_aggregator.models.push import fleet_public_key
    from ioft_protocol.manifest import key_id, load_public_key

    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    args = Namespace(public_key=None, config=layout.toml(OPERATOR))
    assert key_id(fleet_public_key(args)) == key_id(load_public_key(layout.model_public_key))
    assert build(
        AggregatorConfig, {k: v for k, v in load_toml(layout.toml(OPERATOR)).items() if k != "model"}
    )


def test_the_aggregator_toml_takes_the_readmes_tables_appended_at_its_end(tmp_path):
    """The README says: add [collect], [admission] and [[task]] at the end of the generated file.
    Its store folder is already a top-level key (a `state_dir` pasted at the end would land in the
    last table and be refused), so appending tables is all an operator does."""
    layout = init_fleet(tmp_path / "f", "plant", DEVICES)
    path = layout.toml(AGGREGATOR)
    lines = path.read_text().splitlines()
    assert lines.index(
        'state_dir = "/var/lib/ioft-aggregator"  # the store; top-level keys go above [tls]'
    ) < (lines.index("[tls]"))  # written where an operator edits it, not appended after [tls]
    path.write_text(
        path.read_text()
        + '\n[collect]\ndeadline_s = 60\n[[task]]\nname = "speed"\nalgorithm = "pflda"\nmodel = "sigmoid_glm"\n'
    )
    cfg = build(AggregatorConfig, load_toml(path), str(path))
    assert cfg.state_dir == "/var/lib/ioft-aggregator" and [t.name for t in cfg.task] == ["speed"]


def test_each_operator_session_of_a_machine_claims_a_login_of_its_own(tmp_path):
    """``operator.toml``'s ``operator.*``: a free ``operator.<k>``, its client id on the operator's
    listener; fifteen at once, the sixteenth refused in one line: ``operator.16`` is never claimed, it is
    the hand-run client's (a tool on it would knock the guide's ``mosquitto_sub`` off, and the other way
    round).  An older TOML's ``operator`` stays."""
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, port=free_port())
    raw = {
        k: v for k, v in load_toml(layout.toml(OPERATOR)).items() if k != "model"
    }  # as operator_config reads it
    cfg = build(AggregatorConfig, raw, "operator.toml")
    held = [claim_operator_login(cfg, "status") for _ in range(OPERATOR_SLOTS - 1)]
    logins = {options.username for options, _ in held}
    assert logins == {operator_slot(k) for k in range(1, OPERATOR_SLOTS)}
    assert operator_slot(16) not in logins
    assert all(options.client_id == options.username for options, _ in held)
    with pytest.raises(ConfigError, match="15 operator sessions already run on this machine"):
        claim_operator_login(cfg, "status")
    old = build(AggregatorConfig, {**raw, "username": OPERATOR}, "old.toml")
    options, slot = claim_operator_login(old, "status")
    assert slot is None and options.username == OPERATOR and options.client_id.startswith("operator.status.")


@pytest.mark.parametrize(
    ("name", "home"),
    [("acl_text", "acl"), ("mosquitto_password_hash", "broker_conf"), ("client_toml", "identity"),
     ("write_file", "files")],
)  # fmt: skip
def test_a_name_that_left_the_layout_module_still_imports_from_it_with_a_warning(name, home):
    """A script's ``from cloud_aggregator.fleet.layout import acl_text`` outlives the split by job."""
    new = importlib.import_module(f"cloud_aggregator.fleet.{home}")
    with pytest.warns(DeprecationWarning, match=rf"moved to cloud_aggregator\.fleet\.{home}.*0\.2\.0"):
        moved = getattr(fleet_layout, name)
    assert moved is getattr(new, name)
    with pytest.raises(AttributeError):
        fleet_layout.no_such_name  # noqa: B018
