"""``edge.model_transfer.Transfer``: the window, and the file's sha256 computed once per byte whatever the
order the chunks land in (out of order, or partly on disk after a restart), with no re-read of the file."""

from __future__ import annotations

import hashlib

import pytest

from cloud_aggregator.push import push_messages
from edge import model_transfer
from export.keys import generate_keypair, load_private_key
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push
from ioft_protocol.manifest import load_public_key, verify_manifest

CHUNK = 4096


@pytest.fixture
def push(tmp_path):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    pkg = signed(
        window_encoder(tmp_path / "a.onnx", pad_bytes=50_000), tmp_path / "pkg", load_private_key(priv)
    )
    messages = push_messages("plant", pkg, chunk_size=CHUNK)
    offer = model_push.ModelOffer.decode(messages[0][1])
    manifest = verify_manifest(offer.manifest, offer.signature, load_public_key(pub))
    chunks = [model_push.ModelChunk.decode(p, max_bytes=CHUNK) for _, p in messages[1:]]
    return offer, manifest, chunks, pkg.onnx_path.read_bytes()


@pytest.fixture
def no_reread(monkeypatch):
    def reread(path):
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(model_transfer, "file_sha256", reread)


def test_the_window_bounds_the_chunks_in_flight_and_none_is_asked_twice(tmp_path, push):
    offer, manifest, chunks, _ = push
    t = model_transfer.Transfer.open(tmp_path / "x.part", offer, manifest, "d", 0.0)
    assert t.to_request(4) == [0, 1, 2, 3] and t.to_request(4) == []
    assert t.accept(chunks[2], 1.0)
    assert t.to_request(4) == [4]
    asked = [0, 1, 2, 3, 4]
    while not t.complete:
        i = min(t.inflight)
        assert t.accept(chunks[i], 2.0)
        asked += t.to_request(4)
        assert len(t.inflight) <= 4
    assert sorted(asked) == list(range(len(chunks)))  # each chunk asked for once
    t.close()


@pytest.mark.parametrize("order", ["reversed", "odd-first"])
def test_chunks_out_of_order_hash_the_file_once_without_reading_it_back(tmp_path, push, no_reread, order):
    offer, manifest, chunks, data = push
    t = model_transfer.Transfer.open(tmp_path / "x.part", offer, manifest, "d", 0.0)
    idx = list(range(len(chunks)))
    for i in reversed(idx) if order == "reversed" else idx[1::2] + idx[::2]:
        assert t.accept(chunks[i], 1.0)
    assert t.finish() == (len(data), hashlib.sha256(data).hexdigest())


def test_a_resumed_transfer_hashes_the_chunks_on_disk_into_the_file_sha256(tmp_path, push, no_reread):
    offer, manifest, chunks, data = push
    part = tmp_path / "x.part"
    t = model_transfer.Transfer.open(part, offer, manifest, "d", 0.0)
    for i in (0, 1, 2, 5, 7):
        t.accept(chunks[i], 1.0)
    t.close()  # the device stops here
    t = model_transfer.Transfer.open(part, offer, manifest, "d", 2.0)
    assert t.resumed == 5 and t.have == {0, 1, 2, 5, 7}
    assert t.to_request(3) == [3, 4, 6]
    while not t.complete:
        i = min(set(range(len(chunks))) - t.have)
        t.accept(chunks[i], 3.0)
    assert t.finish() == (len(data), hashlib.sha256(data).hexdigest())
