"""The compressed uplink's codec (``ioft_protocol.compress``): shapes, bytes, the rotation, the estimator."""

from __future__ import annotations

import numpy as np
import pytest

from ioft_protocol import compress
from ioft_protocol.compress import CompressConfig
from ioft_protocol.round_messages import UpdateMessage


def _model(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A downlink and a trained upload of a small MLP's shapes (a matrix, a bias, a scalar-ish head)."""
    sent = {
        "l1.weight": rng.standard_normal((40, 31)).astype(np.float32),
        "l1.bias": rng.standard_normal(31).astype(np.float32),
        "head.weight": rng.standard_normal((31, 3)).astype(np.float32),
    }
    upload = {k: v + 0.05 * rng.standard_exponential(v.shape).astype(np.float32) for k, v in sent.items()}
    return sent, upload


def test_fwht_butterflies_and_kronecker_agree_and_invert():
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    h = compress.fwht(x)
    np.testing.assert_allclose(compress.hadamard_rows(x), h, atol=1e-4)
    np.testing.assert_allclose(compress.fwht(h) / 256, x, atol=1e-5)  # H·H = B·I


@pytest.mark.parametrize("bits", compress.BITS)
@pytest.mark.parametrize("rotation", [True, False])
def test_round_trip_keeps_names_shapes_dtypes_and_shrinks_the_bytes(bits, rotation):
    sent, upload = _model(np.random.default_rng(bits))
    cfg = CompressConfig(bits=bits, rotation=rotation, block=256)
    arrays = compress.encode(upload, sent, cfg, seed=11)
    back = compress.decode(arrays, sent, {k: "float32" for k in sent}, cfg, seed=11)
    assert {k: (v.shape, v.dtype) for k, v in back.items()} == {
        k: (v.shape, v.dtype) for k, v in upload.items()
    }
    total = sum(v.size for v in upload.values())
    blocks = -(-total // 256)
    assert compress.wire_bytes(arrays) == blocks * 256 * bits // 8 + 4 * blocks
    x = np.concatenate([(upload[k] - sent[k]).ravel() for k in sorted(sent)])
    xh = np.concatenate([(back[k] - sent[k]).ravel() for k in sorted(sent)])
    assert np.sum((x - xh) ** 2) / np.sum(x**2) < {1: 0.8, 2: 0.3, 4: 0.03, 8: 0.001}[bits] * (
        1 if rotation else 10
    )


def test_one_bit_is_a_thirtieth_of_float32_for_a_large_model():
    rng = np.random.default_rng(0)
    sent = {"w": np.zeros((624, 175), np.float32), "v": np.zeros((175, 125), np.float32)}
    upload = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in sent.items()}
    arrays = compress.encode(upload, sent, CompressConfig(bits=1), seed=0)
    assert 4 * sum(v.size for v in upload.values()) / compress.wire_bytes(arrays) >= 25


def test_the_mean_over_seeds_converges_to_the_change():
    """Unbiased over the rotation: the mean of K decodings approaches x at the rate of the variance."""
    sent, upload = _model(np.random.default_rng(5))
    cfg = CompressConfig(bits=1, block=256)
    x = np.concatenate([(upload[k] - sent[k]).ravel() for k in sorted(sent)])
    k = 400
    acc = np.zeros_like(x, dtype=np.float64)
    for seed in range(k):
        back = compress.decode(
            compress.encode(upload, sent, cfg, seed), sent, dict.fromkeys(sent, "float32"), cfg, seed
        )
        acc += np.concatenate([(back[n] - sent[n]).ravel() for n in sorted(sent)])
    bias = np.sum((acc / k - x) ** 2) / np.sum(x**2)
    # One decoding's error is ~0.57 ‖x‖² (π/2 − 1); K independent ones average to ~0.57 / K.
    assert bias < 3 * 0.5708 / k


def test_bad_codes_are_refused_by_name():
    sent, upload = _model(np.random.default_rng(1))
    cfg = CompressConfig(bits=2, block=256)
    arrays = compress.encode(upload, sent, cfg, seed=1)
    dtypes = dict.fromkeys(sent, "float32")
    with pytest.raises(compress.CompressError, match=r"compress\.codes must be uint8"):
        compress.decode({**arrays, compress.CODES: arrays[compress.CODES][:-1]}, sent, dtypes, cfg, 1)
    with pytest.raises(compress.CompressError, match="NaN"):
        compress.decode({**arrays, compress.SCALES: arrays[compress.SCALES] * np.nan}, sent, dtypes, cfg, 1)
    with pytest.raises(compress.CompressError, match="carries"):
        compress.decode(upload, sent, dtypes, cfg, 1)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"bits": 3}, "bits"),
        ({"bits": 1, "block": 1000}, "block"),
        ({"rotation": "yes"}, "rotation"),
        ({"x": 1}, "table"),
    ],
)
def test_config_names_the_bad_field(table, field):
    with pytest.raises(ValueError, match=field if field != "table" else "bits, rotation, block"):
        CompressConfig.from_json(table)


def test_a_compressed_update_travels_as_uint8_codes():
    sent, upload = _model(np.random.default_rng(2))
    arrays = compress.encode(upload, sent, CompressConfig(), seed=3)
    msg = UpdateMessage("f", "t", "d", 1, "train", 5, "h", {}, arrays, {"bits": 1})
    back = UpdateMessage.decode(msg.encode())
    assert back.compress == {"bits": 1}
    assert back.params[compress.CODES].dtype == np.uint8
    np.testing.assert_array_equal(back.params[compress.CODES], arrays[compress.CODES])
