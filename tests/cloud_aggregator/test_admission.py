"""Update admission: the pipeline on its own, and over the MQTT fleet's receive path with a
fake session (no broker).

Each hostile upload must be refused, counted per device and reason (FleetView and the
store), and never reach the strategy; honest uploads in the same round still count.
"""

from __future__ import annotations

import dataclasses
import sqlite3

import numpy as np
import pytest

from benchmarks.common import QueuedSession
from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy, change_norm, check_tensors
from cloud_aggregator.rounds.types import CollectRequest, Reason, Rejection
from cloud_aggregator.serve.mqtt_fleet import CollectPolicy, MqttFleet
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import codec, round_messages, topics
from ioft_protocol.mqtt_inbound import Message
from trainer_lite.params import param_hash
from trainer_lite.task import TaskSpec

FLEET, TASK = "f", "t"
DEVICES = [f"d{i}" for i in range(10)]
SPEC = TaskSpec(TASK, "fedavg", "sigmoid_glm", rounds=3)


#: Other tests here import it by this name.
FakeSession = QueuedSession


def global_params() -> dict[str, np.ndarray]:
    return {"w": np.linspace(-1, 1, 8, dtype=np.float32), "b": np.zeros(1, np.float32)}


def request(round_: int, g: dict[str, np.ndarray]) -> CollectRequest:
    return CollectRequest(
        spec=SPEC,
        round=round_,
        phase="train",
        global_params=g,
        global_hash=param_hash(g),
        downlinks={},
        expected={n: codec.TensorSpec(tuple(v.shape), v.dtype.name) for n, v in g.items()},
    )


def message(req: CollectRequest, device: str, params) -> round_messages.UpdateMessage:
    return round_messages.UpdateMessage(
        FLEET, TASK, device, req.round, req.phase, 10, req.global_hash, {}, params
    )


def upload(req: CollectRequest, device: str, params, *, round_=None, name=None, ghash=None) -> Message:
    msg = round_messages.UpdateMessage(
        FLEET,
        TASK,
        name or device,
        req.round if round_ is None else round_,
        req.phase,
        10,
        req.global_hash if ghash is None else ghash,
        {},
        params,
    )
    return Message(topics.topic_up(FLEET, TASK, device), msg.encode(), False)


