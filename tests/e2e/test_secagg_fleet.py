"""Secure aggregation over a real mosquitto with `cloud-aggregator serve` and `edge-trainer` processes.

Two SecAgg tasks run side by side on one aggregator, each on its own devices.  In one, a
device dies (SIGKILL, ``IOFT_SECAGG_FAULT``) after the key exchange: the round still completes,
with exactly the mean of the survivors' clipped, fixed-point changes, and nothing on the wire
carries a device's parameters in the clear.  In the other, one of two dies before it: the
round is abandoned and counted, the global unchanged.  And the broker ACL that ``fleet init``
writes keeps each device's SecAgg messages to that device.
"""

from __future__ import annotations

import re
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.fleet.init import AGGREGATOR
from cloud_aggregator.local.broker import start_mosquitto
from cloud_aggregator.local.fleet import FLEET, LocalFleet, Sniffer, aggregator_toml
from cloud_aggregator.rounds.secagg import ABANDONED, DROPPED
from cloud_aggregator.store.sqlite import SqliteStore
from edge.secagg_client import FAULT_ENV
from edge.task_state import load_task_state
from ioft_protocol import codec
from ioft_protocol.secagg import SecAggConfig, quantize
from ioft_protocol.secagg.messages import MaskedInput
from ioft_protocol.secagg.transport import Envelope, change, flatten, topic_down, topic_up, unflatten
from tests.e2e.test_access import SETTLE_S, _connected, _fleet_broker, _wait_for
from trainer_lite.task import TaskSpec

pytestmark = pytest.mark.broker
DEVICES = ["printer1", "printer2", "printer3", "printer4"]
README = Path(__file__).resolve().parents[2] / "docs" / "formats.md"  # moved from README.md


def readme_secagg_task() -> dict:
    blocks = dict(re.findall(r"```[a-z]*\n# README example: (\S+)\n(.*?)```", README.read_text(), re.S))
    (task,) = tomllib.loads(blocks["secagg-task.toml"])["task"]
    return task


TASK = {**readme_secagg_task(), "rounds": 1}
SECAGG = TASK["secagg"]


#: Three SecAgg tasks side by side on one aggregator, each on its own devices: in "speed" one of
#: four devices dies after the key exchange; in "lost" two of three die before it (one device
#: left cannot hold threshold shares); "pair" has two devices, fewer than the minimum of three
#: participants (``min_participants``, the devices' floor alike): a sum of two is never taken.
#: (``lost`` had two devices, one dying, before the minimum existed: it has three now.)
LOST = {**TASK, "name": "lost", "devices": {"ids": ["welder1", "welder2", "welder3"]}}
PAIR = {**TASK, "name": "pair", "devices": {"ids": ["welder4", "welder5"]}}
SPEED = {**TASK, "devices": {"ids": DEVICES}}
FAULTS = {"printer4": "neighbour_keys@speed", "welder2": "setup@lost", "welder3": "setup@lost"}
OTHERS = [*LOST["devices"]["ids"], *PAIR["devices"]["ids"]]


@pytest.fixture(scope="module")
def secagg_fleet(tmp_path_factory) -> Iterator[tuple[LocalFleet, list[tuple[str, bytes]]]]:
    """One run of both tasks; yields the fleet (its logs, store and device folders) and every
    message the broker carried."""
    work = tmp_path_factory.mktemp("secagg-fleet")
    broker = start_mosquitto(log_file=work / "mosquitto.log")
    procs = LocalFleet(work, broker.url)
    sniffer = Sniffer(broker.url)
    try:
        for device in [*DEVICES, *OTHERS]:
            fault = FAULTS.get(device)
            with pytest.MonkeyPatch.context() as mp:
                if fault:
                    mp.setenv(FAULT_ENV, fault)
                procs.start_device(device)
        names = [*DEVICES, *OTHERS]
        procs.start_aggregator(
            aggregator_toml(
                broker.url, work / "aggregator", [SPEED, LOST, PAIR], expected=names, min_participants=1
            )
        )
        assert procs.wait_aggregator(90) == 0, procs.log("aggregator")
        for device in FAULTS:  # SIGKILL: each really died mid-round
            assert procs.devices[device].wait(10) == -9, procs.log(device)
        yield procs, list(sniffer.messages)
    finally:
        sniffer.stop()
        procs.stop_all()
        broker.stop()


def _record_and_global(procs: LocalFleet, task: str):
    store = SqliteStore(procs.db, readonly=True)
    try:
        (record,) = store.rounds(task)
        return record, store.get_params(record.global_hash)
    finally:
        store.close()


def _expected_global(spec: TaskSpec, work, survivors: list[str]) -> dict[str, np.ndarray]:
    """What the aggregator must reach: the initial global plus the survivors' quantized mean change."""
    g = make_strategy(spec).init_global()
    p = SecAggConfig(**SECAGG).round_params(len(DEVICES), int(flatten(g).size))
    total = np.zeros(p.length + 1, dtype=quantize.RING_DTYPE)
    for d in survivors:
        state = load_task_state(work / d / "tasks" / spec.name / "local.safetensors")
        total += quantize.encode(p, change(state.upload, g), 1.0)  # uniform weighting
    values, weight = quantize.decode_sum(p, total)
    return unflatten(flatten(g) + values / weight, g)


