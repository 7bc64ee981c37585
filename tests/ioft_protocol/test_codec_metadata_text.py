"""The codec reads the ``ioft`` metadata of a header laid out as its encoder writes it without a
second parse of the whole header (``codec._ioft_text``): the same text as the parse, and
``codec.decode`` answers every payload, hostile ones included, exactly as with the parse (the same
values, or a ``WireError`` with the same words)."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from checks.fuzz_decoders import mutate
from ioft_protocol import codec, round_messages


def seeds() -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for shapes in ([(1000,)], [(3, 4), (2,)], [(1,), (2, 3, 4)], [()]):
        params = {f"t{i}.w": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
        params["z64"] = np.arange(3, dtype=np.float64)
        up = round_messages.UpdateMessage("f", "t", "d1", 2, "train", 10, "g" * 64, {"loss": 0.5}, params)
        out.append(up.encode())
    out.append(codec.encode("update", {"x": 1}, {"codes": np.arange(17, dtype=np.uint8)}))
    return out


def misaligned() -> bytes:
    """Three codes, then a float64 at byte 3: safetensors reads it (an unaligned array)."""
    meta = json.dumps({"v": codec.VERSION, "kind": "update"})
    header = {
        "__metadata__": {"ioft": meta},
        "c": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "x": {"dtype": "F64", "shape": [2], "data_offsets": [3, 19]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(3) + np.arange(2, dtype=np.float64).tobytes()


def _old_decode(payload: bytes, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as m:
        m.setattr(codec, "_ioft_text", lambda header: None)
        return _answer(payload)


def _answer(payload: bytes):
    try:
        meta, tensors = codec.decode(payload)
    except codec.WireError as exc:
        return ("refused", str(exc))
    return (
        "read",
        meta,
        {n: (a.dtype, a.shape, a.tobytes(), a.flags.writeable, a.flags.aligned) for n, a in tensors.items()},
    )


def _header(payload: bytes) -> dict:
    (n,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8 : 8 + n])


def _with_header(payload: bytes, header_text: str) -> bytes:
    (n,) = struct.unpack("<Q", payload[:8])
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + payload[8 + n :]


def test_the_encoders_headers_give_their_metadata_without_a_second_parse():
    for payload in seeds():
        (n,) = struct.unpack("<Q", payload[:8])
        text = codec._ioft_text(payload[8 : 8 + n])
        assert text is not None  # the encoder's layout takes the short road
        assert text == _header(payload)["__metadata__"]["ioft"]


def edited(payload: bytes) -> list[bytes]:
    """Header edits a byte mutator rarely finds: repeats, gaps, overlaps, extra keys, escapes."""
    text = json.dumps(_header(payload), separators=(",", ":"))
    h = _header(payload)
    name = next(k for k in h if k != "__metadata__")
    info = h[name]
    a, b = info["data_offsets"]
    out = [
        text.replace('"dtype"', '"dtype":"F32","dtype"', 1),
        text.replace('"shape"', '"shape":[1],"shape"', 1),
        text.replace('{"__metadata__"', '{"__metadata__":{"ioft":"{}"},"__metadata__"', 1),
        text.replace(f'"{name}"', f'"{name}":{json.dumps(info)},"{name}"', 1),
        text.replace('"dtype"', '"extra":1,"dtype"', 1),
        text.replace('"F32"', '"F16"', 1),
        text.replace('"F32"', '"BF16"', 1),
        text.replace('"F32"', '"I32"', 1),
        text.replace('"F64"', '"F32"', 1),
        text.replace(f"[{a},{b}]", f"[{a + 4},{b + 4}]", 1),
        text.replace(f"[{a},{b}]", f"[{a},{b - 4}]", 1),
        text.replace(f"[{a},{b}]", f"[{b},{a}]", 1),
        text.replace(f"[{a},{b}]", f"[{a},{b},{b}]", 1),
        text.replace(f"[{a},{b}]", f'["{a}",{b}]', 1),
        text.replace(f"[{a},{b}]", f"[{a}.0,{b}]", 1),
        text.replace('"shape":[', '"shape":[0,', 1),
        text.replace('"shape":[', '"shape":[-1,', 1),
        text.replace('"shape":[', '"shape":[true,', 1),
        text.replace('"shape":[', '"shape":[NaN,', 1),
        text.replace(
            '{"__metadata__"', '{"\\ud800":{"dtype":"U8","shape":[],"data_offsets":[0,0]},"__metadata__"', 1
        ),
        text.replace('"ioft"', '"\\ud800"', 1),
        text.replace('"ioft":', '"n":1,"ioft":', 1),
        text.replace('"},"', '","ioft":"{}"},"', 1),
        text.replace('"},"', '","x":"1"},"', 1),
        text.replace('{"__metadata__"', '{"__metadata\\u005f_":{"ioft":"{}"},"__metadata__"', 1),
        text.replace('"},"', '"},"__metadata__":{"ioft":"{}"},"', 1),
        text.replace('"},"', '"},"\\u005f_metadata__":{"ioft":"{}"},"', 1),
        text.replace('{\\"', '{\\"\\t\\\\\\/\\u00e9\\ud83d\\ude00', 1),
        text.replace('{\\"', '{\\"\\ud800', 1),
        text.replace('{\\"', '{\\"\\x', 1),
        text.replace('{\\"', '{\\"\u00e9\x01', 1),
        text.replace('"__metadata__":{', '"__metadata__":{"k":null,', 1),
        " " + text,
        text + "x",
        text + "\x00",
        "\ufeff" + text,
        "[" + text + "]",
        '{"__metadata__":{"ioft":"{}"}}',
    ]
    return [_with_header(payload, t) for t in out if t != text]


def test_hostile_payloads_get_the_same_answer_as_from_the_whole_parse(monkeypatch):
    pool = seeds()
    cases = [misaligned(), *(e for p in pool for e in edited(p))]
    rnd = random.Random(35)
    cases += [mutate(rnd.choice(pool), rnd, pool) for _ in range(3000)]
    for payload in cases:
        assert _answer(payload) == _old_decode(payload, monkeypatch), payload[:300]
