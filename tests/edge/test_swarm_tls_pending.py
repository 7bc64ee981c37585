"""A swarm over TLS reads what TLS has already decrypted (``SwarmLoop.poll``), not only what
``select`` sees: a broker stand-in sends two PUBLISH packets in one TLS record, and both arrive.

Before the fix the second stayed in the SSL object's buffer, invisible to ``select`` (the kernel's
buffer was empty), until the socket next had bytes: a keepalive away.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Iterator

import pytest

from cloud_aggregator.fleet.ca import FleetCA, pem_cert
from edge.swarm import SwarmLoop, SwarmSession
from ioft_protocol.mqtt import BrokerAddress, SessionOptions
from ioft_protocol.mqtt_options import TlsConfig
from tests.edge.test_swarm_loop import drive, received


def publish_packet(topic: str, payload: bytes) -> bytes:
    """An MQTT 3.1.1 PUBLISH at QoS 0 (remaining length < 128)."""
    body = struct.pack("!H", len(topic)) + topic.encode() + payload
    return bytes([0x30, len(body)]) + body


class OneRecordBroker:
    """Accepts one TLS client, answers its CONNECT, then (on :meth:`send_two`) sends two PUBLISH
    packets in a single TLS record, and otherwise only reads."""

    def __init__(self, cert: str, key: str) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.conn: ssl.SSLSocket | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        raw, _ = self.server.accept()
        conn = self.context.wrap_socket(raw, server_side=True)
        conn.recv(4096)  # the CONNECT (small: one read)
        conn.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted
        self.conn = conn
        self.ready.set()
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass

    def send_two(self) -> None:
        assert self.conn is not None
        self.conn.sendall(publish_packet("t/x", b"one") + publish_packet("t/x", b"two"))  # one record

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.fixture
def tls_files(tmp_path) -> Iterator[tuple[str, str, str]]:
    ca = FleetCA.create("swarm-tls", days=1)
    cert, key = ca.issue("broker", server_hosts=["127.0.0.1"], days=1)
    paths = {"ca.crt": pem_cert(ca.cert), "broker.crt": cert, "broker.key": key}
    for name, data in paths.items():
        (tmp_path / name).write_bytes(data)
    yield str(tmp_path / "ca.crt"), str(tmp_path / "broker.crt"), str(tmp_path / "broker.key")


def test_two_packets_in_one_tls_record_both_reach_the_swarm_device(tls_files):
    ca, cert, key = tls_files
    broker = OneRecordBroker(cert, key)
    loop = SwarmLoop()
    session = SwarmSession(
        SessionOptions(
            BrokerAddress.parse(f"mqtts://127.0.0.1:{broker.port}"),
            "tls-device",
            tls=TlsConfig(ca),
            keepalive=60,
            reconnect_min_s=0.1,
            reconnect_max_s=0.2,
        ),
        loop,
    )
    try:
        session.start()
        drive(loop, session.connected.is_set, "connected over TLS", limit=30)
        assert broker.ready.wait(10)
        broker.send_two()
        got: list[bytes] = []
        drive(loop, lambda: got.extend(received(session)) or len(got) >= 2, "both messages of the record", 10)
        assert got == [b"one", b"two"]
    finally:
        session.stop()
        broker.close()
