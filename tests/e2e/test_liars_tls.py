"""Issue 32 §1 and §2 with the attacker the issue names, "one device's certificate", on a ``fleet
init`` TLS fleet: mosquitto on the config and ACL it writes, ``serve`` with the aggregator's
certificate, ``edge-trainer`` processes from their device folders, and a raw client holding the
liar's certificate, publishing through the ACL as that device.  The plaintext tests
(``test_weight_cap_mqtt``, ``test_fleet_scaling_mqtt``) show the same with raw identities."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from cloud_aggregator.fleet.init import AGGREGATOR, FleetLayout
from cloud_aggregator.local.broker import BrokerProcess
from cloud_aggregator.local.fleet import FLEET, LocalFleet, aggregator_toml, pflda_task
from cloud_aggregator.serve.fleet_scaling import SAY_EVERY_S
from edge.segments import DatasetReader
from ioft_protocol import topics
from ioft_protocol.feature_stats import FeatureStats, FleetScaling
from tests.conftest import tls_fleet_broker
from tests.e2e.test_access import _connected
from tests.e2e.test_fleet_scaling_mqtt import TASK as WELD_TASK
from tests.e2e.test_serving import record
from tests.e2e.test_weight_cap_mqtt import CLAIM, LIAR, Claimer

pytestmark = pytest.mark.broker
PRINTERS = ("printer1", "printer2", "printer3")
WELDERS = ("w1", "w2", "w3")
WELD_LIAR = "w4"
#: A round closes once every expected device answered: its deadline only bounds a hang, so it outlasts
#: the test (pytest's timeout is 300 s).  At 60 s a starved box (load 4-8) abandoned a round.
DEADLINE_S = 600
#: How long ``serve`` may run before the test fails with its log (inside pytest's timeout).
SERVE_WAIT_S = 270


@pytest.fixture(scope="module")
def tls_fleet(tmp_path_factory) -> Iterator[tuple[FleetLayout, BrokerProcess]]:
    yield from tls_fleet_broker(tmp_path_factory.mktemp("liars"), (*PRINTERS, LIAR, *WELDERS, WELD_LIAR))


@pytest.fixture
def procs(tls_fleet, tmp_path) -> Iterator[LocalFleet]:
    procs = LocalFleet(tmp_path / "run", tls_fleet[1].url, allow_plaintext=False)
    procs.work.mkdir()
    try:
        yield procs
    finally:
        procs.stop_all()


def _serve(procs: LocalFleet, layout: FleetLayout, task: dict, expected: list[str], **kw) -> None:
    """``serve`` on ``task`` with the aggregator's certificate, to the task's end."""
    tls = (
        f'tls = {{ ca_file = "{layout.ca_cert}", cert_file = "{layout.cert(AGGREGATOR)}", '
        f'key_file = "{layout.key(AGGREGATOR)}" }}'
    )
    toml = aggregator_toml(procs.broker_url, procs.work / "aggregator", [task], expected=expected,
                           deadline_s=DEADLINE_S, connection=[f'client_id = "{AGGREGATOR}"', tls], **kw)  # fmt: skip
    procs.start_aggregator(toml)
    assert procs.wait_aggregator(SERVE_WAIT_S) == 0, procs.log("aggregator")[-3000:]


def test_one_devices_certificate_claiming_a_million_rows_counts_a_few_times_the_median(tls_fleet, procs):
    # §2: printer4's certificate, a status of a million rows and an upload claiming them each round
    # (the global +10).  Before the cap it took 99.99 % of the samples-weighted mean.
    layout, _ = tls_fleet
    claimer = Claimer(procs.broker_url, tls=(layout.ca_cert, layout.cert(LIAR), layout.key(LIAR)))
    try:
        for d in PRINTERS:
            procs.start_device(d, "--config", str(layout.toml(d)))
        task = {**pflda_task(rounds=2), "server": {"weighting": "samples"}}
        _serve(procs, layout, task, [*PRINTERS, LIAR])
    finally:
        claimer.stop()
    records = procs.rounds()
    assert [(r.status, sorted(r.participants)) for r in records] == [("completed", [*PRINTERS, LIAR])] * 2
    cap = int(3 * np.median(list(records[0].n_samples.values())))
    for r in records:
        assert r.extra["weight_cut"] == {LIAR: [CLAIM, cap]}, r.extra
        assert cap / (cap + sum(r.n_samples[d] for d in PRINTERS)) <= 0.5  # its share; 99.99 % before
    assert procs.log("aggregator").count("count fewer samples than they claim") == 2


def test_one_devices_certificate_neither_fixes_the_width_nor_poisons_the_pool(tls_fleet, procs):
    # §1: w4's certificate sends, in a loop from before the task is announced, 7 features (before: the
    # width, and the honest welders refused) and n = 10, Σx = 0, Σx² = 1e30 on all 624 (before: std 1e14).
    layout, _ = tls_fleet
    liar = _connected(layout, WELD_LIAR)
    assert liar.subscribe(topics.topic_scaling(FLEET, "tool")) == [1]  # devices read the transform
    narrow = FeatureStats("tool", WELD_LIAR, 20, np.ones(7), np.ones(7) * 3).encode()
    poison = FeatureStats("tool", WELD_LIAR, 10, np.zeros(624), np.full(624, 1e30)).encode()
    stop = threading.Event()

    def lie() -> None:
        # The poison first: the pool needs it (scaling_min_devices = 4), so the one it takes came after the
        # announcement, and the narrow one, sent after it on the same connection, is judged before the task
        # can end (a fixed period alone left that to chance).
        while not stop.wait(0.2):
            for payload in (poison, narrow):
                liar.publish(topics.topic_stats(FLEET, "tool", WELD_LIAR), payload)

    thread = threading.Thread(target=lie, daemon=True)
    thread.start()
    try:
        for d in WELDERS:
            record(procs.work, d, "welder", "--welds", "30", "--weld-s", "0.02")
            procs.start_device(d, "--config", str(layout.toml(d)), "--log-level", "INFO", simulate=None)
        task = WELD_TASK | {"hparams": WELD_TASK["hparams"] | {"scaling_min_devices": 4}}
        started = time.monotonic()
        _serve(procs, layout, task, list(WELDERS), startup_wait_s=30)
        served_s = time.monotonic() - started
        # The liar reads the broker on its own connection, which may lag serve's: wait for it.
        procs.wait_for(
            lambda: any(t == topics.topic_scaling(FLEET, "tool") for t, _ in list(liar.messages)),
            60,
            "the liar reading the pooled transform",
        )
    finally:
        stop.set()
        thread.join()
        liar.close()
    assert [r.status for r in procs.rounds("tool")] == ["completed"] * 2  # the liar stopped nothing
    published = {p for t, p in liar.messages if t == topics.topic_scaling(FLEET, "tool")}
    assert len(published) == 1
    pooled = FleetScaling.decode(published.pop())
    assert pooled.devices == (*WELDERS, WELD_LIAR)
    # w4 is pooled clipped toward the median device (test_fleet_scaling_mqtt's bounds).
    train = [DatasetReader(procs.work / d) for d in WELDERS]
    for r in train:
        r.refresh()
    stds = np.array([r.train.x.std(axis=0) for r in train])
    means = np.array([r.train.x.mean(axis=0) for r in train])
    hi = stds.max(axis=0)
    reach = 3 * np.hypot(hi, 1.4826 * (means.max(axis=0) - means.min(axis=0))) * (1 + 1e-9)
    assert np.all(pooled.std <= np.hypot(3 * hi, reach)) and np.all(pooled.std >= stds.min(axis=0) / 3.01)
    assert np.all(pooled.mean >= means.min(axis=0) - reach) and np.all(
        pooled.mean <= means.max(axis=0) + reach
    )
    log = procs.log("aggregator")
    assert "features per row; the task's model takes 624" in log
    # One line per reason at most every SAY_EVERY_S (numbers aside, as the aggregator groups them):
    # bounded by how long serve ran, which a loaded box stretches, not by a guess of it.
    said = re.findall(
        rf"refused feature statistics from {WELD_LIAR}: (.*?)(?: \(\d+ more refused .*\))?$", log, re.M
    )
    per_reason = Counter(re.sub(r"\d[\d.e+-]*", "#", why) for why in said)
    assert said and max(per_reason.values()) <= 1 + served_s // SAY_EVERY_S, per_reason
    for d in WELDERS:
        assert "fleet scaling pooled from 4 devices" in procs.log(d)
