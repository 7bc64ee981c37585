"""SecAgg's parts: Shamir sharing, fixed point, the Harary graph, the wire form, the settings."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ioft_protocol.secagg import SecAggConfig, graph, quantize, shamir
from ioft_protocol.secagg.messages import MaskedInput, SecAggWireError, ShareKeys, UnmaskAnswer, pack, unpack
from tests.budget import examples
from tests.ioft_protocol.secagg_fixtures import rebuilds


def test_shamir_threshold_rebuilds_and_fewer_do_not():
    secret = os.urandom(32)
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3)
    for subset in ([1, 2, 3], [5, 3, 1], [2, 4, 5]):
        assert shamir.combine([shares[x] for x in subset]) == secret
    assert not rebuilds([shares[1], shares[2]], secret)  # two points of a degree-2 polynomial


def test_shamir_refuses_bad_input():
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(os.urandom(32), [1, 2], 3)
    with pytest.raises(ValueError, match="distinct"):
        shamir.split(os.urandom(32), [1, 1, 2], 2)
    with pytest.raises(ValueError, match="distinct"):
        shamir.combine([shamir.split(os.urandom(32), [1, 2], 2)[1]] * 2)


def test_harary_graph_is_regular_symmetric_and_connected():
    devices = [f"d{i}" for i in range(50)]
    g = graph.harary(devices, 8, random.Random(1))
    assert all(len(v) == 8 for v in g.values())
    assert all(a in g[b] for a in g for b in g[a])
    seen, todo = set(), ["d0"]
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo.extend(g[d])
    assert seen == set(devices)
    assert graph.harary(devices[:5], 8, random.Random(1))["d0"] == frozenset(devices[1:5])


@pytest.mark.parametrize(("n", "degree"), [(2, 1), (20, 10), (100, 14), (1000, 20), (10_000, 28)])
def test_default_degree_grows_like_log_n(n, degree):
    assert graph.default_degree(n) == degree


@given(
    clip=st.floats(1e-3, 1e3),
    bits=st.integers(2, 31),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=examples(60), deadline=None)
def test_fixed_point_sum_is_within_half_a_step_per_device(clip, bits, n, seed):
    p = SecAggConfig(clip=clip, bits=bits, max_weight=4.0).round_params(n, 7)
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-2 * clip, 2 * clip, (n, 7))
    ws = rng.uniform(0, 5, n)
    total = np.zeros(8, dtype=quantize.RING_DTYPE)
    for x, w in zip(xs, ws, strict=True):
        total += quantize.encode(p, x, w)
    values, weight = quantize.decode_sum(p, total)
    qw = np.array([quantize.quantized_weight(p, w) for w in ws])
    step = clip / quantize.levels(p)
    assert np.all(
        np.abs(values - (qw[:, None] * np.clip(xs, -clip, clip)).sum(0)) <= n * step / 2 * (1 + 1e-9)
    )
    assert weight == pytest.approx(qw.sum(), abs=1e-9 * n)


def test_the_ring_is_as_narrow_as_n_inputs_allow_and_packs_to_its_width():
    assert SecAggConfig(bits=16).round_params(1000, 3).ring_bits == 26  # 16 + ceil(log2 1000)
    assert SecAggConfig(bits=16).round_params(1024, 3).ring_bits == 26
    assert SecAggConfig(bits=31).round_params(2**33, 3).ring_bits == 64
    p = SecAggConfig(bits=8).round_params(3, 37)
    with pytest.raises(ValueError, match="bytes"):
        quantize.unpack(p, quantize.pack(p, np.zeros(38, np.uint64))[:-1], 38)


@given(bits=st.integers(2, 31), log_n=st.integers(0, 33), length=st.integers(1, 300), seed=st.integers(0, 99))
@settings(max_examples=examples(60), deadline=None)
def test_packing_round_trips_at_every_ring_width(bits, log_n, length, seed):
    p = SecAggConfig(bits=bits).round_params(2**log_n, length)
    v = quantize.reduce(p, np.random.default_rng(seed).integers(0, 2**64, length, dtype=np.uint64))
    packed = quantize.pack(p, v)
    assert len(packed) == (length * p.ring_bits + 7) // 8
    np.testing.assert_array_equal(quantize.unpack(p, packed, length), v)


def test_settings_are_checked_with_every_error_named():
    with pytest.raises(ValueError) as err:
        SecAggConfig(threshold=0.4, clip=-1, bits=40, degree=-2)
    for word in ("threshold", "clip", "bits", "degree"):
        assert word in str(err.value)
    with pytest.raises(ValueError, match="raise degree"):
        SecAggConfig(threshold=30).round_params(20, 3)
    assert SecAggConfig(threshold=0.3 + 0.3).round_params(20, 3).threshold == 7  # ceil(0.6 · 11)
    assert SecAggConfig(threshold=0.51).round_params(20, 3).threshold == 6  # > half of 11 holders


def test_wire_round_trip_carries_bytes_raw_and_refuses_garbage():
    y = bytes(range(200))
    msg = MaskedInput(ring_bits=26, y=y)
    wire = msg.encode()
    assert MaskedInput.decode(wire) == msg
    assert len(wire) < len(y) + 64  # no base64
    assert UnmaskAnswer.decode(UnmaskAnswer({"a": b"\x00" * 68}, {}).encode()).b_shares == {"a": b"\x00" * 68}
    for bad in (b"", b"XX", b"SA1\x00\x00\x00\x05nope!", b"SA1\x00\x00\x00\x02{}"):
        with pytest.raises(SecAggWireError):
            unpack(bad)
    with pytest.raises(SecAggWireError, match="expected"):
        ShareKeys.decode(wire)
    with pytest.raises(SecAggWireError, match="field 'ring_bits'"):
        MaskedInput.decode(pack("masked", {"ring_bits": "26", "y": y}))
