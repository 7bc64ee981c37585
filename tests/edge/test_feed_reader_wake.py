"""FeedReader.wake never blocks: a wake-up queue the recorder's datagrams filled (the serving thread
stopped before draining it) must not hold the trainer's shutdown forever."""

from __future__ import annotations

import socket
import threading

from edge.feed import wake_path
from edge.serving.feed_reader import FeedReader


def test_wake_returns_when_the_wake_up_queue_is_full(tmp_path):
    reader = FeedReader(tmp_path, "welder0")
    (tmp_path / "serving").mkdir(parents=True, exist_ok=True)
    reader.open()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as recorder:
            try:  # the recorder's datagrams, one per row, until the reader's queue holds no more
                while True:
                    recorder.sendto(b"\x01", socket.MSG_DONTWAIT, str(wake_path(tmp_path)))
            except BlockingIOError:
                pass
        waking = threading.Thread(target=reader.wake, daemon=True)
        waking.start()
        waking.join(10.0)  # a bound only so that a blocked send fails the test instead of hanging it
        assert not waking.is_alive(), "wake() blocked on a full wake-up queue"
    finally:
        reader.close()
