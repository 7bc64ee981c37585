"""A Klipper API server on a real Unix socket, for the Klipper source and recorder tests.

The protocol of Klipper's docs/API_Server.md and klippy/extras/bulk_sensor.py: JSON
objects terminated by 0x03; a dump request is answered with a header, then async
messages are the client's ``response_template`` with ``"params": {"data": [[time, x, y,
z], ...], "errors": n, "overflows": n}`` in mm/s².  Subclasses say what to stream.
"""

from __future__ import annotations

import json
import os
import socket
import threading

HEADER = ["time", "x_acceleration", "y_acceleration", "z_acceleration"]


class KlipperServer:
    """Serves one connection at a time on ``path``; ``stream`` runs a session's subscription."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.requests: list[dict] = []
        self.stop_evt = threading.Event()
        self.conn: socket.socket | None = None
        if os.path.exists(path):
            os.unlink(path)
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(1)
        self.srv.settimeout(0.05)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop_evt.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.conn = conn
            try:
                req = self._request(conn)
                if req is not None:
                    self.requests.append(req)
                    self.stream(conn, req)
            except OSError:
                pass
            finally:
                conn.close()

    @staticmethod
    def _request(conn: socket.socket) -> dict | None:
        buf = b""
        while b"\x03" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            buf += chunk
        return json.loads(buf.split(b"\x03")[0])

    @staticmethod
    def send(conn: socket.socket, obj: dict) -> None:
        conn.sendall(json.dumps(obj).encode() + b"\x03")

    def batch(self, req: dict, data: list, errors: int = 0, overflows: int = 0) -> dict:
        """The async message of one batch, shaped by the request's response template."""
        msg = dict(req.get("params", {}).get("response_template", {}))
        msg["params"] = {"data": data, "errors": errors, "overflows": overflows}
        return msg

    def stream(self, conn: socket.socket, req: dict) -> None:
        raise NotImplementedError
