"""The session's socket read by the thread that waits in ``get`` (``ioft_protocol.mqtt_loop``), and
everything the background thread keeps going around it: reconnects, re-subscribes, keepalive, the
acks of publishes from other threads.  A real mosquitto, killed and restarted on its port."""

from __future__ import annotations

import random
import threading
import time

import paho.mqtt.client as paho
import pytest

from cloud_aggregator.local.broker import start_mosquitto
from ioft_protocol.mqtt import Message, MqttSession
from ioft_protocol.mqtt_options import BrokerAddress, SessionOptions

pytestmark = pytest.mark.broker
#: Guards against a hung test only; nothing here is a timing assertion.
PATIENCE_S = 60.0
TOPIC = "loop/up"


def session(url: str, client_id: str, rng: random.Random | None = None, **options) -> MqttSession:
    return MqttSession(SessionOptions(BrokerAddress.parse(url), client_id, **options), rng)


class Top(random.Random):
    """Draws the top of every window: a session that waits exactly ``reconnect_min_s``, no jitter."""

    def uniform(self, a: float, b: float) -> float:
        return b


def until(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


class Owner:
    """A thread that collects: ``get`` in a loop, as the aggregator's collecting thread does."""

    def __init__(self, s: MqttSession) -> None:
        self.session, self.got, self.stop = s, [], threading.Event()
        self.waited = threading.Event()  # one get() has come back: the owner is in its loop
        self.thread = threading.Thread(target=self._run, name="owner", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            msg = self.session.get(0.2)
            self.waited.set()
            if msg is not None:
                self.got.append(int(msg.payload))

    def __enter__(self) -> Owner:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.ident is not None:
            self.thread.join(PATIENCE_S)


def publish(device: MqttSession, numbers: range, timeout: float | None = 10.0) -> None:
    for i in numbers:
        device.publish(f"{TOPIC}/{i % 7}", str(i).encode(), timeout=timeout)


def test_the_thread_in_get_reads_the_socket_itself_in_arrival_order(mosquitto):
    agg, device = session(mosquitto.url, "agg"), session(mosquitto.url, "dev")
    threads: list[str] = []

    def noted(msg: Message) -> bool:  # taps run on the thread that reads the socket
        threads.append(threading.current_thread().name)
        return False  # passed on to get()

    agg.tap(f"{TOPIC}/#", noted)
    agg.subscribe(f"{TOPIC}/#")
    agg.start()
    device.start()
    try:
        with Owner(agg) as owner:
            assert owner.waited.wait(PATIENCE_S)
            publish(device, range(300), timeout=None)
            until(lambda: len(owner.got) >= 300, "300 messages")
        assert owner.got == list(range(300))  # in the order published, none twice
        # paho's loop_start thread used to read every one and hand it over.  (The background thread
        # may step in if the owner is kept from get() for 0.2 s on a loaded machine: a few, at most.)
        assert threads.count("owner") >= 0.9 * len(threads), set(threads)
    finally:
        device.stop()
        agg.stop()


@pytest.mark.parametrize("collecting", [True, False], ids=["owner-collects", "owner-away"])
def test_a_broker_restart_loses_no_qos1_message_and_subscriptions_come_back(mosquitto, tmp_path, collecting):
    # The aggregator retries within 1 s (a drawn delay; if refused, within 2 s more); the device, its
    # jitter off, after 4 s, so the aggregator has subscribed again (the broker keeps nothing across
    # the restart) before the queued messages come.
    agg = session(mosquitto.url, "agg", reconnect_min_s=1.0)
    device = session(mosquitto.url, "dev", Top(), reconnect_min_s=4.0, reconnect_max_s=4.0)
    agg.subscribe(f"{TOPIC}/#")
    agg.start()
    device.start()
    back = None
    owner = Owner(agg)
    try:
        if collecting:
            owner.__enter__()
        publish(device, range(40))
        if collecting:
            until(lambda: len(owner.got) >= 40, "the first 40 messages")
        else:  # the device's acks do not say the broker delivered them: none may die in flight
            until(lambda: agg.inbound.qsize() >= 40, "the first 40 messages read")
        mosquitto.kill()
        until(lambda: not agg.connected.is_set() and not device.connected.is_set(), "both to see the drop")
        publish(device, range(40, 80), timeout=None)  # queued while the broker is away
        back = start_mosquitto(mosquitto.port, log_file=tmp_path / "mosquitto2.log")
        assert agg.wait_connected(PATIENCE_S) and device.wait_connected(PATIENCE_S)
        publish(device, range(80, 100))  # acked: the device is connected again
        if not collecting:
            owner.__enter__()  # the owner comes back only now: the background thread read them all
        until(lambda: len(owner.got) >= 100, "100 messages")
        owner.__exit__()
        assert owner.got == list(range(100))
        assert agg.drops >= 1 and agg.fatal is None
    finally:
        owner.__exit__()
        device.stop()
        agg.stop()
        if back is not None:
            back.stop()


def test_keepalive_holds_while_the_owner_is_busy_elsewhere_for_longer_than_it(mosquitto):
    # mosquitto closes a connection silent for 1.5 keepalives: here 1.5 s.
    agg = session(mosquitto.url, "agg", keepalive=1)
    device = session(mosquitto.url, "dev")
    agg.subscribe(f"{TOPIC}/#")
    agg.start()
    device.start()
    try:
        assert agg.get(0.3) is None  # the owner took the socket, and let go
        time.sleep(4.0)  # busy elsewhere: four keepalives with no get()
        assert agg.connected.is_set() and agg.drops == 0 and agg.failed_attempts == 0
        publish(device, range(3))
        got = [agg.get(PATIENCE_S) for _ in range(3)]
        assert [int(m.payload) for m in got if m is not None] == [0, 1, 2]
        assert agg.drops == 0
    finally:
        device.stop()
        agg.stop()


def test_publishes_with_a_timeout_from_other_threads_are_acked_while_the_owner_collects(mosquitto):
    agg = session(mosquitto.url, "agg")
    device = session(mosquitto.url, "dev")
    agg.subscribe(f"{TOPIC}/#")
    agg.start()
    device.start()
    errors: list[BaseException] = []

    def announcer(first: int) -> None:
        try:  # the aggregator's own publishes (announcements, roll calls) from other threads
            for i in range(first, first + 25):
                agg.publish(f"{TOPIC}/agg", str(i).encode(), timeout=10.0)  # raises without the ack
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        with Owner(agg) as owner:
            assert owner.waited.wait(PATIENCE_S)
            others = [threading.Thread(target=announcer, args=(1000 * k,)) for k in (1, 2)]
            for t in others:
                t.start()
            publish(device, range(100), timeout=None)
            for t in others:
                t.join(PATIENCE_S)
            until(lambda: len(owner.got) >= 150, "every message")
        assert errors == []
        assert [i for i in owner.got if i < 1000] == list(range(100))
        for k in (1, 2):
            assert [i for i in owner.got if 1000 * k <= i < 1000 * k + 1000] == list(
                range(1000 * k, 1000 * k + 25)
            )
    finally:
        device.stop()
        agg.stop()


class Trickle:
    """A non-blocking socket's ``recv`` stand-in: hands out ``chunks`` one per call, then would block."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks, self.calls = list(chunks), 0

    def recv(self, bufsize: int) -> bytes:
        self.calls += 1
        if not self.chunks:
            raise BlockingIOError
        chunk = self.chunks.pop(0)
        if len(chunk) > bufsize:  # the rest stays for the next call, as a socket's would
            chunk, rest = chunk[:bufsize], chunk[bufsize:]
            self.chunks.insert(0, rest)
        return chunk

    def close(self) -> None:
        pass


def test_paho_reads_a_packet_byte_by_byte_and_the_client_serves_them_from_one_recv():
    from ioft_protocol.mqtt_loop import ReadAheadClient

    # What this overrides must still be paho's: a rename would silently bring back a recv per byte.
    assert "_sock_recv" in vars(paho.Client)
    client = ReadAheadClient(paho.CallbackAPIVersion.VERSION2, client_id="ahead")
    client.read_ahead = 64
    client._sock = sock = Trickle(b"\x30\x05abcde" * 2, b"\x30\x01z")
    got = [client._sock_recv(n) for n in (1, 1, 5, 1, 1, 5)]
    assert got == [b"\x30", b"\x05", b"abcde"] * 2 and sock.calls == 1 and client.ahead() == 0
    assert client._sock_recv(1) == b"\x30" and client.ahead() == 2 and sock.calls == 2
    assert client._sock_recv(2) == b"\x01z" and client.ahead() == 0
    with pytest.raises(BlockingIOError):
        client._sock_recv(1)
    client._sock = other = Trickle(b"\x30\x01y")  # a new connection: nothing of the old one is served
    assert client._sock_recv(1) == b"\x30" and other.calls == 1 and client.ahead() == 2
    client.read_ahead = 0  # off (edge.swarm's selector): paho's own reads
    client._sock = plain = Trickle(b"\x30\x01q")
    assert [client._sock_recv(1) for _ in range(3)] == [b"\x30", b"\x01", b"q"] and plain.calls == 3
    client._sock = None


# Run in a network namespace of its own (``unshare -n``, root): ten ephemeral ports, two listeners.
_PORTS_SCRIPT = """
import socket, subprocess, sys
import paho.mqtt.client as paho
from ioft_protocol.mqtt_loop import ReadAheadClient
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
    f.write("40000 40009")
make = paho.Client._create_socket_connection if sys.argv[1] == "paho" else ReadAheadClient._create_socket_connection
servers = [socket.create_server(("127.0.0.1", 0), backlog=32) for _ in range(2)]
made = []
for i in range(16):
    c = ReadAheadClient(paho.CallbackAPIVersion.VERSION2, client_id=f"c{i}")
    c.connect_async("127.0.0.1", servers[i % 2].getsockname()[1])
    try:
        made.append(make(c))
    except OSError:
        break
print(len(made))
"""


def test_clients_share_the_hosts_ephemeral_ports_per_destination_not_across_all(tmp_path):
    """A swarm of 40,000 devices stopped at the host's ~28,000 ephemeral ports while paho bound each
    socket to port 0 before connecting; connected without that bind, ports are reused per broker."""
    import shutil
    import socket
    import subprocess
    import sys

    from ioft_protocol.mqtt_loop import ReadAheadClient

    assert "_create_socket_connection" in vars(paho.Client)  # what the client overrides is still paho's
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("needs root and unshare (util-linux) for a network namespace of its own")
    if shutil.which("ip") is None:
        pytest.skip("needs ip (iproute2) to bring the namespace's loopback up")
    script = tmp_path / "ports.py"
    script.write_text(_PORTS_SCRIPT)

    def connections(which: str) -> int:
        out = subprocess.run(
            ["unshare", "-n", sys.executable, str(script), which], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip())

    assert connections("paho") <= 10  # one host-wide port per client: the range caps them
    assert connections("ours") == 16  # 8 per listener, on the same 10 ports
    server = socket.create_server(("127.0.0.1", 0))
    with socket.socket() as probe:  # a free port to ask for
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bound = ReadAheadClient(paho.CallbackAPIVersion.VERSION2, client_id="bound")
    bound.connect_async("127.0.0.1", server.getsockname()[1], bind_address="127.0.0.1", bind_port=port)
    with server, bound._create_socket_connection() as sock:  # an asked-for source is still paho's bind
        assert sock.getsockname() == ("127.0.0.1", port)
