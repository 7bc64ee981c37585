"""Admission's short roads give the answers of the long ones: the change norm stands in for the look
at every value only where it is finite, an update's fields are read in one look only where each is
of its type; an upload's fingerprint matches its copies and tells other answers apart."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, fingerprint
from cloud_aggregator.rounds.types import Reason, Refusal
from ioft_protocol import codec, round_messages
from tests.cloud_aggregator.test_admission import FLEET, TASK, request


def two_tensors() -> dict[str, np.ndarray]:
    return {"a": np.linspace(-1, 1, 8, dtype=np.float64), "b": np.zeros(3, np.float64)}


def judged(params, g=None) -> Update | Refusal:
    g = two_tensors() if g is None else g
    req = request(1, g)
    msg = round_messages.UpdateMessage(FLEET, TASK, "d0", 1, "train", 10, req.global_hash, {}, params)
    return Admission(FLEET).judge("d0", msg.encode(), req)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_is_refused_in_the_words_of_the_tensor_check(bad):
    params = two_tensors()
    params["b"] = params["b"].copy()
    params["b"][1] = bad
    params["a"] = params["a"] + 0.01
    verdict = judged(params)
    assert verdict == Refusal(Reason.NON_FINITE, "tensor 'b' holds NaN or Inf")
    # ... even where what was sent holds one too (the norm is not finite either way)
    g = two_tensors()
    g["a"] = g["a"].copy()
    g["a"][0] = np.inf
    assert judged(params, g) == Refusal(Reason.NON_FINITE, "tensor 'b' holds NaN or Inf")


def test_finite_values_whose_squared_change_overflows_are_not_called_non_finite():
    params = two_tensors()
    params["a"] = np.full(8, 1e200)  # finite; (1e200)² is not a float64
    verdict = judged(params)
    assert isinstance(verdict, Update)  # no bound, no reference yet: admitted, as before
    g = two_tensors()
    adm = Admission(FLEET)
    req = request(1, g)
    msg = round_messages.UpdateMessage(FLEET, TASK, "d0", 1, "train", 10, req.global_hash, {}, params)
    adm.judge("d0", msg.encode(), req)
    assert adm.norms._norms == {}  # an infinite norm never joins the reference


def _slow(meta, tensors):
    """The field-by-field reading (``_plain`` stepped aside)."""
    try:
        original = round_messages.UpdateMessage._plain
        round_messages.UpdateMessage._plain = classmethod(lambda cls, meta, tensors: None)
        return _decoded(meta, tensors)
    finally:
        round_messages.UpdateMessage._plain = original


def _decoded(meta, tensors):
    payload = codec.encode("update", meta, tensors)
    try:
        return round_messages.UpdateMessage.decode(payload)
    except codec.WireError as exc:
        return str(exc)


def test_update_fields_read_in_one_look_are_those_read_one_by_one():
    tensors = {"w": np.ones(4, np.float32)}
    good = {
        "fleet": "f",
        "task": "t",
        "device": "d1",
        "round": 3,
        "phase": "train",
        "n_samples": 10,
        "global_hash": "g" * 64,
        "metrics": {"loss": 0.5, "acc": 1.0},
    }
    variants = [
        good,
        {**good, "metrics": {"loss": 1}},  # an int metric: made a float
        {**good, "metrics": {"loss": True}},
        {**good, "metrics": {"loss": float("nan")}},
        {**good, "metrics": []},
        {**good, "round": True},
        {**good, "round": 2.0},
        {**good, "n_samples": -1},
        {**good, "n_samples": False},
        {**good, "device": "D1"},
        {**good, "fleet": "F", "device": "D1"},
        {**good, "phase": 1},
        {**good, "global_hash": None},
        {**good, "compress": {"bits": 8}},
        {**good, "compress": "8"},
        {k: v for k, v in good.items() if k != "task"},
    ]
    for meta in variants:
        fast, slow = _decoded(meta, tensors), _slow(meta, tensors)
        if isinstance(slow, str):
            assert fast == slow
            continue
        assert fast.params.keys() == slow.params.keys()
        for f in (
            "fleet",
            "task",
            "device",
            "round",
            "phase",
            "n_samples",
            "global_hash",
            "metrics",
            "compress",
        ):
            assert getattr(fast, f) == getattr(slow, f) or (
                f == "metrics" and str(fast.metrics) == str(slow.metrics)
            )
            assert type(getattr(fast, f)) is type(getattr(slow, f))
        assert all(type(v) is float for v in fast.metrics.values())


def test_fingerprints_match_copies_and_tell_other_answers_apart():
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((30, 70)).astype(np.float32),
        "b": rng.standard_normal(5),
        "s": np.full((1, 1), 2.0),
    }
    msg = round_messages.UpdateMessage(FLEET, TASK, "d0", 1, "train", 10, "g" * 64, {"loss": 0.5}, params)
    copy = round_messages.UpdateMessage.decode(msg.encode())  # across the wire (and the store)
    assert fingerprint(copy) == fingerprint(msg) == fingerprint(dataclasses.replace(msg, params=dict(params)))
    w = params["w"].copy()
    w[0, 0] += 1.0  # a sampled value
    others = [
        dataclasses.replace(msg, n_samples=11),
        dataclasses.replace(msg, global_hash="h" * 64),
        dataclasses.replace(msg, metrics={"loss": 0.25}),
        dataclasses.replace(msg, metrics={"loss": 0.5, "acc": 1.0}),
        dataclasses.replace(msg, params={**params, "w": w}),
        dataclasses.replace(msg, params={**params, "w": params["w"].reshape(70, 30)}),
        dataclasses.replace(msg, params={**params, "b": params["b"].astype(np.float32)}),
        dataclasses.replace(msg, params={k: v for k, v in params.items() if k != "s"}),
    ]
    prints = {fingerprint(m) for m in others}
    assert len(prints) == len(others) and fingerprint(msg) not in prints
