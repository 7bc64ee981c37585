"""``cloud-aggregator push --devices``: comma-separated ids, each checked before anything is sent.

A malformed id used to be pushed as one device (``'printer1,printer2'``): every device
then refused the offer as malformed, after the previous version's chunks were cleared.
``--devices`` used to take every following word, the manifest included
(``push --devices a,b MANIFEST`` did not parse).
"""

from __future__ import annotations

import json

import pytest

from cloud_aggregator import cli
from cloud_aggregator.models import push, push_answers
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import codec, model_push, topics
from ioft_protocol.manifest import load_public_key
from ioft_protocol.mqtt_inbound import Message

FLEET = "plant"


class FakeSession:
    """Records what a push sends; the broker holds no earlier offer, and printer1's and printer2's
    retained statuses (push refuses ids no device answers to)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.subscribed: list[str] = []
        self.stopped = False
        self.inbox: list[Message] = []

    def subscribe(self, topic: str) -> None:
        self.subscribed.append(topic)
        if topic == topics.topic_status_all(FLEET):
            self.inbox += [
                Message(topics.topic_status(FLEET, d), json.dumps({"state": "online"}).encode(), True)
                for d in ("printer1", "printer2")
            ]

    def unsubscribe(self, topic: str) -> None:
        pass

    def publish(self, topic: str, payload: bytes, **kw) -> None:
        if not topic.endswith("/rollout-sync"):  # the probe that reads retained messages
            self.published.append((topic, payload))

    def get(self, timeout):
        return self.inbox.pop(0) if self.inbox else None

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


def test_an_id_no_device_answers_to_is_refused_before_publishing(package, sessions, capsys):
    """``push --devices welder9`` (never enrolled): one line, exit 2, nothing published."""
    assert run_push(package, "printer1,welder9") == 2
    err = capsys.readouterr().err
    assert err.startswith("cannot push: no device welder9 in fleet plant") and err.count("\n") == 1
    assert sessions[0].published == [] and sessions[0].stopped


def test_a_manifest_edited_after_signing_is_refused_before_any_session(package, sessions, capsys):
    """The version edited after signing: one line, exit 2, nothing published (no session opened)."""
    body = json.loads(package.manifest_path.read_text())
    body["manifest"] = body["manifest"].replace('"version":1', '"version":2')
    package.manifest_path.write_text(json.dumps(body))
    assert run_push(package, "printer1,printer2") == 2
    err = capsys.readouterr().err
    assert err.startswith("cannot push:") and "signature does not verify" in err and err.count("\n") == 1
    assert sessions == []


def test_without_a_public_key_push_says_where_to_find_one(package, sessions, capsys):
    argv = ["push", "--fleet", FLEET, "--broker", "mqtt://127.0.0.1:1", str(package.manifest_path)]
    assert cli.main(argv) == 2
    assert "--public-key" in capsys.readouterr().err and sessions == []


def test_the_file_must_be_the_one_signed(package):
    data = bytearray(package.onnx_path.read_bytes())
    data[0] ^= 1
    package.onnx_path.write_bytes(bytes(data))
    with pytest.raises(push.PushCheckError, match="is not the file its manifest signed"):
        push.verify_package(package, load_public_key(public_key(package)))


@pytest.mark.parametrize(
    ("status", "state", "detail"),
    [
        ({"state": "online", "models": {"enc": {"active": 3}}}, "installed", ""),
        (
            {"state": "online", "models": {"enc": {"active": 2, "rejected": [
                {"version": 3, "reason": "worse; rolled back to v2"}]}}},
            "refused", "worse; rolled back to v2",
        ),
        ({"state": "online", "models": {"enc": {"active": 4}}}, "refused", "v4 is active there (newer)"),
        ({"state": "online", "models": {"enc": {"transfer": {"version": 3, "have": 1, "of": 5}}}}, "pending",
         "fetching: 1/5 chunks"),
        ({"state": "offline", "models": {}}, "pending", "offline"),
        ({"state": "online", "models": ["not", "a", "table"]}, "pending", "no answer yet"),
        (None, "pending", "no status"),
    ],
)  # fmt: skip
def test_a_device_answer_is_read_from_its_status(status, state, detail):
    answer = push_answers.answer_of("printer1", status, "enc", 3)
    assert (answer.state, answer.detail) == (state, detail)
