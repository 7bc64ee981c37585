"""The console's ``/events`` streams are capped per client and in all, and a closed stream frees
its place: an unbounded number of live streams took the console from 176 to 517 MiB."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from cloud_aggregator.console.app import STREAMS_PER_CLIENT, StreamGate, build_app
from cloud_aggregator.console.feed import ViewSource
from cloud_aggregator.local.broker import free_port


def _open_stream(port: int) -> tuple[socket.socket, str]:
    """A raw ``GET /events`` left open; its status line."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = b""
    while b"\r\n" not in head:
        chunk = sock.recv(1024)
        assert chunk, "the console closed the connection before answering"
        head += chunk
    return sock, head.split(b"\r\n", 1)[0].decode()


def _wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_gate_counts_per_client_and_in_all():
    gate = StreamGate(per_client=2, total=3)
    assert gate.enter("a") and gate.enter("a")
    assert not gate.enter("a")  # a's own cap
    assert gate.enter("b")
    assert not gate.enter("c")  # the total
    gate.leave("a")
    assert gate.enter("c") and gate.refused == 2
    for who in ("a", "b", "c"):
        gate.leave(who)
    assert gate.open == {}


def test_streams_past_the_cap_are_refused_and_a_closed_one_frees_its_place(tmp_path):
    port = free_port()
    app = build_app(ViewSource(tmp_path / "aggregator.sqlite", None, "f"), refresh_s=0.05)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    socks: list[socket.socket] = []
    try:
        _wait_for(lambda: server.started, "the console to listen")
        for _ in range(STREAMS_PER_CLIENT):
            sock, status = _open_stream(port)
            socks.append(sock)
            assert " 200 " in status, status
        extra, status = _open_stream(port)
        extra.close()
        assert " 429 " in status, status
        socks.pop().close()  # a client goes away: its stream ends and its place is free again

        def reopened() -> bool:
            sock, status = _open_stream(port)
            if " 200 " in status:
                socks.append(sock)
                return True
            sock.close()
            return False

        _wait_for(reopened, "a place freed by the closed stream")
    finally:
        for sock in socks:
            sock.close()
        server.should_exit = True
        thread.join(20)