def test_a_round_completes_with_the_exact_survivor_sum_when_a_device_drops_after_key_exchange(secagg_fleet):
    procs, messages = secagg_fleet
    record, new_global = _record_and_global(procs, "speed")
    survivors = DEVICES[:-1]
    assert record.status == "completed" and sorted(record.participants) == survivors
    assert record.rejected == {"printer4": DROPPED}
    spec = TaskSpec(**TASK)
    expected = _expected_global(spec, procs.work, survivors)
    assert sorted(new_global) == sorted(expected)
    for name in expected:  # the exact survivor sum: same integers, same arithmetic, same bits
        np.testing.assert_array_equal(new_global[name], expected[name])
    # Nothing in the clear: uploads carry no tensors, masked inputs match no device's encoding.
    g = make_strategy(spec).init_global()
    p = SecAggConfig(**SECAGG).round_params(len(DEVICES), int(flatten(g).size))
    for topic, payload in messages:
        if "/up/" in topic and "/secagg/" not in topic:
            assert codec.decode(payload)[1] == {}, topic
    masked = {}
    for topic, payload in messages:
        if "/task/speed/secagg/up/" in topic:
            env = Envelope.decode(payload)
            if env.stage == "inbox":
                masked[topic.rsplit("/", 1)[1]] = quantize.unpack(
                    p, MaskedInput.decode(env.body).y, p.length + 1
                )
    assert sorted(masked) == survivors
    for d in survivors:
        state = load_task_state(procs.work / d / "tasks" / "speed" / "local.safetensors")
        assert not np.any(masked[d] == quantize.encode(p, change(state.upload, g), 1.0)), d


def test_a_round_with_dropouts_beyond_the_threshold_is_abandoned_and_counted(secagg_fleet):
    procs, _ = secagg_fleet
    record, kept = _record_and_global(procs, "lost")
    devices = LOST["devices"]["ids"]
    assert record.status == "abandoned" and record.participants == []
    assert record.rejected == dict.fromkeys(devices, f"{ABANDONED}: too_few_keys")
    initial = make_strategy(TaskSpec(**TASK)).init_global()
    assert all(np.array_equal(kept[n], initial[n]) for n in initial)  # the global stays


def test_a_fleet_of_two_takes_no_sum_below_the_minimum_of_three(secagg_fleet):
    procs, wire = secagg_fleet
    record, kept = _record_and_global(procs, "pair")
    devices = PAIR["devices"]["ids"]
    assert record.status == "abandoned" and record.participants == []
    assert record.rejected == dict.fromkeys(devices, f"{ABANDONED}: too_few_participants")
    initial = make_strategy(TaskSpec(**{k: v for k, v in PAIR.items() if k != "devices"})).init_global()
    assert all(np.array_equal(kept[n], initial[n]) for n in initial)  # the global stays
    # Not one SecAgg request went to them: no keys, no masked input, nothing to sum.
    assert not [t for t, _ in wire if any(t == topic_down(FLEET, "pair", d) for d in devices)]
    lines = [
        line for line in procs.log("aggregator").splitlines() if "task pair round 1: SecAgg abandoned" in line
    ]
    assert len(lines) == 1 and "min_participants is 3" in lines[0], lines


@pytest.fixture(scope="module")
def cert_fleet(tmp_path_factory):
    yield from _fleet_broker(tmp_path_factory.mktemp("secagg-acl"), "certs")


def test_the_acl_lets_a_device_read_only_the_secagg_messages_addressed_to_it(cert_fleet):
    layout, _ = cert_fleet
    agg = _connected(layout, AGGREGATOR)
    p1 = _connected(layout, "printer1")
    spy = _connected(layout, "printer2")
    try:
        # mosquitto grants every 3.1.1 SUBSCRIBE and applies the read ACL at delivery: non-delivery proves it
        for f in (f"ioft/v1/{FLEET}/task/+/secagg/down/+", f"ioft/v1/{FLEET}/task/+/secagg/up/+", "#"):
            spy.subscribe(f)
        p1.subscribe(topic_down(FLEET, "speed", "printer1"))
        agg.subscribe(f"ioft/v1/{FLEET}/task/+/secagg/up/+")
        agg.publish(topic_down(FLEET, "speed", "printer1"), b"printer1's shares")
        p1.publish(topic_up(FLEET, "speed", "printer1"), b"printer1's masked input")
        spy.publish(topic_up(FLEET, "speed", "printer1"), b"forged as printer1")  # refused: not its topic
        _wait_for(p1, topic_down(FLEET, "speed", "printer1"), b"printer1's shares")
        _wait_for(agg, topic_up(FLEET, "speed", "printer1"), b"printer1's masked input")
        spy.publish(topic_up(FLEET, "speed", "printer2"), b"printer2's own")  # its own: allowed
        _wait_for(agg, topic_up(FLEET, "speed", "printer2"), b"printer2's own")
        time.sleep(SETTLE_S)
        assert not [m for m in spy.messages if "/secagg/" in m[0]], spy.messages
        assert not agg.got(topic_up(FLEET, "speed", "printer1"), b"forged as printer1")
    finally:
        for c in (agg, p1, spy):
            c.close()