def honest(g, device: str, round_: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([round_, int(device[1:])])
    return {n: (v + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype) for n, v in g.items()}


@pytest.fixture
def fleet(tmp_path):
    store = SqliteStore(tmp_path / "agg")
    session = FakeSession()
    f = MqttFleet(
        session,
        FLEET,
        CollectPolicy(deadline_s=0.2, expected=tuple(DEVICES), max_extensions=0),
        store,
        AdmissionPolicy(max_norm_ratio=50.0, min_history=5),
    )
    yield f, session, store
    store.close()


def run_round(f: MqttFleet, session: FakeSession, req: CollectRequest, messages: list[Message]):
    session.queue.extend(messages)
    replies = f.collect(req)
    updates = {r.device: r for r in replies if isinstance(r, Update)}
    rejected = {r.device: r.reason for r in replies if isinstance(r, Rejection)}
    return updates, rejected


def test_hostile_uploads_are_refused_counted_by_reason_and_never_aggregated(fleet):
    f, session, store = fleet
    g = global_params()
    r1 = request(1, g)
    # Round 1: everyone honest; d0's upload is delivered twice (QoS 1): a copy, resent.
    msgs = [upload(r1, d, honest(g, d, 1)) for d in DEVICES]
    updates, rejected = run_round(f, session, r1, [msgs[0], *msgs])
    assert sorted(updates) == DEVICES and not rejected
    assert f.view.rejected_by_reason == {"d0": {Reason.RESENT: 1}}

    r2 = request(2, honest(g, "d0", 99))
    g2 = r2.global_params
    bad_shape = {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}
    bad_dtype = {n: v.astype(np.float64) for n, v in g2.items()}
    nan = {**g2, "w": np.full(8, np.nan, np.float32)}
    inf = {**g2, "b": np.array([np.inf], np.float32)}
    huge = {n: (v + 1e4).astype(v.dtype) for n, v in g2.items()}
    hostile = [
        upload(r2, "d0", bad_shape),
        upload(r2, "d1", bad_dtype),
        upload(r2, "d2", nan),
        upload(r2, "d3", inf),
        upload(r2, "d4", huge),
        upload(r2, "d5", honest(g, "d5", 1), round_=1),  # stale: a round-1 upload re-sent
        upload(r2, "d6", honest(g2, "d6", 3), round_=3),  # from the future
        upload(r2, "d7", honest(g2, "d7", 2), ghash="0" * 64),  # quotes another global
        Message(topics.topic_up(FLEET, TASK, "d8"), msgs[1].payload, False),  # d1's payload verbatim
        Message(topics.topic_up(FLEET, TASK, "d9"), b"\x00garbage" * 4, False),
        upload(r2, "d9", honest(g2, "d9", 2), name="d8"),  # speaks for d8
    ]
    # Equal tensors are no replay: d5 sends its own round-1 tensors as its round-2 answer, d6
    # d0's round-1 tensors (a converged fleet repeats itself; identity is the broker's job).
    same_as_before = upload(r2, "d5", honest(g, "d5", 1))
    same_as_other = upload(r2, "d6", honest(g, "d0", 1))
    fresh = [upload(r2, d, honest(g2, d, 2)) for d in ("d7", "d8", "d9")]
    again = fresh[0]  # a copy: d7 answered round 2 with it already
    updates, rejected = run_round(f, session, r2, [*hostile, same_as_before, same_as_other, *fresh, again])

    assert sorted(updates) == ["d5", "d6", "d7", "d8", "d9"]
    for d in ("d7", "d8", "d9"):  # the fresh uploads are the ones kept
        np.testing.assert_array_equal(updates[d].params["w"], honest(g2, d, 2)["w"])
    np.testing.assert_array_equal(updates["d6"].params["w"], honest(g, "d0", 1)["w"])
    assert set(rejected) == {"d0", "d1", "d2", "d3", "d4"}  # their answers to round 2 were refused
    by_reason = {d: dict(v) for d, v in f.view.rejected_by_reason.items()}
    assert by_reason == {
        "d0": {"resent": 1, "shape_dtype": 1},
        "d1": {"shape_dtype": 1},
        "d2": {"non_finite": 1},
        "d3": {"non_finite": 1},
        "d4": {"norm": 1},
        "d5": {"stale_round": 1},
        "d6": {"future_round": 1},
        "d7": {"wrong_global": 1, "resent": 1},
        "d8": {"impersonation": 1},  # d1's payload verbatim names d1 inside
        "d9": {"malformed": 1, "impersonation": 1},
    }
    assert store.rejection_counts_by_reason(TASK) == by_reason
    assert store.rejection_counts(TASK) == {d: sum(v.values()) for d, v in by_reason.items()}
    assert f.view.rejected == store.rejection_counts(TASK)


def test_equal_tensors_are_admitted_a_second_answer_is_a_replay():
    """Replay is (device, task, round, phase) answered already, never a tensor fingerprint."""
    g = global_params()
    adm = Admission(FLEET)
    r1, r2 = request(1, g), request(2, g)
    converged = honest(g, "d1", 1)
    for device in ("d1", "d2"):  # two devices, bit-identical tensors: both count
        assert adm.judge(device, message(r1, device, converged), r1).device == device
    assert adm.judge("d1", message(r2, "d1", converged), r2).device == "d1"  # and again next round
    assert adm.judge("d0", message(r1, "d0", g), r1).device == "d0"  # what it was sent, unchanged
    refusal = adm.judge("d1", message(r2, "d1", honest(g, "d1", 2)), r2)
    assert refusal.reason is Reason.REPLAY and "already answered round 2/train" in refusal.detail
    other_phase = dataclasses.replace(r2, phase="heads")
    assert adm.judge("d1", message(other_phase, "d1", converged), other_phase).device == "d1"


def test_a_copy_of_a_counted_upload_is_resent_another_answer_a_replay():
    """A re-send of the upload counted (a redelivery, a restarted device, a re-announced round)
    is ``resent``, in the open round and after it closed; another answer stays a refusal."""
    g = global_params()
    adm = Admission(FLEET)
    r1 = request(1, g)
    counted = upload(r1, "d1", honest(g, "d1", 1)).payload
    other = upload(r1, "d1", honest(g, "d1", 2)).payload
    assert isinstance(adm.receive("d1", counted, r1, {}), Update)
    assert adm.receive("d1", counted, r1, {}).reason is Reason.RESENT  # bytes: MQTT
    sim_copy = round_messages.UpdateMessage.decode(counted)
    assert adm.receive("d1", sim_copy, r1, {}).reason is Reason.RESENT  # an UpdateMessage: simulation
    assert adm.receive("d1", other, r1, {}).reason is Reason.REPLAY
    r2 = request(2, honest(g, "d0", 9))
    assert adm.receive("d1", counted, r2, {}).reason is Reason.RESENT  # after its round closed
    assert adm.receive("d1", other, r2, {}).reason is Reason.STALE_ROUND
    assert (
        adm.receive("d2", upload(r1, "d2", honest(g, "d2", 1)).payload, r2, {}).reason is Reason.STALE_ROUND
    )
    same_but_metrics = dataclasses.replace(sim_copy, metrics={"train_seconds": 0.5})
    assert adm.receive("d1", same_but_metrics, r2, {}).reason is Reason.STALE_ROUND  # another training
    assert adm.refused == {
        "d1": {Reason.RESENT: 3, Reason.REPLAY: 1, Reason.STALE_ROUND: 2},
        "d2": {Reason.STALE_ROUND: 1},
    }


def test_norm_reference_is_a_running_median_and_bounds_are_configurable():
    g = global_params()
    req = request(1, g)
    adm = Admission(FLEET, AdmissionPolicy(max_norm_ratio=10.0, min_history=3))
    small = {n: v + 0.1 for n, v in g.items()}
    step = change_norm(small, g)
    # Before min_history norms are known, nothing is judged relative.
    big = {n: v + 50.0 for n, v in g.items()}
    assert adm.check_norm("d0", change_norm(big, g), big, req) is None
    for i in range(3):
        p = {n: v + 0.1 * (1 + i / 10) for n, v in g.items()}
        assert isinstance(adm.judge(f"d{i}", message(req, f"d{i}", p), req), Update)
    assert adm.reference("train", SPEC.name) == pytest.approx(step * 1.1, rel=1e-5)
    refusal = adm.judge("d5", message(req, "d5", big), req)
    assert refusal.reason is Reason.NORM
    assert isinstance(adm.judge("d5", message(req, "d5", {n: v + 0.5 for n, v in g.items()}), req), Update)
    # One huge admitted outlier (restored from the store: not judged again) cannot drag the median up.
    outlier = {n: v + 1e6 for n, v in g.items()}
    assert isinstance(adm.judge("d9", message(req, "d9", outlier), req, restored=True), Update)
    assert adm.judge("d6", message(req, "d6", big), req).reason is Reason.NORM
    absolute = Admission(FLEET, AdmissionPolicy(max_norm_ratio=None, max_param_norm=1.0))
    assert absolute.judge("d0", message(req, "d0", big), req).reason is Reason.NORM
    assert isinstance(
        Admission(FLEET, AdmissionPolicy(max_norm_ratio=None)).judge("d0", message(req, "d0", big), req),
        Update,
    )


def test_check_tensors_classifies_shape_dtype_and_non_finite():
    spec = {"w": codec.TensorSpec((2,), "float32")}
    assert check_tensors({"w": np.zeros(2, np.float32)}, spec) is None
    assert check_tensors({"w": np.zeros(3, np.float32)}, spec).reason is Reason.SHAPE_DTYPE
    assert check_tensors({"w": np.zeros(2, np.float64)}, spec).reason is Reason.SHAPE_DTYPE
    assert check_tensors({"v": np.zeros(2, np.float32)}, spec).reason is Reason.SHAPE_DTYPE
    assert check_tensors({"w": np.array([0, np.nan], np.float32)}, spec).reason is Reason.NON_FINITE


def test_policy_validation():
    with pytest.raises(ValueError):
        AdmissionPolicy(max_norm_ratio=0.5)
    with pytest.raises(ValueError):
        AdmissionPolicy(max_update_norm=0.0)
    with pytest.raises(ValueError):
        AdmissionPolicy(min_history=10, history=5)


def test_norm_reference_is_per_task():
    """A converged task's tiny steps must not judge another task's first rounds."""
    g = global_params()
    adm = Admission(FLEET, AdmissionPolicy(max_norm_ratio=10.0, min_history=3))
    converged = request(50, g)
    for i in range(3):
        p = {n: v + 1e-4 * (i + 1) for n, v in g.items()}
        adm.judge(f"d{i}", message(converged, f"d{i}", p), converged)
    other_spec = TaskSpec("other-task", "fedavg", "sigmoid_glm")
    other = dataclasses.replace(converged, spec=other_spec)
    first_step = {n: v + 1.0 for n, v in g.items()}
    other_msg = dataclasses.replace(message(converged, "d0", first_step), task="other-task")
    assert isinstance(adm.judge("d0", other_msg, other), Update)
    assert adm.judge("d5", message(converged, "d5", first_step), converged).reason is Reason.NORM


def test_a_reference_that_refuses_most_of_a_round_is_forgotten():
    g = global_params()
    adm = Admission(FLEET, AdmissionPolicy(max_norm_ratio=10.0, min_history=3))
    r1 = request(1, g)
    for i in range(3):
        adm.judge(f"d{i}", message(r1, f"d{i}", {n: v + 1e-4 * (i + 1) for n, v in g.items()}), r1)
    req = request(2, g)
    for i in range(3):  # the whole fleet moved faster: every upload is refused
        faster = {n: v + 1.0 + i for n, v in g.items()}
        assert adm.judge(f"d{i}", message(req, f"d{i}", faster), req).reason is Reason.NORM
    assert not adm.forget_stale(req, admitted=3)  # refused ≤ admitted: a minority, keep it
    assert adm.forget_stale(req, admitted=0)
    assert adm.reference("train", SPEC.name) is None
    assert isinstance(adm.judge("d0", message(req, "d0", {n: v + 1.0 for n, v in g.items()}), req), Update)


def test_rejections_stored_as_text_get_their_code_once(tmp_path):
    """A store written before codes had a column: the code is parsed at migration, or 'other'."""
    path = tmp_path / "agg.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE rejections (task TEXT NOT NULL, round INTEGER, device TEXT NOT NULL, "
        "reason TEXT NOT NULL, at REAL NOT NULL)"
    )
    rows = [
        ("d0", "duplicate: device already uploaded for this round"),
        ("d0", "norm: ‖u − g‖ = 5 exceeds 1000 × the running median 0.001"),
        ("d1", "replay: tensors identical to d0's upload for round 3/train"),
        ("d1", "tensor 'w' holds NaN or Inf"),
    ]
    old.executemany("INSERT INTO rejections VALUES (?, 3, ?, ?, 0.0)", [(TASK, d, r) for d, r in rows])
    old.commit()
    old.close()
    store = SqliteStore(path)
    try:
        assert store.rejection_counts_by_reason(TASK) == {
            "d0": {"replay": 1, "norm": 1},
            "d1": {"replay": 1, "other": 1},
        }
    finally:
        store.close()
    reopened = SqliteStore(path, readonly=True)
    try:
        assert reopened.rejection_counts(TASK) == {"d0": 2, "d1": 2}
    finally:
        reopened.close()


def test_admission_screens_out_held_out_and_unselected_devices_before_reading_the_payload():
    # One place judges every refusal: a held-out device, or one outside the task's selection, is
    # refused not_selected and counted once, its payload never read, and it is not a round answer.
    adm = Admission(FLEET)
    g = global_params()
    req = request(1, g)
    inbox: dict = {}
    held = adm.receive("d1", b"not even a payload", req, inbox, held_out=True)
    outside = adm.receive("d2", b"", req, inbox, outside="its tags do not match the task's selection")
    assert (held.reason, outside.reason) == (Reason.NOT_SELECTED, Reason.NOT_SELECTED)
    assert "held out" in held.detail and "selection" in outside.detail
    assert adm.refused == {"d1": {Reason.NOT_SELECTED: 1}, "d2": {Reason.NOT_SELECTED: 1}}
    assert inbox == {}
