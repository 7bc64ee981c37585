"""``free_port`` hands a test or a demo a loopback port nothing binds until its broker starts: the
kernel may offer the same port again, and a CI run got the devices' port back as the operator's
(``fleet init`` refused it: "--operator-port ... not the devices' --port")."""

from __future__ import annotations

from cloud_aggregator.local import broker


class _Kernel:
    """``socket.socket`` whose ``bind(("127.0.0.1", 0))`` offers the ports given, in turn."""

    def __init__(self, offers: list[int]) -> None:
        self.offers = iter(offers)

    def __call__(self, *args):
        port = next(self.offers)

        class Sock:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, address):
                pass

            def getsockname(self):
                return ("127.0.0.1", port)

        return Sock()


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    monkeypatch.setattr(broker, "_HANDED_OUT", set())
    monkeypatch.delenv(broker.PORT_SLICE_ENV, raising=False)  # one process: every port
    monkeypatch.setattr(broker.socket, "socket", _Kernel([40001, 40001, 40001, 40002, 40001, 40003]))
    assert [broker.free_port(), broker.free_port(), broker.free_port()] == [40001, 40002, 40003]


def test_free_port_is_free_and_on_loopback():
    port = broker.free_port()
    with broker.socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it
    assert 0 < port < 65536 and port != broker.free_port()


def test_processes_started_together_take_their_own_slice_of_the_ports(monkeypatch):
    """Two pytest-xdist workers are two processes: each takes the ports of its own residue, below the
    ephemeral range, each free when handed out (an odd slice through the kernel's own choice waited for
    ever: Linux's bind to port 0 prefers even ports)."""
    monkeypatch.setattr(broker, "_HANDED_OUT", set())
    for slice_ in ("1/2", "0/2", "2/3"):
        monkeypatch.setenv(broker.PORT_SLICE_ENV, slice_)
        i, n = (int(v) for v in slice_.split("/"))
        ports = [broker.free_port() for _ in range(20)]
        assert len(set(ports)) == 20
        assert all(p % n == i and p in broker.SLICE_PORTS for p in ports)
        with broker.socket.socket() as s:
            s.bind(("127.0.0.1", ports[-1]))  # nothing holds it
    monkeypatch.setenv(broker.PORT_SLICE_ENV, "not a slice")  # one process: the kernel's choice
    monkeypatch.setattr(broker.socket, "socket", _Kernel([40008]))
    assert broker.free_port() == 40008
