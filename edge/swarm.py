"""A swarm: thousands of virtual devices in one process, each a real MQTT client.

``edge-trainer --swarm N --device PREFIX`` runs devices ``PREFIX00000`` … in this process.
Each is a whole :class:`edge.daemon.EdgeTrainer` (the daemon's own round logic, state file,
retained status and Last Will, client id ``ioft-<fleet>-<device>``), with its own paho client;
only the network loop is shared.  One paho thread per client would be 10,000 threads, so
one :mod:`selectors` loop (epoll on Linux) drives every client through paho's external-loop
API (``loop_read`` / ``loop_write`` / ``loop_misc``), and hands each inbound message to its
device's ``handle`` on the same thread.

Each device needs a file descriptor (its socket): 10,000 devices in 4 processes need
``ulimit -n`` above 2,500 per process and a broker that accepts 10,000 connections (README,
"A swarm of virtual devices").  Devices whose state folder has no dataset get a copy of one
simulated machine's (simulating each machine's sensors takes seconds per device).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as paho

from edge.announcements import Announcements
from edge.config import DeviceConfig
from edge.daemon import EdgeTrainer
from edge.dataset import load_dataset, prepare_dataset, save_dataset
from edge.group_commit import GroupCommit
from ioft_protocol.mqtt import MqttSession
from ioft_protocol.mqtt_options import MqttError, SessionOptions

log = logging.getLogger(__name__)

#: Seconds between keepalive checks (``loop_misc``) and the daemons' ``tick``.
MISC_S = 1.0
#: Seconds between looks at the devices' pacers (``edge.buffered``: buffered jobs, simulated paces):
#: a look walks every device, which after each of a busy round's many short polls cost more than
#: a device's own answer; paces are seconds long, and a poll waits up to 50 ms anyway.
PACE_S = 0.01


def _decrypted(sock: socket.socket) -> int:
    """Bytes TLS has decrypted and not yet handed out (0 for a plain socket)."""
    return sock.pending() if isinstance(sock, ssl.SSLSocket) else 0


class SwarmLoop:
    """One selector driving many paho clients (paho's external-loop callbacks keep it current).

    A client with bytes to send is written to before the next ``select``, not when the selector
    says its socket is writable (it nearly always is): registering and unregistering each socket
    for writing cost two ``epoll_ctl`` calls and a selector key per publish.  Only a client whose
    socket took less than it had (a full send buffer) waits for the selector.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        #: draws every session's connect delays (full jitter: ``MqttSession.backoff``); a test seeds it
        self.rng = rng or random.Random()
        self.selector = selectors.DefaultSelector()
        self.sessions: list[SwarmSession] = []
        self._reconnect: dict[SwarmSession, float] = {}  # session -> when to try again
        self._to_write: dict[SwarmSession, socket.socket] = {}  # paho has bytes for these sockets
        self._polled_write: set[SwarmSession] = set()  # registered for EVENT_WRITE (buffer was full)

    def add(self, session: SwarmSession) -> None:
        """Join the loop; the first connect is drawn like a reconnect's (``MqttSession.backoff``), so
        thousands of devices started at once do not knock on the broker in the same instant (a single
        daemon's first connect is immediate: ``ioft_protocol.mqtt_loop``)."""
        self.sessions.append(session)
        self._reconnect[session] = time.monotonic() + session.backoff()

    def _register(self, session: SwarmSession, sock: socket.socket, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            self.selector.modify(sock, events, session)
        except KeyError:
            self.selector.register(sock, events, session)

    def _unregister(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)

    def want_write(self, session: SwarmSession, sock: socket.socket) -> None:
        """paho queued a packet (``on_socket_register_write``): written before the next select."""
        self._to_write[session] = sock

    def wrote(self, session: SwarmSession, sock: socket.socket) -> None:
        """paho has nothing left to send (``on_socket_unregister_write``)."""
        self._to_write.pop(session, None)
        if session in self._polled_write:
            self._polled_write.discard(session)
            self._register(session, sock, False)

    def gone(self, session: SwarmSession, sock: socket.socket) -> None:
        """The session's socket closed (``on_socket_close``)."""
        self._to_write.pop(session, None)
        self._polled_write.discard(session)
        self._unregister(sock)
        self.closed(session)

    def flush(self) -> None:
        """Write what every client has queued; a socket that takes less waits for the selector."""
        while self._to_write:
            pending, self._to_write = self._to_write, {}
            for session, sock in pending.items():
                client = session.client
                if client.socket() is not sock:
                    continue  # closed or reconnected since: its new socket registered itself
                client.loop_write()
                if client.socket() is not sock:
                    continue  # the write found the connection gone: paho closed the socket
                if client.want_write() and session not in self._polled_write:
                    self._polled_write.add(session)
                    self._register(session, sock, True)

    def closed(self, session: SwarmSession) -> None:
        """A connection ended: try again after the session's backoff (unless it gave up or stops)."""
        if session.fatal is None and not session.stopping:
            self._reconnect[session] = time.monotonic() + session.backoff()

    def poll(self, timeout: float) -> list[SwarmSession]:
        """Connect due sessions, serve ready sockets for up to ``timeout`` s; the sessions read from."""
        now = time.monotonic()
        for session in [s for s, at in self._reconnect.items() if at <= now]:
            del self._reconnect[session]
            session.connect()
        self.flush()
        read = []
        for key, mask in self.selector.select(timeout):
            session: SwarmSession = key.data
            client = session.client
            if mask & selectors.EVENT_READ:
                client.loop_read()
                # TLS may hold bytes it already decrypted (at most the rest of one record), which
                # select cannot see (as in mqtt_loop): read them while each read takes some.
                while (sock := client.socket()) is not None and (left := _decrypted(sock)) > 0:
                    client.loop_read()
                    if client.socket() is sock and _decrypted(sock) >= left:
                        break
                read.append(session)
            if mask & selectors.EVENT_WRITE:
                client.loop_write()
        return read

    def misc(self) -> None:
        """Keepalive pings and timeouts of every connected client."""
        for session in self.sessions:
            if session.client.socket() is not None:
                session.client.loop_misc()


class SwarmSession(MqttSession):
    """An :class:`~ioft_protocol.mqtt.MqttSession` with no network thread: a :class:`SwarmLoop` drives it.

    Everything else (will, birth, re-subscribe on connect, taps, the inbound queue, the jittered
    delays of :meth:`~ioft_protocol.mqtt.MqttSession.backoff`) is the session's own; the loop, not a
    thread of the session's, waits them out and connects.
    """

    def __init__(self, options: SessionOptions, loop: SwarmLoop) -> None:
        super().__init__(options, loop.rng)
        self.loop = loop
        self.stopping = False
        c = self.client
        c.on_socket_open = lambda client, userdata, sock: loop._register(self, sock, False)
        c.on_socket_close = lambda client, userdata, sock: loop.gone(self, sock)
        c.on_socket_register_write = lambda client, userdata, sock: loop.want_write(self, sock)
        c.on_socket_unregister_write = lambda client, userdata, sock: loop.wrote(self, sock)

    @property
    def client(self) -> paho.Client:
        return self._client

    def start(self, timeout: float | None = None) -> None:
        """Join the loop; it connects on its next poll and whenever the connection ends."""
        self.loop.add(self)

    def connect(self) -> None:
        b = self.options.broker
        try:
            self.client.connect(b.host, b.port, keepalive=self.options.keepalive)
        except OSError as exc:
            self.last_error = str(exc)
            self.loop.closed(self)

    def stop(self, final: tuple[str, bytes] | None = None) -> None:
        """Publish ``final`` (queued; the loop sends it) and disconnect once it is out."""
        self.stopping = True
        if final is not None and self.connected.is_set():
            self.client.publish(final[0], final[1], qos=1, retain=True)
        self.client.disconnect()
        self.connected.clear()


def seed_dataset(state_dir: Path, template: Path, config: DeviceConfig) -> None:
    """Give ``state_dir`` a copy of the template machine's simulated dataset unless it has one."""
    if load_dataset(state_dir) is not None:
        return
    if load_dataset(template) is None:
        prepare_dataset(template, template.name, config.data)
    train, test, meta = load_dataset(template)
    save_dataset(state_dir, train, test, meta)


class Swarm:
    """``count`` virtual devices from ``base``'s config, ids ``<base.device><first+i:05d>``.

    Parameters
    ----------
    base
        A device config; each device gets its id and ``<base.state_dir>/<id>`` as state folder.
    count, first
        How many devices, and the number of the first (several processes split a swarm).
    """

    def __init__(self, base: DeviceConfig, count: int, first: int = 0) -> None:
        if count < 1 or first < 0:
            raise ValueError(f"a swarm needs count >= 1 and first >= 0, got {count}, {first}")
        self.loop = SwarmLoop()
        #: the devices' task states, made durable together before each poll (edge.group_commit)
        self.commit = GroupCommit()
        root = Path(base.state_dir)
        template = root / f"{base.device}-template"
        self.devices: list[EdgeTrainer] = []
        announcements = Announcements()  # one decode of each announcement for all the devices
        for i in range(first, first + count):
            name = f"{base.device}{i:05d}"
            config = replace(base, device=name, state_dir=str(root / name))
            if config.data.source.startswith("simulate-"):
                seed_dataset(root / name, template, config)
            trainer = EdgeTrainer(config, session_factory=self._session, announcements=announcements)
            trainer.states.write = self.commit.writer(trainer.state_dir)
            self.devices.append(trainer)
        self._stop = False

    def _session(self, options: SessionOptions) -> SwarmSession:
        return SwarmSession(options, self.loop)

    def stop(self) -> None:
        self._stop = True

    def connected(self) -> int:
        return sum(t.session.connected.is_set() for t in self.devices)

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Serve every device until :meth:`stop` (or ``until()`` is true); then each says offline."""
        by_session = {id(t.session): t for t in self.devices}
        for t in self.devices:
            t.start()
        # The devices' own objects (configs, datasets, sessions, states: ~250 per device) live as long
        # as the swarm: frozen, the cyclic GC's full collections stop walking them (at 1,000 devices
        # these took ~20 µs per device-round, measured in the swarm's thread).  Garbage made by the
        # rounds is collected as before.
        gc.collect()
        gc.freeze()
        next_misc, next_pace = time.monotonic() + MISC_S, 0.0
        # When the first pacer is due (inf: none is).  A pacer changes only in its device's
        # handle, pace and tick, each followed here by a look at it: no walk over every device
        # while none is due (most swarms pace nothing; a walk cost ~5 µs per device-round).
        soonest = min(t.pacer.next_at for t in self.devices)
        try:
            while not self._stop and not (until is not None and until()):
                self.commit.commit()  # the states saved since the last poll, before it sends their uploads
                for session in self.loop.poll(0.05):
                    t = by_session[id(session)]
                    self._deliver(t)
                    soonest = min(soonest, t.pacer.next_at)
                now = time.monotonic()  # buffered jobs and simulated paces (edge.buffered) that are due
                if now >= soonest and now >= next_pace:
                    next_pace = now + PACE_S
                    for t in [t for t in self.devices if t.pacer.next_at <= now]:
                        t.pace()
                    soonest = min(t.pacer.next_at for t in self.devices)
                if time.monotonic() >= next_misc:
                    next_misc = time.monotonic() + MISC_S
                    self.loop.misc()
                    for t in self.devices:
                        t.tick()
                        soonest = min(soonest, t.pacer.next_at)  # a resume answers from here
                # One device refused for good (its log line says why) stops alone; all of them: the process.
                if all(t.session.fatal for t in self.devices):
                    raise MqttError(self.devices[0].session.fatal)
        finally:
            gc.unfreeze()  # a process that goes on (a test, a benchmark) collects them again
            self.shutdown()

    @staticmethod
    def _deliver(trainer: EdgeTrainer) -> None:
        """What ``loop_read`` just queued for ``trainer``, handled on this thread."""
        inbox = trainer.session.inbound.queue  # its deque: this thread is the only reader
        while inbox:
            msg = inbox.popleft()
            trainer.handle(msg.topic, msg.payload)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Every device publishes its offline status and disconnects; waits up to ``timeout`` s."""
        for t in self.devices:
            t.shutdown()
        self.commit.commit()  # before the polls below send what the devices queued
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(s.client.socket() is not None for s in self.loop.sessions):
            self.loop.poll(0.05)
