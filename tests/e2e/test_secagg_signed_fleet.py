"""Signed SecAgg keys on a `fleet init` certificate fleet: mosquitto from the generated config,
three `edge-trainer` processes from their device folders, `serve` with the aggregator's certificate.

The honest aggregator completes SecAgg rounds with every device's keys signed and checked.  A
lying one (``tests/e2e/secagg_liar.py``: the real ``serve`` that swaps a neighbour's key for its
own when it relays them) gets nothing: every device refuses the substituted key in one log line
naming that neighbour and shares nothing, so the round is abandoned at the shares stage.  Before
the signatures, the devices sealed their shares to the liar's key and the round died later,
at the masked inputs.  A liar that re-sends a session id it already ran up to the masked inputs
(``IOFT_LIAR=rekey``) gets no second masked input: each device refuses the repeat in one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cloud_aggregator.fleet.init import AGGREGATOR
from cloud_aggregator.local.fleet import LocalFleet, aggregator_toml
from cloud_aggregator.rounds.secagg import ABANDONED
from cloud_aggregator.store.sqlite import SqliteStore
from tests.conftest import tls_fleet_broker
from tests.e2e.test_secagg_fleet import TASK

pytestmark = pytest.mark.broker
DEVICES = ("printer1", "printer2", "printer3")
HONEST = {**TASK, "name": "speed", "rounds": 2, "devices": {"ids": list(DEVICES)}}
FORGED = {**TASK, "name": "forged", "rounds": 1, "devices": {"ids": list(DEVICES)}}
REKEYED = {**TASK, "name": "rekeyed", "rounds": 1, "devices": {"ids": list(DEVICES)}}


@pytest.fixture(scope="module")
def signed_fleet(tmp_path_factory) -> Iterator[tuple[LocalFleet, str]]:
    """The fleet's devices running (certificates from `fleet init`); yields them and the aggregator's
    TOML connection lines."""
    root = tmp_path_factory.mktemp("secagg-signed")
    for layout, broker in tls_fleet_broker(root, DEVICES):
        procs = LocalFleet(root / "run", broker.url, allow_plaintext=False)
        procs.work.mkdir()
        try:
            for d in DEVICES:
                procs.start_device(d, "--config", str(layout.toml(d)))
            tls = (
                f'tls = {{ ca_file = "{layout.ca_cert}", cert_file = "{layout.cert(AGGREGATOR)}", '
                f'key_file = "{layout.key(AGGREGATOR)}" }}'
            )
            yield procs, tls
        finally:
            procs.stop_all()


def _toml(procs: LocalFleet, tls: str, state: str, task: dict) -> str:
    return aggregator_toml(
        procs.broker_url,
        procs.work / state,
        [task],
        expected=list(DEVICES),
        min_participants=len(DEVICES),
        connection=[f'client_id = "{AGGREGATOR}"', tls],
    )


def _records(procs: LocalFleet, state: str, task: str):
    store = SqliteStore(procs.work / state / "aggregator.sqlite", readonly=True)
    try:
        return store.rounds(task)
    finally:
        store.close()


def test_secagg_rounds_complete_with_signed_keys(signed_fleet):
    procs, tls = signed_fleet
    procs.start_aggregator(_toml(procs, tls, "aggregator", HONEST))
    assert procs.wait_aggregator(150) == 0, procs.log("aggregator")
    records = _records(procs, "aggregator", "speed")
    assert [r.round for r in records] == [1, 2]
    assert all(r.status == "completed" and sorted(r.participants) == list(DEVICES) for r in records)
    for d in DEVICES:
        log = procs.log(d)
        others = ", ".join(x for x in DEVICES if x != d)
        for r in (1, 2):  # each device checked both neighbours' certificates and signatures, each round
            assert f"{d}: task speed round {r}: SecAgg keys of {others} signed by their fleet" in log, log
        assert "refused" not in log, log


def _liar(procs: LocalFleet, tls: str, state: str, task: dict, lie: str) -> None:
    """``serve`` as the liar (``tests/e2e/secagg_liar.py``) telling ``lie``, until its task ends."""
    cfg = procs.work / f"{state}.toml"
    cfg.write_text(_toml(procs, tls, state, task))
    with (procs.work / f"{state}.log").open("ab") as out:
        procs.aggregator = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.secagg_liar", "serve", "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "IOFT_LIAR": lie},
        )
    assert procs.wait_aggregator(150) == 0, procs.log(state)


def test_a_substituted_key_makes_every_device_abort_the_round(signed_fleet):
    procs, tls = signed_fleet
    _liar(procs, tls, "liar", FORGED, "swap")
    (record,) = _records(procs, "liar", "forged")
    assert record.status == "abandoned" and record.participants == []
    # nobody shared: before the signatures, all three sealed their shares to the liar's key
    assert record.rejected == dict.fromkeys(DEVICES, f"{ABANDONED}: too_few_shares"), record.rejected
    for d in DEVICES:
        lines = [line for line in procs.log(d).splitlines() if "task forged" in line and "refused" in line]
        assert len(lines) == 1, lines  # one line, naming the neighbour whose key was swapped
        assert re.search(
            r"refused the SecAgg keys of printer\d: the signature over its keys does not verify", lines[0]
        )


def test_a_resent_session_id_gets_no_second_masked_input(signed_fleet):
    procs, tls = signed_fleet
    _liar(procs, tls, "rekey", REKEYED, "rekey")
    liar = procs.log("rekey")
    assert "liar pass 1: 3 masked inputs" in liar, liar
    # before: every device re-keyed and masked its update again, and the second pass completed
    assert "liar pass 2: 0 masked inputs" in liar, liar
    (record,) = _records(procs, "rekey", "rekeyed")
    assert record.status == "abandoned" and record.participants == [], record
    for d in DEVICES:
        lines = [line for line in procs.log(d).splitlines() if "task rekeyed" in line and "refused" in line]
        assert len(lines) == 1, lines
        assert "it answered that session already" in lines[0], lines
