"""What signs a device's SecAgg keys, from the device folder `fleet init` writes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cloud_aggregator.fleet.init import init_fleet
from edge.cli import config_from_args, parse_args
from edge.config import DeviceConfig
from edge.secagg_client import secagg_identity
from ioft_protocol.config import ConfigError
from ioft_protocol.mqtt_options import TlsConfig


def device_config(tmp_path, auth: str, name: str = "printer1") -> DeviceConfig:
    layout = init_fleet(tmp_path / "fleet", "f", ("printer1", "printer2"), auth=auth)
    return config_from_args(parse_args(["--device", name, "--config", str(layout.toml(name))]))


def test_a_certificate_device_signs_and_demands_signed_keys(tmp_path):
    cfg = device_config(tmp_path, "certs")
    ident = secagg_identity(cfg)
    assert ident["signer"] is not None and ident["signer"].name == "printer1"
    assert ident["trust"] is not None and ident["require_signed"]
    # the device may opt out of its own floor (the task may still demand signatures)
    assert not secagg_identity(replace(cfg, secagg_signed_keys=False))["require_signed"]


def test_a_password_device_neither_signs_nor_demands(tmp_path):
    ident = secagg_identity(device_config(tmp_path, "passwords"))
    assert ident["signer"] is None and not ident["require_signed"]


def test_demanding_signed_keys_without_a_certificate_is_a_config_error():
    with pytest.raises(ValueError) as err:
        DeviceConfig(device="printer1", secagg_signed_keys=True)
    assert all(noun in str(err.value) for noun in ("secagg_signed_keys", "certificate")), err.value


def test_a_key_that_does_not_load_is_one_config_error(tmp_path):
    cfg = device_config(tmp_path, "certs")
    (tmp_path / "junk.key").write_text("not a key")
    assert cfg.tls is not None
    bad = replace(cfg, tls=TlsConfig(cfg.tls.ca_file, cfg.tls.cert_file, str(tmp_path / "junk.key")))
    with pytest.raises(ConfigError) as err:
        secagg_identity(bad)
    assert all(noun in str(err.value) for noun in ("tls.key_file", str(tmp_path / "junk.key"), "PEM")), (
        err.value
    )
