"""Advertised SecAgg keys bound to each device's fleet certificate (Bonawitz et al. §6).

A lying aggregator relays every device's neighbours' keys.  Whatever it substitutes -- a key of
its own, a certificate from another CA, another device's certificate, a tampered signature,
keys signed for another round, its own identity as a neighbour -- the device refuses before it
derives anything from those keys, and answers nothing more in that session.
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from cloud_aggregator.fleet.ca import FleetCA
from cloud_aggregator.fleet.layout import RESERVED
from ioft_protocol.secagg import ClientSecAgg, SecAggConfig, SecAggRefusedError, ServerSecAgg, crypto
from ioft_protocol.secagg.identity import NOT_DEVICES, FleetTrust, KeyBindingError, KeySigner, binding
from ioft_protocol.secagg.messages import AdvertiseKeys, Inbox, NeighbourKeys, Setup
from ioft_protocol.secagg.simulate import run_round
from ioft_protocol.secagg.transport import key_scope
from tests.ioft_protocol.secagg_fixtures import fleet, plain_sum

CFG = SecAggConfig(threshold=0.6)
SCOPE = key_scope("f", "speed", 7, "train")
DEVICES = ["dev-000", "dev-001", "dev-002", "dev-003"]
VICTIM, PEER = "dev-000", "dev-001"


def signer(ca: FleetCA, name: str) -> KeySigner:
    cert, key = ca.issue(name, days=1)
    return KeySigner(
        x509.load_pem_x509_certificate(cert),
        serialization.load_pem_private_key(key, None),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def pki() -> tuple[FleetCA, FleetTrust, dict[str, KeySigner]]:
    ca = FleetCA.create("f", days=1)
    return ca, FleetTrust([ca.cert]), {d: signer(ca, d) for d in [*DEVICES, "aggregator"]}


def clients(pki, **kw) -> dict[str, ClientSecAgg]:
    _, trust, signers = pki
    return {d: ClientSecAgg(d, signer=signers[d], trust=trust, scope=SCOPE, **kw) for d in DEVICES}


def key_exchange(pki, **kw) -> tuple[dict[str, ClientSecAgg], dict[str, NeighbourKeys], ServerSecAgg]:
    """Setup and the advertisements through the wire form; the neighbour keys the server would send."""
    cs = clients(pki, **kw)
    server = ServerSecAgg(CFG, DEVICES, session="s1", length=3, certificates=True)
    for d, req in server.setup().items():
        advert = cs[d].setup(Setup.decode(req.encode()))
        server.receive_keys(d, AdvertiseKeys.decode(advert.encode()))
    return cs, server.close_keys(), server


def forged(keys: NeighbourKeys, who: str, entry: list[bytes]) -> NeighbourKeys:
    return NeighbourKeys({**keys.keys, who: entry})


def refused(client: ClientSecAgg, keys: NeighbourKeys) -> str:
    with pytest.raises(SecAggRefusedError) as err:
        client.share_keys(NeighbourKeys.decode(keys.encode()))
    assert client.stage == "aborted"  # nothing more in this session: no masked input, no unmasking
    with pytest.raises(SecAggRefusedError):
        client.masked_input(Inbox({}), np.zeros(3), 1.0)
    return str(err.value)


def test_a_signed_round_completes_with_the_exact_sum(pki):
    _, trust, signers = pki
    updates, weights = fleet(4, 5)
    make = {d: signers[n] for d, n in zip(sorted(updates), DEVICES, strict=True)}
    run = run_round(
        CFG,
        updates,
        weights,
        make_client=lambda d: ClientSecAgg(d, signer=make[d], trust=trust),
        certificates=True,
    )
    assert run.server.params.signed_keys
    assert all(len(AdvertiseKeys.decode(v).signature) > 0 for v in run.view["keys"].values())
    values, weight = plain_sum(run.server.params, updates, weights, sorted(updates))
    np.testing.assert_allclose(run.outcome.total, values, atol=1e-9)
    assert run.outcome.weight == pytest.approx(weight)


def test_an_honest_relay_is_taken_by_every_device(pki):
    cs, keys, _ = key_exchange(pki)
    for d in DEVICES:
        assert cs[d].share_keys(NeighbourKeys.decode(keys[d].encode())).sealed


@pytest.mark.parametrize("which", [0, 1])  # c_pk: to open the shares sealed to PEER; s_pk: its mask
def test_a_substituted_key_is_refused(pki, which):
    cs, keys, _ = key_exchange(pki)
    entry = list(keys[VICTIM].keys[PEER])
    entry[which] = crypto.KeyPair().public  # the aggregator's own key
    line = refused(cs[VICTIM], forged(keys[VICTIM], PEER, entry))
    assert f"refused the SecAgg keys of {PEER}" in line and "does not verify" in line


def test_a_certificate_from_another_ca_is_refused(pki):
    cs, keys, _ = key_exchange(pki)
    rogue = signer(FleetCA.create("f", days=1), PEER)  # same fleet name, same device name, another CA
    mine = crypto.KeyPair().public
    entry = [mine, mine, rogue.cert_der, rogue.sign(binding(SCOPE, "s1", PEER, mine, mine))]
    line = refused(cs[VICTIM], forged(keys[VICTIM], PEER, entry))
    assert "not issued by the fleet CA" in line


def test_a_certificate_of_another_device_is_refused(pki):
    _, _, signers = pki
    cs, keys, _ = key_exchange(pki)
    colluder = signers["dev-003"]  # a real certificate, but another device's
    mine = crypto.KeyPair().public
    entry = [mine, mine, colluder.cert_der, colluder.sign(binding(SCOPE, "s1", PEER, mine, mine))]
    line = refused(cs[VICTIM], forged(keys[VICTIM], PEER, entry))
    assert f"issued to 'dev-003', not to '{PEER}'" in line


def test_a_tampered_signature_is_refused(pki):
    cs, keys, _ = key_exchange(pki)
    c_pk, s_pk, cert, sig = keys[VICTIM].keys[PEER]
    bad = sig[:-1] + bytes([sig[-1] ^ 1])
    assert "does not verify" in refused(cs[VICTIM], forged(keys[VICTIM], PEER, [c_pk, s_pk, cert, bad]))


def test_unsigned_keys_are_refused_in_a_signed_round(pki):
    cs, keys, _ = key_exchange(pki)
    c_pk, s_pk, _, _ = keys[VICTIM].keys[PEER]
    assert "came unsigned" in refused(cs[VICTIM], forged(keys[VICTIM], PEER, [c_pk, s_pk]))


def test_keys_signed_for_another_round_are_refused(pki):
    """A replay: PEER's genuine advertisement from round 6, relayed in round 7."""
    _, trust, signers = pki
    old = ClientSecAgg(PEER, signer=signers[PEER], trust=trust, scope=key_scope("f", "speed", 6, "train"))
    server = ServerSecAgg(CFG, DEVICES, session="s1", length=3, certificates=True)
    advert = old.setup(server.setup()[PEER])
    cs, keys, _ = key_exchange(pki)
    entry = [advert.c_pk, advert.s_pk, advert.cert, advert.signature]
    assert "does not verify" in refused(cs[VICTIM], forged(keys[VICTIM], PEER, entry))


