"""``cloud-aggregator push --devices``: comma-separated ids, each checked before anything is sent.

A malformed id used to be pushed as one device (``'printer1,printer2'``): every device
then refused the offer as malformed, after the previous version's chunks were cleared.
``--devices`` used to take every following word, the manifest included
(``push --devices a,b MANIFEST`` did not parse).
"""

from __future__ import annotations

import pytest

from cloud_aggregator import cli, push
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import codec, model_push, topics

FLEET = "plant"


class FakeSession:
    """Records what a push sends; the broker holds no earlier offer."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.subscribed: list[str] = []
        self.stopped = False

    def subscribe(self, topic: str) -> None:
        self.subscribed.append(topic)

    def unsubscribe(self, topic: str) -> None:
        pass

    def publish(self, topic: str, payload: bytes, **kw) -> None:
        self.published.append((topic, payload))

    def get(self, timeout):
        return None

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def package(tmp_path):
    priv, _ = generate_keypair(tmp_path / "keys" / "fleet.key")
    return signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "pkg", load_private_key(priv), version=1)


def public_key(package) -> str:
    return str(package.manifest_path.parent.parent / "keys" / "fleet.pub")


@pytest.fixture
def sessions(monkeypatch):
    made: list[FakeSession] = []

    def fake_operator_session(args, role):
        made.append(FakeSession())
        return made[-1], args.fleet

    monkeypatch.setattr(push, "operator_session", fake_operator_session)
    return made


def run_push(package, *devices: str) -> int:
    """``push --devices D1 [--devices D2 ...] MANIFEST``: the manifest last, after the options."""
    argv = ["push", "--fleet", FLEET, "--broker", "mqtt://127.0.0.1:1", "--public-key", public_key(package)]
    return cli.main(argv + [a for d in devices for a in ("--devices", d)] + [str(package.manifest_path)])


@pytest.mark.parametrize(
    "devices",
    [("printer1,printer2",), ("printer1", "printer2"), ("printer1,", "printer2"), ("printer1, printer2",)],
)
def test_devices_comma_separated_or_repeated_reach_the_offer_as_ids(package, sessions, capsys, devices):
    assert run_push(package, *devices) == 0
    (session,) = sessions
    offer_topic, offer = session.published[0]
    assert offer_topic == topics.topic_model_offer(FLEET, "enc")
    assert model_push.ModelOffer.decode(offer).devices == ("printer1", "printer2")  # what a device decodes
    assert "for devices printer1, printer2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("devices", "said"),
    [
        (("printer1,Printer2",), "device id 'Printer2' must match"),
        (("printer1;printer2",), "device id 'printer1;printer2' must match"),
        (("printer1/+",), "device id 'printer1/+' must match"),
        ((",",), "names no device"),
        (("printer1,printer1",), "printer1 more than once"),
    ],
)
def test_a_bad_device_id_fails_before_anything_is_published(package, sessions, capsys, devices, said):
    assert run_push(package, *devices) == 2
    assert said in capsys.readouterr().err
    assert sessions == []  # no session opened: nothing published, no retained chunk cleared


def test_push_model_checks_device_ids_before_publishing(package):
    session = FakeSession()
    with pytest.raises(codec.WireError, match="device id"):
        push.push_model(session, FLEET, package, devices=["printer1,printer2"])
    assert session.published == [] and session.subscribed == []
