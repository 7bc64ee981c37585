"""Aggregator workers on a fleet's own broker, the operator's way: ``fleet init --workers 2`` → the
written mosquitto.conf → ``serve`` with ``[collect] workers = 2`` → devices from their written folders.

The fleet's broker makes every login's identity (certificate CN, or password-file user) its
username and client id.  Before: each worker ``serve`` started logged in with the aggregator's
certificate, so the broker saw one client ``aggregator`` taking over its own connection again and
again ("Client aggregator already connected, closing old connection", 23 times in 5 s) and serve
died publishing its first announcement.  Now each worker logs in as ``worker.<id>`` with the login
``fleet init --workers`` wrote (``aggregator/workers/<id>.toml``) and the ACL's worker stanza.

Run for both ``--auth certs`` and ``--auth passwords``.  The broker runs the written config plus one
test-only line, ``log_type all``: mosquitto 2.0.11 logs a refused publish ("Denied PUBLISH") at
debug level only, and which client each message went to likewise.
"""

from __future__ import annotations

import re

import pytest

from cloud_aggregator.local.broker import free_port
from tests.e2e.test_bridged_plant import DEVICES, ROUNDS, device
from tests.e2e.test_fleet_init_broker import Broker, assert_clean_start, init
from tests.e2e.test_operator_path import console_script, served_rounds, spawn, stop, tail

pytestmark = pytest.mark.broker
TASK = "speed"
TASKS = f"""
[collect]
deadline_s = 60
startup_wait_s = 30  # serve waits for its two workers' birth messages before round 1
min_participants = {len(DEVICES)}
workers = 2

[[task]]
name = "{TASK}"
algorithm = "fedavg"
model = "sigmoid_glm"
rounds = {ROUNDS}
hparams = {{ lr = 0.1, local_steps = 10 }}
"""


@pytest.fixture
def work(enterable_dir):
    return enterable_dir


@pytest.mark.parametrize("auth", ["certs", "passwords"])
def test_serve_with_two_workers_on_a_fleet_init_broker_each_as_its_own_identity(work, auth):
    port = free_port()
    fleet = init(work, port, "--workers", "2", "--auth", auth)
    agg_toml = fleet / "aggregator" / "aggregator.toml"
    with agg_toml.open("a") as f:
        f.write(TASKS)
    conf = fleet / "broker" / "mosquitto.conf"
    with conf.open("a") as f:
        f.write("log_type all\n")  # test only: denials and deliveries are logged at debug level
    broker = Broker(conf, port, work / "mosquitto.log")
    procs = []
    try:
        assert_clean_start(broker)
        aggregator = spawn([*console_script("cloud-aggregator", "cloud_aggregator.cli"), "serve", "--config",
                            str(agg_toml), "--state-dir", str(work / "aggregator")], work / "aggregator.log", cwd=work)  # fmt: skip
        procs.append(aggregator)
        procs += [device(work, fleet, d) for d in DEVICES]
        refusals = served_rounds(aggregator, work, TASK, ROUNDS, DEVICES, work / "mosquitto.log")
        assert set().union(*(set(r) for r in refusals.values())) <= {"replay", "stale_round", "resent"}, (
            refusals
        )
    finally:
        for p in procs:
            stop(p)
        broker.stop()

    log = broker.log()
    logins = dict(re.findall(r"New client connected from \S+ as (\S+) \(.*u'([^']+)'\)", log))
    assert logins == {n: n for n in ("aggregator", "worker.w1", "worker.w2", *DEVICES)}, logins
    assert "already connected" not in log  # nobody took over another's connection
    assert "Denied" not in log, [line for line in log.splitlines() if "Denied" in line]
    delivered = re.findall(rf"Sending PUBLISH to (\S+) \(.*'ioft/v1/plant/task/{TASK}/up/", log)
    assert delivered and set(delivered) <= {"worker.w1", "worker.w2"}, delivered  # serve reads no upload
    batches = set(re.findall(r"Received PUBLISH from (\S+) \(.*'ioft/v1/plant/agg/batch/", log))
    assert batches and batches <= {"worker.w1", "worker.w2"}, batches
    served = tail(work / "aggregator.log")
    assert "Traceback" not in served and "worker w1 stopped" in served and "worker w2 stopped" in served, (
        served
    )
