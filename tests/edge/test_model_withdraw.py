"""A withdrawn version (a stopped staged rollout): the device goes back to the version it ran before.

Real ONNX files, real onnxruntime, the broker's retained store faked as in test_model_manager.
"""

from __future__ import annotations

import json
from dataclasses import replace

from cloud_aggregator.models.push import push_messages
from export.keys import sign
from export.synthetic import signed, window_encoder
from ioft_protocol import model_push
from tests.edge import test_model_manager as manager_tests
from tests.edge.test_model_manager import CHUNK, FLEET, Retained, last_reason, make_manager, offer_and_fetch

keys, holdout = manager_tests.keys, manager_tests.holdout  # the same module-scoped fixtures


def _restore(v1_offer: bytes, *withdrawn: int, key=None) -> bytes:
    """v1's offer again, withdrawing ``withdrawn``: signed with ``key`` (the operator's rollback),
    or, without one, unsigned (what a holder of the broker's credential alone can forge)."""
    offer = model_push.ModelOffer.decode(v1_offer)
    signature = "" if key is None else sign(model_push.withdrawal_text(offer.name, withdrawn), key)
    return replace(offer, withdrawn=withdrawn, withdrawal_signature=signature).encode()


def test_a_withdrawn_version_rolls_back_to_the_previous_and_is_never_fetched_again(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained, rollback_margin=1.0)
    v1 = signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    v1_offer = push_messages(FLEET, v1, chunk_size=CHUNK)[0][1]
    offer_and_fetch(mgr, retained, v1)
    good = mgr.status()["enc"]["metric"]
    # A worse version the device's own margin lets through (the rollout's margin is the judge).
    worse = signed(window_encoder(tmp_path / "b.onnx", kind="mean"), tmp_path / "p2", key, version=2)
    v2_offer = retained.publish_all(push_messages(FLEET, worse, chunk_size=CHUNK, devices=["printer7"]))
    mgr.handle_offer("enc", v2_offer)
    retained.pump(mgr)
    status = mgr.status()["enc"]
    assert (status["active"], status["previous"], status["previous_metric"]) == (2, 1, good)
    assert status["metric"] < good

    assert mgr.handle_offer("enc", _restore(v1_offer, 2, key=key))
    status = mgr.status()["enc"]
    assert (status["active"], status["previous"], status["metric"]) == (1, None, good)
    assert "withdrawn" in last_reason(mgr) and "rolled back to v1" in last_reason(mgr)
    assert mgr.active("enc").version == 1
    assert json.loads((tmp_path / "models" / "enc" / "active.json").read_text())["version"] == 1
    assert not (tmp_path / "models" / "enc" / "v2.onnx").exists()
    assert mgr.handle_offer("enc", v2_offer) is False  # refused under its digest: not fetched again
    assert mgr.status()["enc"]["active"] == 1


def test_a_withdrawal_never_installs_and_stops_a_transfer_of_the_withdrawn_version(tmp_path, keys, holdout):
    key = keys[0]
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    v1 = signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    v1_offer = push_messages(FLEET, v1, chunk_size=CHUNK)[0][1]
    offer_and_fetch(mgr, retained, v1)
    v2 = signed(window_encoder(tmp_path / "b.onnx", pad_bytes=40_000), tmp_path / "p2", key, version=2)
    mgr.handle_offer("enc", retained.publish_all(push_messages(FLEET, v2, chunk_size=CHUNK)))
    retained.pump(mgr, limit=retained.delivered + 2)  # part-way through
    assert mgr.status()["enc"]["transfer"]["version"] == 2
    assert mgr.handle_offer("enc", _restore(v1_offer, 2, key=key))
    status = mgr.status()["enc"]
    assert "transfer" not in status and status["active"] == 1
    assert "before it was installed" in last_reason(mgr)
    assert not list((tmp_path / "models" / "enc" / "incoming").glob("*.part"))

    # A device without the offer's version as its previous keeps serving what it runs.
    fresh = Retained()
    other = make_manager(tmp_path / "other", keys, holdout, fresh)
    offer_and_fetch(other, fresh, v2)
    assert other.status()["enc"]["active"] == 2
    other.handle_offer("enc", _restore(v1_offer, 2, key=key))
    assert other.status()["enc"]["active"] == 2


def test_a_withdrawal_not_signed_by_the_fleet_key_is_refused(tmp_path, keys, holdout, caplog):
    """The genuinely signed v1 offer with an unsigned ``withdrawn = [2]`` (or one signed by another
    key) rolls nothing back: the offer is refused, logged, and v2 keeps serving."""
    key, _, other_key = keys
    retained = Retained()
    mgr = make_manager(tmp_path / "models", keys, holdout, retained)
    v1 = signed(window_encoder(tmp_path / "a.onnx"), tmp_path / "p1", key, version=1)
    v1_offer = push_messages(FLEET, v1, chunk_size=CHUNK)[0][1]
    offer_and_fetch(mgr, retained, v1)
    v2 = signed(window_encoder(tmp_path / "b.onnx", pad_bytes=8), tmp_path / "p2", key, version=2)
    offer_and_fetch(mgr, retained, v2)
    assert mgr.status()["enc"]["active"] == 2
    for forged in (_restore(v1_offer, 2), _restore(v1_offer, 2, key=other_key)):
        with caplog.at_level("WARNING", logger="edge.models"):
            assert mgr.handle_offer("enc", forged)  # refused: reported in the status
        assert "withdrawal of enc v[2]" in caplog.text and "offer refused" in last_reason(mgr)
        assert mgr.status()["enc"]["active"] == 2
        assert mgr.active("enc").version == 2
    # The signature covers the versions: the operator's withdrawal of v3 cannot take back v2.
    assert mgr.handle_offer("enc", _restore(v1_offer, 3, key=key).replace(b"[3]", b"[2]")) is True
    assert "does not verify" in last_reason(mgr) and mgr.status()["enc"]["active"] == 2
