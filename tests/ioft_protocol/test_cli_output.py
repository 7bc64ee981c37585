"""A console script's printed lines reach the OS whole, so a log line from another thread that
shares the pipe (stdout and stderr merged, unbuffered, as tests and journals read us) cannot
land inside one: ``console: http://...?token=`` once read back as ``... apart)``."""

from __future__ import annotations

import io
import sys

from ioft_protocol.cli import entry_point
from ioft_protocol.config import ConfigError


class RawWrites(io.RawIOBase):
    """A raw stream that keeps each write as the OS would get it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.writes.append(bytes(b))
        return len(b)


def unbuffered(monkeypatch, name: str) -> RawWrites:
    """``sys.<name>`` as ``python -u`` makes it for a pipe: every text write goes straight through."""
    raw = RawWrites()
    stream = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
    monkeypatch.setattr(sys, name, stream)
    monkeypatch.setattr(sys, f"__{name}__", stream)
    return raw


def test_each_printed_line_is_one_write(monkeypatch):
    raw = unbuffered(monkeypatch, "stdout")

    @entry_point("tool")
    def main(argv) -> int:
        print("console: http://0.0.0.0:1/?token=abc")
        print("metrics: http://0.0.0.0:1/metrics")
        return 0

    assert main([]) == 0
    assert raw.writes == [b"console: http://0.0.0.0:1/?token=abc\n", b"metrics: http://0.0.0.0:1/metrics\n"]


def test_the_error_line_is_one_write(monkeypatch):
    raw = unbuffered(monkeypatch, "stderr")

    @entry_point("tool")
    def main(argv) -> int:
        raise ConfigError("tool.toml", ["broker: give mqtts://host:8883"])

    assert main([]) == 2
    assert len(raw.writes) == 1 and raw.writes[0].endswith(b"\n") and b"tool.toml" in raw.writes[0]
