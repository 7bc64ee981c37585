"""The wire format: round trips, limits and validation."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ioft_protocol import codec, round_messages, topics
from tests.budget import examples


def _update(**kw):
    base = dict(
        fleet="f",
        task="t",
        device="printer1",
        round=3,
        phase="train",
        n_samples=12,
        global_hash="ab",
        metrics={"test_loss": 0.5},
        params={"decoder.weight": np.ones((1, 1), np.float32)},
    )
    return round_messages.UpdateMessage(**{**base, **kw})


def test_update_round_trip():
    msg = _update()
    back = round_messages.UpdateMessage.decode(msg.encode())
    assert (back.fleet, back.task, back.device, back.round, back.phase, back.n_samples) == (
        "f",
        "t",
        "printer1",
        3,
        "train",
        12,
    )
    assert back.metrics == {"test_loss": 0.5}
    np.testing.assert_array_equal(back.params["decoder.weight"], np.ones((1, 1), np.float32))


def test_announcement_round_trip_and_kind_check():
    ann = round_messages.Announcement(
        "f", "t", 2, "train", '{"a":1}', 123.5, "hash", params={"w": np.zeros(3)}
    )
    back = round_messages.Announcement.decode(ann.encode())
    assert back.round == 2 and back.deadline == 123.5 and back.state == "running"
    assert back.max_samples is None and "max_samples" not in codec.decode(ann.encode())[0]
    capped = round_messages.Announcement.decode(replace(ann, max_samples=90).encode())
    assert capped.max_samples == 90  # the round's weight cap, for the aggregator workers
    with pytest.raises(codec.WireError, match="expected an update"):
        round_messages.UpdateMessage.decode(ann.encode())


def test_personal_downlinks_name_their_device_and_the_broadcast_lists_them():
    base = round_messages.Announcement(
        "f", "t", 2, "train", "{}", 1.0, "g", personalized=("d1",), participants=("d1", "d2")
    )
    back = round_messages.Announcement.decode(base.encode())
    assert back.params_hash == "g" and back.for_device is None
    assert back.personalized == ("d1",) and back.participants == ("d1", "d2")
    # d1 waits for its own copy; d2 trains on the broadcast; d3 was not selected.
    assert [back.takes_part(d) for d in ("d1", "d2", "d3")] == [False, True, False]
    own = round_messages.Announcement.decode(
        round_messages.Announcement(
            "f", "t", 2, "train", "{}", 1.0, "g", params_hash="p", for_device="d1", participants=("d1", "d2")
        ).encode()
    )
    assert own.params_hash == "p" and own.global_hash == "g"
    assert [own.takes_part(d) for d in ("d1", "d2")] == [True, False]


def test_announcement_device_lists_are_checked():
    payload = codec.encode(
        "round",
        {
            "fleet": "f",
            "task": "t",
            "round": 1,
            "phase": "train",
            "spec": "{}",
            "deadline": 1.0,
            "global_hash": "g",
            "state": "running",
            "params_hash": "g",
            "for_device": None,
            "personalized": ["ok", "../bad"],
            "participants": None,
        },
    )
    with pytest.raises(codec.WireError):
        round_messages.Announcement.decode(payload)


def test_size_is_checked_before_decoding():
    payload = _update(params={"w": np.zeros(10_000, np.float32)}).encode()
    with pytest.raises(codec.WireError, match="exceeds the limit"):
        codec.decode(payload, max_bytes=1000)


@pytest.mark.parametrize("payload", [b"", b"1234567", b"\x00" * 64, b"\xff" * 100, b"{}" * 10])
def test_garbage_is_a_wire_error(payload):
    with pytest.raises(codec.WireError):
        round_messages.UpdateMessage.decode(payload)


def test_integer_tensors_and_bad_fields_are_refused():
    with pytest.raises(codec.WireError, match="dtype"):
        codec.encode("update", {}, {"w": np.zeros(3, np.int64)})
    bad = codec.encode(
        "update",
        {
            "fleet": "f",
            "task": "t",
            "device": "Bad Id",
            "round": 1,
            "phase": "train",
            "n_samples": 1,
            "global_hash": "h",
            "metrics": {},
        },
    )
    with pytest.raises(codec.WireError, match="device id"):
        round_messages.UpdateMessage.decode(bad)
    negative = _update(n_samples=-1).encode()
    with pytest.raises(codec.WireError, match="n_samples"):
        round_messages.UpdateMessage.decode(negative)


def test_validate_tensors_names_shapes_dtype_finiteness():
    spec = {"w": codec.TensorSpec((2,), "float32")}
    codec.validate_tensors({"w": np.zeros(2, np.float32)}, spec)
    cases = [
        ({}, "missing"),
        ({"w": np.zeros(2, np.float32), "x": np.zeros(1, np.float32)}, "unexpected"),
        ({"w": np.zeros(3, np.float32)}, "expected float32"),
        ({"w": np.zeros(2, np.float64)}, "expected float32"),
        ({"w": np.array([1.0, np.inf], np.float32)}, "NaN or Inf"),
    ]
    for tensors, match in cases:
        with pytest.raises(codec.WireError, match=match):
            codec.validate_tensors(tensors, spec)


def test_topics_parse_back():
    assert topics.parse_topic(topics.topic_up("f", "t", "d")) == topics.Topic("up", "f", "t", "d")
    assert topics.parse_topic(topics.topic_down("f", "t")) == topics.Topic("down", "f", "t")
    assert topics.parse_topic(topics.topic_down_device("f", "t", "d")) == topics.Topic(
        "down_device", "f", "t", "d"
    )
    assert topics.parse_topic(topics.topic_status("f", "d")) == topics.Topic("status", "f", device="d")
    for bad in [
        "",
        "ioft/v1",
        "ioft/v2/f/status/d",
        "ioft/v1/f/task/t/up",
        "ioft/v1/F/status/d",
        "ioft/v1/f/x/y",
    ]:
        with pytest.raises(codec.WireError):
            topics.parse_topic(bad)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=512))
def test_decode_never_raises_anything_but_wire_error(data):
    with contextlib.suppress(codec.WireError):
        round_messages.UpdateMessage.decode(data)


@settings(max_examples=examples(100), deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=0, max_size=4),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_any_float_tensors_round_trip(shapes, dtype):
    rng = np.random.default_rng(0)
    params = {f"p{i}": rng.normal(size=s).astype(dtype) for i, s in enumerate(shapes)}
    back = round_messages.UpdateMessage.decode(_update(params=params).encode()).params
    assert set(back) == set(params)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
        assert back[k].dtype == params[k].dtype


_ST_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32", "float32", "float64"]


@settings(max_examples=examples(200), deadline=None)
@given(
    tensors=st.dictionaries(
        st.text(alphabet='ab._é\n"\\', min_size=1, max_size=6),
        st.tuples(
            st.sampled_from([*_ST_DTYPES, "int64", "uint64", ">f4"]), st.lists(st.integers(0, 3), max_size=3)
        ),
        max_size=5,
    ),
    meta=st.one_of(st.none(), st.text(max_size=40)),
)
def test_safetensors_bytes_are_safetensors_own(tensors, meta):
    """The hand-laid writer the messages and state files use gives safetensors' own bytes (one
    metadata key: safetensors orders several differently from run to run)."""
    from safetensors.numpy import save

    rng = np.random.default_rng(1)
    arrays = {
        k: np.asarray(rng.normal(size=shape) * 100).astype(dtype) for k, (dtype, shape) in tensors.items()
    }
    metadata = None if meta is None else {"ioft": meta}
    assert codec.safetensors_bytes(arrays, metadata) == save(arrays, metadata=metadata)


def test_safetensors_bytes_layout_kept_per_signature():
    """The tensors' header text is made once per layout (names, dtypes, shapes): later calls with the
    same layout and other values or metadata, a non-contiguous array or one of another shape under
    the same name still give safetensors' own bytes."""
    from safetensors.numpy import save

    rng = np.random.default_rng(2)
    for i in range(3):
        arrays = {"b": rng.normal(size=(3, 4)).astype(np.float32), "a": np.arange(5, dtype=np.uint8) + i}
        metadata = {"ioft": f"round {i}"} if i else None
        assert codec.safetensors_bytes(arrays, metadata) == save(arrays, metadata=metadata)
    strided = {"b": rng.normal(size=(4, 3)).astype(np.float32).T, "a": np.arange(5, dtype=np.uint8)}
    assert codec.safetensors_bytes(strided, {"ioft": "t"}) == save(strided, metadata={"ioft": "t"})
    other = {"b": np.ones((2, 6), dtype=np.float32), "a": np.arange(5, dtype=np.uint8)}
    assert codec.safetensors_bytes(other, {"ioft": "x"}) == save(other, metadata={"ioft": "x"})
