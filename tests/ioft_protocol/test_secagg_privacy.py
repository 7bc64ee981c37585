"""What the aggregator can learn: its whole view reveals no single update, even when it lies.

The view is every payload a device sent (``run.view``).  Each test tries a reconstruction
an aggregator would try and shows it gives nothing like the device's update: the guess
matches the device's fixed-point vector at about 2^-32 of the coordinates (chance) and is
uncorrelated with it.
"""

from __future__ import annotations

import numpy as np
import pytest

from ioft_protocol.secagg import (
    ClientSecAgg,
    SecAggConfig,
    SecAggRefusedError,
    ServerSecAgg,
    quantize,
    shamir,
)
from ioft_protocol.secagg.client import pair_sign, pairwise_mask
from ioft_protocol.secagg.crypto import KeyPair, open_sealed
from ioft_protocol.secagg.messages import AdvertiseKeys, Inbox, MaskedInput, Setup, ShareKeys, UnmaskRequest
from ioft_protocol.secagg.simulate import run_round
from tests.ioft_protocol.secagg_fixtures import fleet, rebuilds

CFG = SecAggConfig(threshold=0.6, clip=1.0, bits=16, max_weight=64.0)
LENGTH = 2000


def _reveals(guess: np.ndarray, run, device: str, updates, weights) -> bool:
    """Does ``guess`` (a ring vector) give away ``device``'s encoded update?"""
    p = run.server.params
    truth = quantize.encode(p, updates[device], weights[device])
    guess = quantize.reduce(p, guess)
    values, _ = quantize.decode_sum(p, guess)
    same = np.mean(guess == truth)
    corr = abs(np.corrcoef(values, np.clip(updates[device], -1, 1))[0, 1])
    return same > 0.01 or corr > 0.1


def _masked(run, device) -> np.ndarray:
    return quantize.unpack(run.server.params, MaskedInput.decode(run.view["masked"][device]).y, LENGTH + 1)


@pytest.fixture(scope="module")
def honest():
    updates, weights = fleet(10, LENGTH, seed=11)
    run = run_round(CFG, updates, weights, drop={"masked": {"dev-009"}})
    return run, updates, weights


def test_the_reconstruction_check_itself_catches_a_leak(honest):
    run, updates, weights = honest
    leak = quantize.encode(run.server.params, updates["dev-000"], weights["dev-000"])
    assert _reveals(leak, run, "dev-000", updates, weights)


def test_no_masked_input_alone_or_in_differences_reveals_an_update(honest):
    run, updates, weights = honest
    devices = sorted(run.view["masked"])
    for d in devices:
        assert not _reveals(_masked(run, d), run, d, updates, weights)
    for a in devices:
        for b in devices:
            if a != b:  # y_a - y_b: the pairwise masks do not cancel, the self-masks neither
                assert not _reveals(_masked(run, a) - _masked(run, b), run, a, updates, weights)


def test_the_unmasked_sum_minus_the_other_masked_inputs_leaves_each_hidden(honest):
    run, updates, weights = honest
    p, devices = run.server.params, sorted(run.view["masked"])
    sum_ring = np.zeros(LENGTH + 1, dtype=quantize.RING_DTYPE)  # the survivors' sum, which the server learns
    for d in devices:
        sum_ring += quantize.encode(p, updates[d], weights[d])
    for d in devices:
        guess = sum_ring.copy()
        for other in devices:
            if other != d:
                guess -= _masked(run, other)
        assert not _reveals(guess, run, d, updates, weights)


def test_the_unmasked_sum_is_all_the_view_gives(honest):
    run, updates, weights = honest
    # the server rebuilt each survivor's self mask and the dropped device's mask key; remove
    # one survivor's self mask from its input: its pairwise masks still hide it
    srv, d = run.server, "dev-000"
    b = shamir.combine(
        [a.b_shares[d] for a in srv._answers.values() if d in a.b_shares][: srv.params.threshold]
    )
    p = srv.params
    guess = _masked(run, d) - quantize.prg(p, b, LENGTH + 1)
    assert not _reveals(guess, run, d, updates, weights)


def test_sealed_shares_do_not_open_without_the_recipients_key(honest):
    run, _, _ = honest
    stranger = KeyPair()
    for d, wire in run.view["shares"].items():
        for v, ct in ShareKeys.decode(wire).sealed.items():
            sender_pk = AdvertiseKeys.decode(run.view["keys"][d]).c_pk
            guess_key = stranger.agree(sender_pk, salt=b"r1", info=b"ioft-secagg share key")
            assert open_sealed(guess_key, ct, f"r1\x00{d}\x00{v}".encode()) is None


