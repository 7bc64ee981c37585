"""Run a fleet's tasks side by side where no device can take part in two of them.

Tasks start in config order; a task waits for every earlier task whose devices it might
share (:meth:`ioft_protocol.round_messages.DeviceSelection.disjoint`) and otherwise runs at
once on its own thread.  A printer task and a weld task (``devices = { kind = ... }``) thus
run together, while two printer tasks take turns, as a device trains one round at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from ioft_protocol.round_messages import DeviceSelection


class Selecting(Protocol):
    name: str
    devices: DeviceSelection | None


T = TypeVar("T", bound=Selecting)


def waits_for(tasks: Sequence[Selecting]) -> dict[str, list[str]]:
    """``task -> the earlier tasks it must wait for`` (those that may share a device with it)."""
    out: dict[str, list[str]] = {}
    for i, task in enumerate(tasks):
        out[task.name] = [
            earlier.name for earlier in tasks[:i] if not _disjoint(earlier.devices, task.devices)
        ]
    return out


def _disjoint(a: DeviceSelection | None, b: DeviceSelection | None) -> bool:
    return a is not None and a.disjoint(b)


def run_side_by_side(tasks: Sequence[T], run: Callable[[T], None], poll_s: float = 0.2) -> None:
    """Run each task with ``run``, on its own thread, as soon as the tasks it waits for are done.

    The calling thread only waits (in ``poll_s`` steps, so a signal handler still runs in it).
    The first exception a task raises is raised here at once; tasks that wait for the failed
    one never start.  The threads are daemons: an exiting process does not wait for them.
    """
    done = {t.name: threading.Event() for t in tasks}
    failed: list[BaseException] = []
    before = waits_for(tasks)

    def lane(task: T) -> None:
        for name in before[task.name]:
            while not done[name].wait(poll_s):
                if failed:
                    return
        if failed:
            return
        try:
            run(task)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            failed.append(exc)
        finally:
            done[task.name].set()

    threads = [threading.Thread(target=lane, args=(t,), name=f"task-{t.name}", daemon=True) for t in tasks]
    for th in threads:
        th.start()
    for th in threads:
        while th.is_alive():
            th.join(poll_s)
            if failed:
                raise failed[0]
    if failed:
        raise failed[0]
