"""`cloud-aggregator fleet add-plant`: the plant folder, the cloud ACL's bridge grants, what it refuses,
and how add-, renew- and revoke-device keep plants current.  (Two real mosquittos bridged:
tests/e2e/test_bridged_plant.py.)"""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloud_aggregator.cli import main as cli_main
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.fleet import devices as fleet_devices
from cloud_aggregator.fleet.init import FleetInitError, init_fleet
from cloud_aggregator.fleet.layout import open_fleet, read_plants
from cloud_aggregator.fleet.plant_files import bridge_topic_lines
from cloud_aggregator.fleet.plants import add_plant
from ioft_protocol.config import ConfigError, build, load_toml

DEVICES = ["printer1", "printer2", "welder1"]
P = "ioft/v1/plant"


@pytest.fixture
def fleet(tmp_path):
    return init_fleet(tmp_path / "f", "plant", DEVICES, hosts=["cloud.example"], port=8883).root


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _bridge_section(acl: str) -> str:
    return acl.split("user bridge.plant-a", 1)[1] if "user bridge.plant-a" in acl else ""


def test_a_plant_folder_has_its_listener_its_bridge_and_its_devices_point_at_it(fleet):
    layout, plant = add_plant(fleet, "plant-a", ["printer1", "printer2"], hosts=["gw.plant-a.lan"], port=8884)
    d = fleet / "plants" / "plant-a"
    conf = (d / "mosquitto.conf").read_text()
    for line in ("listener 8884", "require_certificate true", "use_identity_as_username true",
                 f"crlfile {d / 'crl.pem'}", "connection cloud", "address cloud.example:8883",
                 "bridge_protocol_version mqttv311", "cleansession false", "local_cleansession false",
                 "restart_timeout 2 30", f"bridge_certfile {d / 'bridge.plant-a.crt'}", "bridge_insecure false",
                 f"topic {P}/task/+/up/+ out 1", f"topic {P}/status/+ out 1", f"topic {P}/task/+/down in 1",
                 f"topic {P}/task/+/secagg/down/+ in 1", f"topic {P}/model/+/+/chunk/+ in 1"):  # fmt: skip
        assert line in conf.splitlines(), line
    assert " both " not in conf and "/aggregator" not in conf  # nothing loops, the lock stays in the cloud
    dropin = (d / "systemd" / "mosquitto.service.d" / "ioft.conf").read_text()
    assert f"ExecStart=/usr/sbin/mosquitto -c {d / 'mosquitto.conf'}" in dropin.splitlines()

    ca = _cert(layout.ca_cert)
    bridge = _cert(d / "bridge.plant-a.crt")
    bridge.verify_directly_issued_by(ca)
    assert bridge.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "bridge.plant-a"
    assert list(bridge.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    server = _cert(d / "server.crt")
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw.plant-a.lan"]
    assert "bridge.plant-a" in (fleet / "ca" / "issued.tsv").read_text()

    plant_acl = (d / "acl").read_text()
    assert "user printer1" in plant_acl and "user printer2" in plant_acl and "welder1" not in plant_acl
    assert "user aggregator" not in plant_acl and "user operator" not in plant_acl

    for dev in ("printer1", "printer2"):
        assert load_toml(layout.toml(dev))["broker"] == "mqtts://gw.plant-a.lan:8884"
    assert load_toml(layout.toml("welder1"))["broker"] == "mqtts://cloud.example:8883"
    assert plant.devices == ("printer1", "printer2") and read_plants(fleet) == [plant]


def test_the_cloud_acl_grants_the_bridge_exactly_its_devices_topics(fleet):
    add_plant(fleet, "plant-a", ["printer1"])
    bridge = _bridge_section((fleet / "broker" / "acl").read_text())
    lines = {line for line in bridge.splitlines() if line.startswith("topic ")}
    assert lines == {
        f"topic read {P}/task/+/down",
        f"topic read {P}/model/+/manifest",
        f"topic read {P}/model/+/+/chunk/+",
        f"topic read {P}/rollcall",  # the aggregator's roll call (ioft_protocol.restate)
        f"topic read {P}/task/+/scaling",  # the pooled feature scaling (scaling = "fleet")
        f"topic write {P}/task/+/up/printer1",
        f"topic write {P}/status/printer1",
        f"topic write {P}/answer/printer1/+",  # its answers to its own rows (edge.serving)
        f"topic write {P}/alert/printer1/+",  # and its alerts (the console shows them)
        f"topic write {P}/task/+/secagg/up/printer1",
        f"topic write {P}/task/+/stats/printer1",
        f"topic read {P}/task/+/down/printer1",
        f"topic read {P}/task/+/secagg/down/printer1",
    }


def test_device_changes_keep_plants_current(fleet):
    add_plant(fleet, "plant-a", ["printer1", "printer2"], port=8884)
    fleet_devices.add_devices(fleet, ["printer3"])  # not in the plant: the bridge grants stay as they were
    acl = (fleet / "broker" / "acl").read_text()
    assert f"write {P}/status/printer2" in _bridge_section(acl) and "printer3" not in _bridge_section(acl)

    fleet_devices.renew_devices(fleet, ["printer1"])  # a new certificate, still on its plant's broker
    assert load_toml(fleet / "devices" / "printer1" / "device.toml")["broker"] == "mqtts://localhost:8884"

    fleet_devices.revoke_devices(fleet, ["printer2"])
    d = fleet / "plants" / "plant-a"
    assert "printer2" not in (d / "acl").read_text()
    assert "printer2" not in _bridge_section((fleet / "broker" / "acl").read_text())
    assert read_plants(fleet)[0].devices == ("printer1",)
    assert (d / "crl.pem").read_bytes() == (fleet / "broker" / "crl.pem").read_bytes()

    add_plant(fleet, "plant-a", ["printer3"], port=8884, force=True)  # printer1 leaves the plant
    assert load_toml(fleet / "devices" / "printer1" / "device.toml")["broker"] == "mqtts://cloud.example:8883"
    assert open_fleet(fleet).plant_brokers == {"printer3": "mqtts://localhost:8884"}


@pytest.mark.parametrize(
    ("plant", "devices", "kw", "says"),
    [
        ("Plant A", ["printer1"], {}, "plant id 'Plant A'"),
        ("plant-a", ["nosuch"], {}, "nosuch is not enrolled"),
        ("plant-a", [], {}, "name the plant's devices"),
        ("plant-a", ["printer1"], {"protocol": "mqttv31"}, "bridge protocol must be one of"),
        ("plant-a", ["printer1"], {"port": 0}, "port must be in 1..65535"),
        ("plant-a", ["printer1"], {"cloud": "nohost"}, "--cloud must be HOST:PORT"),
        ("plant-a", ["printer1"], {"restart_timeout": (5, 2)}, "0 < BASE <= CAP"),
    ],
)
def test_bad_plants_are_refused_with_what_to_fix(fleet, plant, devices, kw, says):
    with pytest.raises(FleetInitError, match=says.replace("(", r"\(").replace(".", r"\.")):
        add_plant(fleet, plant, devices, **kw)
    assert not (fleet / "plants").exists() or not any((fleet / "plants").iterdir())


def test_a_plant_is_not_rewritten_nor_a_device_shared_without_asking(fleet):
    add_plant(fleet, "plant-a", ["printer1"])
    with pytest.raises(FleetInitError, match="plant plant-a exists"):
        add_plant(fleet, "plant-a", ["printer1"])
    with pytest.raises(FleetInitError, match=r"printer1 .*plant-a"):
        add_plant(fleet, "plant-b", ["printer1"])


def test_password_fleets_and_bad_input_get_one_line_and_exit_2(tmp_path, capsys):
    init_fleet(tmp_path / "pw", "plant", ["printer1"], auth="passwords")
    assert cli_main(["fleet", "add-plant", "--dir", str(tmp_path / "pw"), "--plant", "a",
                     "--devices", "printer1"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "plants need a certificate fleet" in err and "Traceback" not in err
    assert cli_main(["fleet", "add-plant", "--dir", str(tmp_path / "nope"), "--plant", "a",
                     "--devices", "printer1"]) == 2  # fmt: skip
    assert "is not a fleet folder" in capsys.readouterr().err


# -- --partial-aggregator: a plant worker (cloud-aggregator worker --plant) ------------------------------
def _user_section(acl: str, user: str) -> set[str]:
    """The ``topic`` lines under ``user <user>`` (up to the next ``user`` line)."""
    out, inside = set(), False
    for line in acl.splitlines():
        if line.startswith("user "):
            inside = line == f"user {user}"
        elif inside and line.startswith("topic "):
            out.add(line)
    return out


def test_a_partial_plant_writes_its_worker_and_bridges_batches_not_uploads(fleet):
    layout, plant = add_plant(fleet, "plant-a", ["printer1", "printer2"], hosts=["gw.plant-a.lan"], port=8884,
                              partial=True)  # fmt: skip
    d = fleet / "plants" / "plant-a"
    assert plant.worker == "plant-a" and read_plants(fleet) == [plant]
    conf = (d / "mosquitto.conf").read_text().splitlines()
    topic_lines = [line for line in conf if line.startswith("topic ")]
    assert topic_lines == bridge_topic_lines("plant", partial=True)
    assert f"topic {P}/task/+/up/+ out 1" not in conf  # no device upload crosses
    assert f"topic {P}/agg/batch/+/+ out 1" in conf and f"topic {P}/agg/ctl in 1" in conf

    worker = _cert(d / "worker.plant-a.crt")
    worker.verify_directly_issued_by(_cert(layout.ca_cert))
    assert worker.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "worker.plant-a"
    assert "worker.plant-a" in (fleet / "ca" / "issued.tsv").read_text()
    toml = load_toml(d / "worker.toml")
    assert toml["broker"] == "mqtts://gw.plant-a.lan:8884" and toml["fleet"] == "plant"
    assert toml["tls"] == {"ca_file": str(d / "ca.crt"), "cert_file": str(d / "worker.plant-a.crt"),
                           "key_file": str(d / "worker.plant-a.key")}  # fmt: skip
    cfg = build(AggregatorConfig, toml, "worker.toml")  # what `cloud-aggregator worker --config` loads
    assert cfg.tls is not None and cfg.broker == plant.broker

    assert _user_section((d / "acl").read_text(), "worker.plant-a") == {
        f"topic read {P}/task/+/up/+",
        f"topic read {P}/status/+",
        f"topic read {P}/task/+/down",
        f"topic read {P}/agg/ctl",
        f"topic write {P}/agg/batch/+/plant-a",  # its own batches only
        f"topic readwrite {P}/agg/worker/plant-a",  # its birth and Last Will
    }
    assert _user_section((fleet / "broker" / "acl").read_text(), "bridge.plant-a") == {
        f"topic read {P}/task/+/down",
        f"topic read {P}/model/+/manifest",
        f"topic read {P}/model/+/+/chunk/+",
        f"topic read {P}/rollcall",
        f"topic read {P}/task/+/scaling",
        f"topic write {P}/agg/batch/+/plant-a",
        f"topic write {P}/agg/worker/plant-a",
        f"topic read {P}/agg/ctl",
        f"topic write {P}/status/printer1",  # statuses still cross; uploads do not
        f"topic write {P}/answer/printer1/+",
        f"topic write {P}/alert/printer1/+",
        f"topic write {P}/task/+/secagg/up/printer1",
        f"topic write {P}/task/+/stats/printer1",
        f"topic read {P}/task/+/down/printer1",
        f"topic read {P}/task/+/secagg/down/printer1",
        f"topic write {P}/status/printer2",
        f"topic write {P}/answer/printer2/+",
        f"topic write {P}/alert/printer2/+",
        f"topic write {P}/task/+/secagg/up/printer2",
        f"topic write {P}/task/+/stats/printer2",
        f"topic read {P}/task/+/down/printer2",
        f"topic read {P}/task/+/secagg/down/printer2",
    }
    unit = (d / "systemd" / "ioft-plant-worker.service").read_text().splitlines()
    assert "Type=notify" in unit and "WatchdogSec=60" in unit
    assert (
        f"ExecStart=/opt/ioft/bin/cloud-aggregator worker --plant --id plant-a --config {d / 'worker.toml'}"
        in unit
    )


def test_a_partial_plant_stays_partial_when_devices_change(fleet):
    add_plant(fleet, "plant-a", ["printer1", "printer2"], partial=True)
    fleet_devices.revoke_devices(fleet, ["printer2"])
    d = fleet / "plants" / "plant-a"
    assert read_plants(fleet)[0].worker == "plant-a"
    assert "user worker.plant-a" in (d / "acl").read_text()  # refresh_plant keeps the worker's grants
    bridge = _user_section((fleet / "broker" / "acl").read_text(), "bridge.plant-a")
    assert f"topic write {P}/agg/batch/+/plant-a" in bridge and not [t for t in bridge if "/task/+/up/" in t]

    add_plant(fleet, "plant-a", ["printer1"], force=True)  # rewritten without it: uploads cross again
    assert read_plants(fleet)[0].worker == ""
    assert not (d / "worker.toml").exists() and "worker.plant-a" not in (d / "acl").read_text()
    bridge = _user_section((fleet / "broker" / "acl").read_text(), "bridge.plant-a")
    assert f"topic write {P}/task/+/up/printer1" in bridge and not [t for t in bridge if "/agg/" in t]


def test_serve_coordinates_plant_workers_at_workers_1_and_refuses_what_cannot_split():
    base = {"fleet": "plant", "collect": {"plant_workers": ["plant-a"]}}
    cfg = build(AggregatorConfig, base, "aggregator.toml")
    assert cfg.collect.workers == 1 and cfg.collect.plant_workers == ["plant-a"]
    with pytest.raises(ConfigError, match="worker"):
        build(AggregatorConfig, {**base, "collect": {"plant_workers": ["Plant A"]}}, "aggregator.toml")
    median = {"name": "t", "algorithm": "fedavg", "model": "sigmoid_glm", "rounds": 1,
              "server": {"reducer": "median"}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"plant_workers = \['plant-a'\]"):
        build(AggregatorConfig, {**base, "task": [median]}, "aggregator.toml")


def test_add_plant_partial_prints_the_worker_command(fleet, capsys):
    assert cli_main(["fleet", "add-plant", "--dir", str(fleet), "--plant", "plant-a", "--devices", "printer1",
                     "--partial-aggregator"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    d = fleet / "plants" / "plant-a"
    assert f"cloud-aggregator worker --plant --id plant-a --config {d / 'worker.toml'}" in out
    assert 'plant_workers = ["plant-a"]' in out


@pytest.mark.parametrize(
    ("collect", "says"),
    [
        ({"plant_workers": ["plant-a", "plant-a"]}, "more than once"),
        ({"workers": 2, "plant_workers": ["w2"]}, "named as serve's own workers"),
    ],
)
def test_plant_workers_that_would_be_confused_are_refused_in_one_line(collect, says):
    with pytest.raises(ConfigError) as caught:
        build(AggregatorConfig, {"fleet": "plant", "collect": collect}, "aggregator.toml")
    text = "; ".join(caught.value.errors)
    assert says in text and "\n" not in text