def test_the_aggregators_own_certificate_is_no_neighbour(pki):
    """A Sybil: the aggregator names itself a neighbour and signs keys with its own certificate."""
    _, trust, signers = pki
    me = ClientSecAgg(VICTIM, signer=signers[VICTIM], trust=trust, scope=SCOPE)
    p = CFG.round_params(4, 3, certificates=True).to_json()
    me.setup(Setup("s1", p, ["aggregator", PEER, "dev-002"]))
    agg = signers["aggregator"]
    mine = crypto.KeyPair().public
    sybil = [mine, mine, agg.cert_der, agg.sign(binding(SCOPE, "s1", "aggregator", mine, mine))]
    line = refused(me, NeighbourKeys({"aggregator": sybil}))
    assert "is the aggregator's identity" in line


def test_a_device_without_a_certificate_refuses_a_signed_round(pki):
    alone = ClientSecAgg(VICTIM, scope=SCOPE)
    p = CFG.round_params(4, 3, certificates=True).to_json()
    with pytest.raises(SecAggRefusedError) as err:
        alone.setup(Setup("s1", p, DEVICES))
    assert all(noun in str(err.value) for noun in ("signed SecAgg keys", "certificate")), err.value


def test_the_devices_own_floor_demands_signatures_whatever_the_task_says(pki):
    """The aggregator sets signed_keys = false; a device holding a certificate checks anyway."""
    cs = clients(pki, require_signed=True)
    server = ServerSecAgg(SecAggConfig(threshold=0.6, signed_keys=False), DEVICES, session="s1", length=3)
    assert not server.params.signed_keys
    for d, req in server.setup().items():
        server.receive_keys(d, cs[d].setup(req))
    keys = server.close_keys()
    c_pk, s_pk, _, _ = keys[VICTIM].keys[PEER]
    assert "came unsigned" in refused(cs[VICTIM], forged(keys[VICTIM], PEER, [c_pk, s_pk]))


def test_signed_keys_follow_the_fleets_login_unless_the_task_says():
    assert CFG.round_params(4, 3, certificates=True).signed_keys
    assert not CFG.round_params(4, 3, certificates=False).signed_keys
    assert not SecAggConfig(signed_keys=False).round_params(4, 3, certificates=True).signed_keys
    assert SecAggConfig(signed_keys=True).round_params(4, 3).signed_keys
    assert "signed_keys" not in CFG.to_json()  # specs stored before the setting stay as they were
    assert SecAggConfig.from_json({"signed_keys": False}).signed_keys is False
    with pytest.raises(ValueError, match="signed_keys 'yes' must be true or false"):
        SecAggConfig(signed_keys="yes")  # type: ignore[arg-type]


def test_an_expired_certificate_is_refused(pki):
    _, trust, signers = pki
    s = signers[PEER]
    msg = binding(SCOPE, "s1", PEER, b"a" * 32, b"b" * 32)
    trust.check(PEER, msg, s.cert_der, s.sign(msg))
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    with pytest.raises(KeyBindingError, match="not now"):
        trust.check(PEER, msg, s.cert_der, s.sign(msg), now=later)


def test_the_reserved_names_match_the_fleet_layouts():
    assert set(RESERVED) == NOT_DEVICES
