"""Who reads a session's socket: its own background thread, or the owner while it waits for messages.

paho's ``loop_start`` thread reads the socket and hands each message over to the thread that
handles it.  Measured on the aggregator (``benchmarks.ingest_cpu``), that costs more than the
messages themselves: ~9 system calls per 4 KB upload, each winning the GIL back from the
collecting thread, and a wake-up across threads.  Here the thread that waits for a message
(``MqttSession.get``: the owner) runs paho's external-loop steps itself (``loop_read``,
``loop_write``, ``loop_misc`` around one ``select``): a message arrives on the thread that takes
it, with no hand-over, and the socket is read only when the owner has nothing left to do.

The background thread (:meth:`SocketLoop.start`) keeps everything else going whether or not
someone collects: connecting and reconnecting with jittered backoff, keepalive pings, the acks of
outbound publishes, and the socket itself whenever the owner is not waiting in ``get``.  One lock
(``_drive``) says who runs paho's loop functions; the owner asks for it (``take``) by setting
``_owner_wants`` and writing a byte to the loop's wake-up socket, which ends the background
thread's ``select``; the background thread then sleeps until the owner has been away for
``idle_s`` (or someone else has bytes to send), and takes the socket back.  A publish from any
other thread is queued by paho under its own locks; paho's ``on_socket_register_write`` tells us
and we wake whichever thread selects.  Callbacks (``on_message``, ``on_connect``, ...) run on the
thread that drives at the time.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sized

import paho.mqtt.client as paho

log = logging.getLogger(__name__)

#: Seconds the owner may be away from ``get`` before the background thread reads the socket again.
IDLE_S = 0.2
#: Seconds between keepalive checks (``loop_misc``) while the owner drives.
MISC_S = 0.25
#: The background thread's select timeout (paho's own loop uses 1 s).
SELECT_S = 1.0
#: Bytes asked of the socket at once (``ReadAheadClient``): a dozen 4 KB uploads.
READ_AHEAD = 64 * 1024
#: Packets read at most in one go, while each is a message: the owner takes the rest from the queue
#: with no system call, and their acks leave together.
BURST = 64

OK = paho.MQTT_ERR_SUCCESS


class ReadAheadClient(paho.Client):
    """A paho client that reads the socket ``read_ahead`` bytes at a time (0: as paho does).

    paho reads a packet in three or four ``recv`` calls (its type byte, each byte of its length,
    its body): four system calls per upload.  Reading ahead, one ``recv`` brings a dozen 4 KB
    uploads.  Bytes read ahead are invisible to ``select``: whoever selects looks at
    :meth:`ahead` first (``SocketLoop.wait`` does; ``edge.swarm``'s selector leaves it at 0).
    """

    read_ahead = 0
    _ahead_buf = b""
    _ahead_pos = 0
    _ahead_sock: object = None

    def ahead(self) -> int:
        """Bytes read from the socket that paho has not taken yet."""
        return len(self._ahead_buf) - self._ahead_pos if self._ahead_sock is self._sock else 0

    def _create_socket_connection(self) -> socket.socket:
        """Connect without binding first, unless a source address or a proxy was asked for.

        paho binds every socket to ``("", 0)`` before connecting.  A bind to port 0 takes an
        ephemeral port that no other socket on the host holds, whatever its destination, so one
        host's clients share its ~28,000 ports (``ip_local_port_range``) and each bind searches the
        range: a 40,000-device swarm stopped at 28,2xx connections, 9 ms of kernel time per
        attempt.  ``connect`` alone picks a port unique per destination (the 4-tuple).
        """
        if self._bind_address or self._bind_port or self._get_proxy():
            return super()._create_socket_connection()
        return socket.create_connection((self._host, self._port), timeout=self._connect_timeout)

    def _sock_recv(self, bufsize: int) -> bytes:
        if not self.read_ahead:
            return super()._sock_recv(bufsize)
        buf, pos = self._ahead_buf, self._ahead_pos
        if self._ahead_sock is not self._sock or pos >= len(buf):  # a new connection, or all taken
            self._ahead_buf, self._ahead_pos, self._ahead_sock = b"", 0, self._sock
            data = super()._sock_recv(max(bufsize, self.read_ahead))
            if len(data) <= bufsize:
                return data  # b"": the broker closed the connection
            buf, pos = self._ahead_buf, self._ahead_pos = data, 0
        self._ahead_pos = end = pos + bufsize
        return buf[pos:end]


class SocketLoop:
    """Drives one paho client: a background thread, handing the socket to the owner on request.

    Parameters
    ----------
    client
        The paho client (``connect_async`` called already).
    on_connect_fail
        Called when an attempt to connect raises (``OSError``), on the background thread.
    gave_up
        Whether to stop retrying (the session's fatal error).
    backoff
        Seconds to wait before the next attempt, asked before each wait but the first connect's
        (``MqttSession.backoff``: drawn with full jitter).
    awaited
        Whether an outbound message awaits the broker's ack (someone may be blocked on it): the
        background thread then reads the socket even while the owner is only briefly away.
    """

    def __init__(
        self,
        client: paho.Client,
        on_connect_fail: Callable[[], None],
        gave_up: Callable[[], bool],
        backoff: Callable[[], float],
        awaited: Callable[[], bool] = lambda: False,
        idle_s: float = IDLE_S,
    ) -> None:
        self.client = client
        self.idle_s = idle_s
        self._on_connect_fail, self._gave_up, self._backoff_s = on_connect_fail, gave_up, backoff
        self._awaited = awaited
        self._drive = threading.Lock()  # held by the thread running paho's loop functions
        self._driver: int | None = None  # that thread's ident
        self._owner: int | None = None  # the thread that last took the socket in get()
        self._owner_in = False  # the owner is in get(), driving or about to
        self._owner_wants = False  # the owner waits for the background thread to let go
        self._owner_at = float("-inf")  # monotonic time the owner last let go
        self._nudge = threading.Event()  # wakes the background thread from its sleep
        self._stopping = False
        self._last_misc = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        #: Times the owner had to wait for the background thread to let go of the socket.
        self.handovers = 0
        client.on_socket_register_write = self._want_write
        if isinstance(client, ReadAheadClient):
            client.read_ahead = READ_AHEAD

    # -- the background thread ---------------------------------------------------
    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=f"mqtt-{name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Let the background thread send what is queued (the DISCONNECT), then end it."""
        self._stopping = True
        self._nudge.set()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        for s in (self._wake_r, self._wake_w):
            s.close()

    def _run(self) -> None:
        c = self.client
        first = True
        try:
            while not self._gave_up():
                if self._stopping:
                    self._finish()
                    return
                if c.socket() is None:
                    # The first connect is at once: a daemon starting alone must not wait (daemons
                    # started together, a plant powered on, are spread by their boot times).  Every
                    # later one waits a drawn delay, the first after a lost connection too, from
                    # [0, reconnect_min_s]: a broker's restart drops the whole fleet in one instant,
                    # so retrying at once, or after any fixed wait, brings it back in one instant;
                    # the draw spreads it over the window, at half a fixed wait's mean.
                    if not first and not self._backoff():
                        continue  # stopping or gave up: looked at above
                    first = False
                    with self._drive:
                        self._driver = threading.get_ident()
                        try:
                            c.reconnect()
                        except OSError:
                            self._on_connect_fail()
                        finally:
                            self._driver = None
                    continue
                if self._owner_busy():
                    self._nudge.wait(self.idle_s)
                    self._nudge.clear()
                    continue
                with self._drive:
                    self._driver = threading.get_ident()
                    try:
                        while not (self._stopping or self._owner_busy()) and c.socket() is not None:
                            if self.step(SELECT_S) != OK:
                                break
                    finally:
                        self._driver = None
        except Exception:  # the network thread must not die silently
            log.exception("MQTT network loop failed")
        finally:
            self._thread = None

    def _finish(self) -> None:
        """Stopping: write what is queued (a DISCONNECT closes the socket once sent), for up to 2 s."""
        c = self.client
        deadline = time.monotonic() + 2.0
        if not self._drive.acquire(timeout=2.0):
            return  # the owner drives: it sends them
        try:
            self._driver = threading.get_ident()
            while c.socket() is not None and c.want_write() and time.monotonic() < deadline:
                if self.step(0.1) != OK:
                    break
        finally:
            self._driver = None
            self._drive.release()

    def _backoff(self) -> bool:
        """Wait the session's next delay before the next attempt; ``False`` if stopped meanwhile."""
        until = time.monotonic() + self._backoff_s()
        while not (self._stopping or self._gave_up()) and (left := until - time.monotonic()) > 0:
            self._nudge.wait(left)
            self._nudge.clear()
        return not (self._stopping or self._gave_up())

    def _owner_busy(self) -> bool:
        """Whether the background thread stays off the socket: the owner reads it, or will shortly
        (it let go less than ``idle_s`` ago, and no one has bytes to send or awaits an ack)."""
        if self._owner_in or self._owner_wants:
            return True
        if time.monotonic() - self._owner_at >= self.idle_s:
            return False
        return not (self.client.want_write() or self._awaited())

    # -- the owner ---------------------------------------------------------------
    def take(self, timeout: float) -> bool:
        """The owner (``get``) takes the socket: ``True`` once it may drive, ``False`` if the
        background thread did not let go within ``timeout`` s.  Call :meth:`give` after either."""
        self._owner_in = True
        if self._drive.acquire(blocking=False):
            self._driver = self._owner = threading.get_ident()
            return True
        self._owner_wants = True
        self._wake()  # ends the background thread's select
        got = self._drive.acquire(timeout=max(0.0, timeout))
        self._owner_wants = False
        if got:
            self.handovers += 1
            self._driver = self._owner = threading.get_ident()
        return got

    def give(self, held: bool) -> None:
        """The owner leaves ``get``; the background thread takes over if it stays away."""
        if held:
            self._driver = None
            self._drive.release()
        self._owner_at = time.monotonic()
        self._owner_in = False
        if self.client.socket() is None or self.client.want_write():
            self._nudge.set()  # a reconnect or bytes to send: the background thread's now

    # -- one step, by whoever holds the lock -------------------------------------
    def read(self, items: Sized = (), burst: int = 1) -> int:
        """Read what the socket has, without waiting: up to ``burst`` packets while each one adds to
        ``items`` (the inbound queue); then send the acks they queued, together."""
        c = self.client
        n = len(items)
        rc = c.loop_read()
        for _ in range(burst - 1):
            if rc != OK or len(items) == n:
                break  # nothing more came (or a packet that is no message: the next read looks)
            n = len(items)
            rc = c.loop_read()
        if rc == OK and c.want_write():
            rc = c.loop_write()
        return rc if rc != OK or c.socket() is not None else paho.MQTT_ERR_NO_CONN

    def wait(self, timeout: float) -> int:
        """Send what is queued, then wait up to ``timeout`` s until the socket has bytes (or a
        wake-up comes): ``OK`` to read, else the connection is gone."""
        c = self.client
        sock = c.socket()
        if sock is None:
            return paho.MQTT_ERR_NO_CONN
        if c.want_write():
            rc = c.loop_write()
            if rc != OK or c.socket() is None:
                return rc or paho.MQTT_ERR_NO_CONN
        # bytes select cannot see: read ahead, or decrypted by TLS
        pending = c.ahead() if isinstance(c, ReadAheadClient) else 0
        pending += sock.pending() if hasattr(sock, "pending") else 0
        if not pending:
            wlist = [sock] if c.want_write() else []
            try:
                readable, _, _ = select.select([sock, self._wake_r], wlist, [], timeout)
            except (OSError, ValueError, TypeError):  # closed meanwhile (disconnect)
                return paho.MQTT_ERR_CONN_LOST if c.socket() is None else OK
            if self._wake_r in readable:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            if c.want_write():
                rc = c.loop_write()
                if rc != OK or c.socket() is None:
                    return rc or paho.MQTT_ERR_NO_CONN
        return self.misc(MISC_S)

    def step(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the socket, then read what it has (the background thread)."""
        rc = self.wait(timeout)
        return self.read(burst=BURST) if rc == OK else rc

    def misc(self, every: float = 0.0) -> int:
        """Keepalive (pings, a broker gone silent), at most once every ``every`` s."""
        now = time.monotonic()
        if now - self._last_misc < every:
            return OK
        self._last_misc = now
        return self.client.loop_misc()

    # -- waking whoever selects ----------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            self._wake_w.send(b"\0")

    def _want_write(self, client, userdata, sock) -> None:
        """paho queued bytes on a connection with none queued: the thread that drives sends them
        before its next select; any other thread wakes it (and the background thread, if no one drives)."""
        me = threading.get_ident()
        if me == self._driver:
            return
        self._wake()
        if self._driver is None:
            self._nudge.set()