def test_a_server_that_says_a_live_device_dropped_still_cannot_unmask_it():
    updates, weights = fleet(8, LENGTH, seed=12)
    run = run_round(CFG, updates, weights, drop={"unmask": set(updates)})  # stop before unmasking
    srv, clients, victim = run.server, run.clients, "dev-004"
    p = srv.params
    # the lie, told to every other device: the victim uploaded nothing
    answers = {}
    for d in sorted(srv.neighbours[victim]):
        c = clients[d]
        survivors = sorted((srv.neighbours[d] | {d}) - {victim})
        answers[d] = c.unmask(UnmaskRequest(survivors=survivors, dropped=[victim]))
    s_sk = shamir.combine([a.s_shares[victim] for a in answers.values()][: p.threshold])
    keys = KeyPair(s_sk)
    assert keys.public == AdvertiseKeys.decode(run.view["keys"][victim]).s_pk  # the lie got the mask key
    guess = _masked(run, victim).copy()
    for u in srv.neighbours[victim]:
        m = pairwise_mask(keys, AdvertiseKeys.decode(run.view["keys"][u]).s_pk, "r1", p, LENGTH + 1)
        guess = guess - m if pair_sign(victim, u) > 0 else guess + m
    assert not _reveals(guess, run, victim, updates, weights)  # the self mask still hides it
    # and no device gives the victim's self-mask share any more: each answers once
    h = min(srv.neighbours[victim])
    with pytest.raises(SecAggRefusedError, match="stage"):
        clients[h].unmask(UnmaskRequest(survivors=sorted(srv.neighbours[h] | {h}), dropped=[]))


def test_a_server_that_splits_its_story_collects_threshold_shares_of_at_most_one_seed():
    updates, weights = fleet(9, 50, seed=13)
    run = run_round(CFG, updates, weights, drop={"unmask": set(updates)})
    srv, clients, victim = run.server, run.clients, "dev-002"
    holders = sorted(srv.neighbours[victim])  # the victim itself would refuse either story
    b_shares, s_shares = [], []
    for i, h in enumerate(holders):
        others = sorted((srv.neighbours[h] | {h}) - {victim})
        told_alive = i % 2 == 0
        req = UnmaskRequest(
            survivors=sorted([*others, victim]) if told_alive else others,
            dropped=[] if told_alive else [victim],
        )
        ans = clients[h].unmask(req)
        (b_shares if told_alive else s_shares).extend(
            [ans.b_shares[victim]] if told_alive else [ans.s_shares[victim]]
        )
    t = srv.params.threshold
    assert len(b_shares) + len(s_shares) == len(holders) < 2 * t  # threshold > half the holders
    assert min(len(b_shares), len(s_shares)) < t
    short, which = (b_shares, "b") if len(b_shares) < t else (s_shares, "s")
    real = clients[victim]._b if which == "b" else clients[victim]._s.secret
    assert not rebuilds(short, real)


def test_devices_refuse_contradictory_or_impossible_unmask_requests():
    updates, weights = fleet(6, 10, seed=14)
    run = run_round(CFG, updates, weights, drop={"unmask": set(updates)})
    c, nb = run.clients["dev-001"], sorted(run.server.neighbours["dev-001"])
    bad = [
        (UnmaskRequest(survivors=["dev-001", *nb], dropped=[nb[0]]), "both survived and dropped"),
        (UnmaskRequest(survivors=nb, dropped=["dev-001"]), "told it dropped"),
        (UnmaskRequest(survivors=["dev-001", "dev-999"], dropped=[]), "shared no keys"),
        (UnmaskRequest(survivors=["dev-001", nb[0]], dropped=nb[1:]), "fewer than the threshold"),
    ]
    for req, why in bad:
        with pytest.raises(SecAggRefusedError, match=why):
            c.unmask(req)
        c.stage = "masked"  # test only: rewind so the next bad request reaches the same checks


def test_a_device_refuses_to_upload_when_the_server_withholds_its_neighbours_shares():
    # Withheld shares mean few pairwise masks: the self mask alone, rebuilt from honest
    # neighbours' shares, would then reveal the device.  It uploads nothing instead.
    updates, _ = fleet(6, 10, seed=15)
    srv = ServerSecAgg(CFG, sorted(updates), session="r1", length=10)
    clients = {d: ClientSecAgg(d) for d in updates}
    for d, m in srv.setup().items():
        srv.receive_keys(d, clients[d].setup(m))
    for d, m in srv.close_keys().items():
        srv.receive_shares(d, clients[d].share_keys(m))
    inbox = srv.close_shares()["dev-000"]
    few = Inbox(dict(list(inbox.sealed.items())[: srv.params.threshold - 2]))
    with pytest.raises(SecAggRefusedError, match="threshold"):
        clients["dev-000"].masked_input(few, updates["dev-000"], 1.0)


def test_a_device_refuses_a_threshold_at_or_below_half_its_share_holders():
    p = CFG.round_params(6, 10)
    low = Setup("r1", {**p.to_json(), "threshold": 3}, [f"dev-00{i}" for i in range(1, 6)])  # 3 of 6
    with pytest.raises(SecAggRefusedError, match="above half"):
        ClientSecAgg("dev-000").setup(low)
