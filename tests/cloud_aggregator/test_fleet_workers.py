"""Aggregator workers' own logins (``fleet init --workers``, ``fleet add-worker``): the files, the ACL
lines, what the worker logs in with, and what ``serve`` and ``cloud-aggregator worker`` refuse.
(A fleet's mosquitto with ``serve`` and two workers: tests/e2e/test_fleet_workers.py.)"""

from __future__ import annotations

import base64
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cloud_aggregator import worker_login
from cloud_aggregator.cli import main as cli_main
from cloud_aggregator.config import AggregatorConfig
from cloud_aggregator.fleet import devices as fleet_devices
from cloud_aggregator.fleet.acl import worker_acl_text
from cloud_aggregator.fleet.broker_conf import mosquitto_password_hash
from cloud_aggregator.fleet.init import FleetInitError, init_fleet
from cloud_aggregator.fleet.layout import open_fleet
from cloud_aggregator.fleet.plants import add_plant
from cloud_aggregator.fleet.workers import add_workers
from cloud_aggregator.serve.server import ServeRefusedError, _check_worker_logins
from ioft_protocol.config import ConfigError, build, load_toml

DEVICES = ["printer1", "printer2"]
P = "ioft/v1/plant"
TASKS = """
[collect]
workers = 2

[[task]]
name = "speed"
algorithm = "fedavg"
model = "sigmoid_glm"
rounds = 1
"""


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _stanza(acl: str, worker: str) -> list[str]:
    """The ACL's lines for user ``worker.<worker>`` (up to the next blank line)."""
    after = acl.split(f"user worker.{worker}\n", 1)[1]
    return after.split("\n\n", 1)[0].strip().splitlines()


def _worker_config(layout, worker: str) -> AggregatorConfig:
    """What ``cloud-aggregator worker --config aggregator.toml --id <worker>`` builds its session from."""
    agg = layout.root / "aggregator" / "aggregator.toml"
    raw, own = worker_login.with_login(load_toml(agg), agg, worker)
    assert own
    return build(AggregatorConfig, raw, str(agg))


def test_the_worker_acl_stanza_is_its_reads_and_its_own_writes():
    assert worker_acl_text("plant", "w3", "a comment").splitlines() == [
        "",
        "# a comment",
        "user worker.w3",
        f"topic read {P}/task/+/up/+",  # its $share/ioft-agg/... subscription is checked against this
        f"topic read {P}/status/+",
        f"topic read {P}/task/+/down",
        f"topic read {P}/agg/ctl",
        f"topic write {P}/agg/batch/+/w3",
        f"topic readwrite {P}/agg/worker/w3",
    ]


def test_fleet_init_workers_gives_each_worker_a_certificate_a_login_and_an_acl_stanza(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, hosts=["cloud.example"], workers=2)
    w = layout.root / "aggregator" / "workers"
    assert sorted(p.name for p in w.iterdir()) == [
        "w1.toml", "w2.toml", "worker.w1.crt", "worker.w1.key", "worker.w2.crt", "worker.w2.key"
    ]  # fmt: skip
    ca = _cert(layout.ca_cert)
    issued = layout.issued.read_text()
    for worker in ("w1", "w2"):
        cert = _cert(w / f"worker.{worker}.crt")
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"worker.{worker}"
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH
        ]
        assert f"{cert.serial_number:x}\tworker.{worker}\t" in issued
        assert stat.S_IMODE((w / f"worker.{worker}.key").stat().st_mode) == 0o600
        cfg = _worker_config(layout, worker)  # the aggregator's broker and CA, the worker's certificate
        assert cfg.tls.cert_file == str(w / f"worker.{worker}.crt")
        assert cfg.tls.key_file == str(w / f"worker.{worker}.key")
        assert cfg.tls.ca_file == str(layout.ca_cert)
        assert cfg.broker == "mqtts://cloud.example:8883" and cfg.fleet == "plant"
        assert (
            _stanza(layout.acl.read_text(), worker)
            == worker_acl_text("plant", worker, "x").strip().splitlines()[2:]
        )
    assert open_fleet(layout.root).workers == ("w1", "w2")


def test_a_password_fleet_gives_each_worker_a_password_file_user(tmp_path):
    layout = init_fleet(tmp_path / "f", "plant", DEVICES, auth="passwords", workers=1)
    login = layout.root / "aggregator" / "workers" / "w1.toml"
    assert stat.S_IMODE(login.stat().st_mode) == 0o600  # it holds a password
    assert sorted(p.name for p in login.parent.iterdir()) == ["w1.toml"]
    cfg = _worker_config(layout, "w1")
    assert (
        cfg.username == "worker.w1" and cfg.tls.cert_file is None and cfg.tls.ca_file == str(layout.ca_cert)
    )
    line = next(x for x in layout.passwd.read_text().splitlines() if x.startswith("worker.w1:"))
    _, _, iterations, salt, _ = line.split(":", 1)[1].split("$")
    assert (
        line
        == f"worker.w1:{mosquitto_password_hash(cfg.password, salt=base64.b64decode(salt), iterations=int(iterations))}"
    )
    assert "user worker.w1" in layout.acl.read_text()


