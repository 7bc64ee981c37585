"""``edge.models.transfer.Transfer``: the window, and the file's sha256 computed once per byte whatever the
order the chunks land in (out of order, or partly on disk after a restart), with no re-read of the file."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from cloud_aggregator.models.push import push_messages
from edge.models import transfer as model_transfer
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


_SHA256 = hashlib.sha256


class CountingSha256:
    """hashlib.sha256 that adds up the bytes it is fed, in every instance."""

    fed = 0

    def __init__(self, data: bytes = b"") -> None:
        self._h = _SHA256()
        self.update(data)

    def update(self, data) -> None:
        CountingSha256.fed += memoryview(data).nbytes
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_the_device_path_hashes_each_byte_once_and_keeps_chunks_as_views_of_their_payload(
    tmp_path, monkeypatch
):
    priv, pub = generate_keypair(tmp_path / "keys" / "fleet.key")
    pkg = signed(
        window_encoder(tmp_path / "a.onnx", pad_bytes=50_000), tmp_path / "pkg", load_private_key(priv)
    )
    messages = push_messages("plant", pkg, chunk_size=CHUNK)
    offer = model_push.ModelOffer.decode(messages[0][1])
    manifest = verify_manifest(offer.manifest, offer.signature, load_public_key(pub))
    monkeypatch.setattr(hashlib, "sha256", CountingSha256)
    t = model_transfer.Transfer.open(tmp_path / "x.part", offer, manifest, "d", 0.0)
    CountingSha256.fed = 0
    order = [*range(1, len(messages) - 1), 0]  # the first chunk last: all but it come early
    for i in order:
        payload = messages[1 + i][1]
        chunk = model_push.ModelChunk.decode(payload, max_bytes=CHUNK, verify=False)
        assert isinstance(chunk.data, memoryview) and chunk.data.obj is payload  # no copy
        assert t.accept(chunk, 1.0)
    size, digest = t.finish()
    assert (size, digest) == (manifest.size, manifest.sha256)
    assert CountingSha256.fed == manifest.size  # one pass over the file, nothing else hashed


def test_bytes_altered_under_a_chunks_claimed_hash_fail_the_file_hash_and_are_named(tmp_path, push):
    offer, manifest, chunks, data = push
    t = model_transfer.Transfer.open(tmp_path / "x.part", offer, manifest, "d", 0.0)
    for i, c in enumerate(chunks):
        bad = bytes([c.data[0] ^ 1]) + bytes(c.data[1:])
        t.accept(replace(c, data=bad) if i == 3 else c, 1.0)  # claims the table's hash
    size, digest = t.finish()
    assert size == len(data) and digest != manifest.sha256
    assert t.altered() == [3]
