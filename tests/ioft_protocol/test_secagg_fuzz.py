"""Mutated SecAgg payloads: a device (``edge.secagg_client``) and the aggregator's state machine
drop or refuse them and go on; nothing raises past them (a device daemon must not crash on a
bad message, nor an aggregator on a bad answer)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.secagg_client import SecAggDevice
from ioft_protocol.secagg import SecAggConfig, ServerSecAgg
from ioft_protocol.secagg.messages import SecAggWireError
from ioft_protocol.secagg.server import StageError
from ioft_protocol.secagg.transport import ANSWERS, Envelope, SecAggTopic, parse_topic
from tests.budget import examples

STAGES = ("setup", "neighbour_keys", "inbox", "unmask")
DEVICES = ("d0", "d1", "d2", "d3")


def _mutate(payload: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(payload)
    for at, value in edits:
        b[at % len(b)] = value
    return bytes(b[:cut] if cut is not None else b)


def _round(target: tuple[str, str] | None, mutate, *, up: bool) -> ServerSecAgg:
    """One round through SecAggDevice and ServerSecAgg, mutating ``target`` = (stage, device)'s
    request (``up`` False) or its answer (``up`` True)."""
    outbox: list[tuple[str, bytes]] = []
    devs = {d: SecAggDevice("f", d, lambda t, p: outbox.append((t, p))) for d in DEVICES}
    rng = np.random.default_rng(0)
    for d in DEVICES:
        devs[d].arm("t", 1, "train", rng.uniform(-1, 1, 5), 1.0)
    srv = ServerSecAgg(SecAggConfig(threshold=0.6), DEVICES, session="s", length=5)
    receive = dict(
        zip(
            STAGES,
            (srv.receive_keys, srv.receive_shares, srv.receive_masked, srv.receive_unmask),
            strict=True,
        )
    )
    closes = (srv.close_keys, srv.close_shares, srv.close_masked, None)
    requests = srv.setup()
    for stage, close in zip(STAGES, closes, strict=True):
        for d, msg in requests.items():
            payload = Envelope("s", 1, "train", stage, msg.encode()).encode()
            if not up and target == (stage, d):
                payload = mutate(payload)
            devs[d].handle(SecAggTopic("down", "f", "t", d), payload)  # must never raise
        for topic, payload in outbox:
            device = parse_topic(topic).device
            if up and target == (stage, device):
                payload = mutate(payload)
            try:  # what SecAggFleet._take does
                env = Envelope.decode(payload)
                if env.session == "s" and env.stage == stage:
                    receive[stage](device, env.open(ANSWERS))
            except (SecAggWireError, StageError):
                pass
        outbox.clear()
        if close is None:
            break
        requests = close()
        if srv.outcome is not None:
            return srv
    srv.close_unmask()
    return srv


@given(
    stage=st.sampled_from(STAGES),
    device=st.sampled_from(DEVICES),
    up=st.booleans(),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 400)),
)
@settings(max_examples=examples(60), deadline=None)
def test_mutated_requests_and_answers_are_dropped_or_refused_never_raised(stage, device, up, edits, cut):
    srv = _round((stage, device), lambda p: _mutate(p, edits, cut), up=up)
    assert srv.outcome is not None  # the round ended: a sum or a clean abandon


def test_an_unmutated_round_through_the_device_code_completes():
    srv = _round(None, lambda p: p, up=False)
    assert srv.outcome.survivors == DEVICES