def test_add_worker_issues_and_device_changes_keep_the_workers(tmp_path):
    root = init_fleet(tmp_path / "f", "plant", DEVICES, workers=2).root
    layout = add_workers(root, ["w3"])
    assert layout.workers == ("w1", "w2", "w3")
    assert _worker_config(layout, "w3").tls.cert_file.endswith("worker.w3.crt")
    assert "\tworker.w3\t" in layout.issued.read_text()
    fleet_devices.add_devices(root, ["printer3"])
    fleet_devices.revoke_devices(root, ["printer1"])
    acl = layout.acl.read_text()
    assert [w for w in ("w1", "w2", "w3") if f"user worker.{w}\n" in acl] == ["w1", "w2", "w3"]
    assert f"topic write {P}/agg/batch/+/w3" in _stanza(acl, "w3")


@pytest.mark.parametrize(
    "ids, says",
    [
        (["w1"], "worker w1 exists"),
        (["w4", "w4"], "repeated: w4"),
        (["W4"], "worker id 'W4' must match"),
        ([], "name at least one worker"),
        (["plant-a"], "worker id plant-a is plant plant-a's partial aggregator"),
    ],
)
def test_bad_workers_are_refused_with_what_to_fix(tmp_path, ids, says):
    root = init_fleet(tmp_path / "f", "plant", DEVICES, workers=1).root
    add_plant(root, "plant-a", ["printer1"], partial=True)
    with pytest.raises(FleetInitError, match=says):
        add_workers(root, ids)


def test_a_partial_plant_cannot_take_a_cloud_workers_id(tmp_path):
    root = init_fleet(tmp_path / "f", "plant", DEVICES, workers=1).root
    add_workers(root, ["plant-b"])
    with pytest.raises(FleetInitError, match=r"plant-b .*aggregator worker"):
        add_plant(root, "plant-b", ["printer1"], partial=True)


def test_a_worker_login_holds_a_login_only(tmp_path):
    agg = tmp_path / "aggregator.toml"
    agg.write_text('fleet = "plant"\nbroker = "mqtts://b:8883"\n[tls]\nca_file = "ca.crt"\n')
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "w1.toml").write_text('broker = "mqtts://elsewhere:1"\n')
    with pytest.raises(ConfigError, match="not broker"):
        worker_login.with_login(load_toml(agg), agg, "w1")
    assert worker_login.with_login({"fleet": "plant"}, agg, "w2") == ({"fleet": "plant"}, False)


def _serve_config(tmp_path, workers: int):
    root = init_fleet(tmp_path / "f", "plant", DEVICES, workers=workers).root
    agg = root / "aggregator" / "aggregator.toml"
    with agg.open("a") as f:
        f.write(TASKS)
    return root, agg


def test_serve_refuses_workers_without_their_own_login_in_one_line(tmp_path, capsys):
    root, agg = _serve_config(tmp_path, workers=1)  # w1 only; [collect] workers = 2 needs w2 too
    cfg = build(AggregatorConfig, load_toml(agg), str(agg))
    with pytest.raises(ServeRefusedError) as exc:
        _check_worker_logins(cfg, ["--config", str(agg)])
    message = str(exc.value)
    assert "\n" not in message
    for noun in (
        "[collect] workers = 2",  # the setting
        "worker w2",  # the worker without a login
        f"{root}/aggregator/workers/<id>.toml",  # where its login would be
        f"{root}/aggregator/aggregator.crt",  # the certificate it would share with serve
        f"cloud-aggregator fleet add-worker --dir {root} --id w2",  # the fix
    ):
        assert noun in message, (noun, message)
    # The command line: one line, exit 2, before anything connects (no broker runs here).
    assert cli_main(["serve", "--config", str(agg), "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fleet add-worker --dir" in err and "Traceback" not in err
    # A worker started by hand says the same about itself.
    assert cli_main(["worker", "--config", str(agg), "--id", "w7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"add-worker --dir {root} --id w7`" in err
    add_workers(root, ["w2"])
    _check_worker_logins(cfg, ["--config", str(agg)])  # both have their login now


def test_a_config_that_logs_in_as_nobody_needs_no_worker_login(tmp_path):
    agg = tmp_path / "aggregator.toml"
    agg.write_text(f'fleet = "plant"\nbroker = "mqtt://127.0.0.1:1883"\nallow_plaintext = true\n{TASKS}')
    cfg = build(AggregatorConfig, load_toml(agg), str(agg))
    _check_worker_logins(cfg, ["--config", str(agg)])  # a test or loopback broker: as before


def test_the_commands_say_what_to_run_and_refuse_bad_input_without_a_traceback(tmp_path, capsys):
    root = tmp_path / "f"
    assert cli_main(["fleet", "init", "--fleet", "plant", "--devices", "printer1", "--out", str(root),
                     "--workers", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "workers:    w1, w2 log in as worker.w1, worker.w2" in out and "set [collect] workers = 2" in out
    assert cli_main(["fleet", "add-worker", "--dir", str(root), "--id", "w3,w4"]) == 0
    out = capsys.readouterr().out
    assert "aggregator workers w3, w4 added; reload the broker" in out and "[collect] workers = 4" in out
    assert f"cloud-aggregator worker --config {root}/aggregator/aggregator.toml --id <id>" in out
    for argv, says in (
        (["fleet", "add-worker", "--dir", str(root), "--id", "w1"], "worker w1 exists"),
        (["fleet", "add-worker", "--dir", str(tmp_path / "nope"), "--id", "w1"], "is not a fleet folder"),
        (["fleet", "init", "--fleet", "plant", "--devices", "p1", "--out", str(tmp_path / "g"), "--workers", "-1"],
         "--workers must be >= 0, got -1"),
    ):  # fmt: skip
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
