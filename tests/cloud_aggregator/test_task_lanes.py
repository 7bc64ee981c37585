"""Which tasks run side by side (``cloud_aggregator.serve.task_lanes``): those no device can share."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_aggregator.serve.task_lanes import run_side_by_side, waits_for
from ioft_protocol.round_messages import MACHINE_KINDS, DeviceSelection
from tests.budget import examples


@dataclass
class Task:
    name: str
    devices: DeviceSelection | None = None


PRINTERS = DeviceSelection(kind="printer")
WELDERS = DeviceSelection(kind="welder")


def test_different_kinds_or_ids_are_disjoint_tags_and_no_selection_never_are():
    assert PRINTERS.disjoint(WELDERS) and WELDERS.disjoint(PRINTERS)
    assert DeviceSelection(ids=("p1", "p2")).disjoint(DeviceSelection(ids=("p3",)))
    assert not DeviceSelection(ids=("p1", "p2")).disjoint(DeviceSelection(ids=("p2",)))
    assert not PRINTERS.disjoint(None)
    assert not PRINTERS.disjoint(DeviceSelection(kind="printer", tags=("line-a",)))
    assert not DeviceSelection(tags=("a",)).disjoint(DeviceSelection(tags=("b",)))  # a device may carry both


selections = st.one_of(
    st.none(),
    st.builds(
        DeviceSelection,
        kind=st.one_of(st.none(), st.sampled_from(sorted(MACHINE_KINDS))),
        tags=st.lists(st.sampled_from(["a", "b"]), max_size=2).map(tuple),
        ids=st.lists(st.sampled_from(["d1", "d2", "d3"]), max_size=2).map(tuple),
    ),
)
devices = st.tuples(
    st.sampled_from(["d1", "d2", "d3"]),
    st.one_of(st.none(), st.sampled_from(sorted(MACHINE_KINDS))),
    st.lists(st.sampled_from(["a", "b"]), max_size=2),
)


@settings(max_examples=examples(200), deadline=None)
@given(selections, selections, devices)
def test_disjoint_selections_never_both_select_a_device(a, b, device):
    """The claim ``serve`` relies on: no device is selected by two disjoint selections."""
    if a is None or not a.disjoint(b):
        return
    d, kind, tags = device
    assert a.refusal(d, kind, tags) is not None or b.refusal(d, kind, tags) is not None


def test_a_task_waits_only_for_earlier_tasks_it_may_share_devices_with():
    tasks = [Task("speed", PRINTERS), Task("tool", WELDERS), Task("probe"), Task("speed2", PRINTERS)]
    assert waits_for(tasks) == {
        "speed": [],
        "tool": [],  # welders only: runs beside speed
        "probe": ["speed", "tool"],  # any device: after both
        "speed2": ["speed", "probe"],  # printers again: after speed and probe, beside nothing
    }


def test_disjoint_tasks_run_at_the_same_time_and_the_rest_in_order():
    both_running = threading.Barrier(2, timeout=10)  # speed and tool must be running together
    order: list[str] = []

    def run(task: Task) -> None:
        if task.name in ("speed", "tool"):
            both_running.wait()
        order.append(task.name)

    run_side_by_side([Task("speed", PRINTERS), Task("tool", WELDERS), Task("probe")], run, poll_s=0.01)
    assert sorted(order[:2]) == ["speed", "tool"] and order[2] == "probe"


def test_a_failed_task_is_raised_and_the_tasks_waiting_for_it_never_start():
    started: list[str] = []

    def run(task: Task) -> None:
        started.append(task.name)
        if task.name == "speed":
            raise RuntimeError("speed failed")

    with pytest.raises(RuntimeError, match="speed failed"):
        run_side_by_side([Task("speed", PRINTERS), Task("speed2", PRINTERS)], run, poll_s=0.01)
    assert started == ["speed"]
