"""FTL-TP over MQTT: welders of two task groups, per-device downlinks, server-side selection.

Two tool-condition welders (group M, 4 classes) and two Cu-Cu welders at different
surfaces (group S, 3 classes) share the base layer; each group shares its upper
layers.  Each round the server picks half of each group; only those train, each on
the base plus its own group's layers sent on its own downlink topic, and uploads
exactly those names.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.local.fleet import Sniffer, aggregator_toml
from cloud_aggregator.store.sqlite import SqliteStore
from ioft_protocol import round_messages
from trainer_lite.task import TaskSpec

GROUPS = {"welder1": "M", "welder2": "M", "welder3": "S", "welder4": "S"}
TASK = {
    "name": "tool",
    "algorithm": "ftltp",
    "model": "mlp",
    "rounds": 4,
    "seed": 3,
    "model_args": {"sizes": [624, 24, 12, 4], "init": "kaiming"},
    "hparams": {"groups": {"M": 4, "S": 3}, "batch_size": 8, "lr": 0.001},
    "server": {"device_groups": GROUPS, "client_fraction": 0.5},
}


@pytest.mark.broker
def test_task_groups_train_over_mqtt_with_personal_downlinks(fleet_procs, tmp_path):
    for device, group in GROUPS.items():
        cfg = tmp_path / f"{device}.toml"
        cfg.write_text(f'[data]\nwelder_group = "{group}"\n')
        fleet_procs.start_device(device, "--simulate", "welder", "--config", str(cfg))
    sniffer = Sniffer(fleet_procs.broker_url)
    fleet_procs.start_aggregator(
        aggregator_toml(
            fleet_procs.broker_url, fleet_procs.work / "aggregator", [TASK], expected=list(GROUPS)
        )
    )
    try:
        assert fleet_procs.wait_aggregator(180) == 0, fleet_procs.log("aggregator")[-3000:]
    finally:
        sniffer.stop()
    records = fleet_procs.rounds("tool")
    assert [r.status for r in records] == ["completed"] * 4
    # Exactly the server's selection took part: one welder of each group per round.
    spec = TaskSpec.from_json(json.dumps(TASK))
    strategy = make_strategy(spec)
    for r in records:
        assert sorted(r.participants) == strategy.participants(r.round), r
        assert sorted(GROUPS[d] for d in r.participants) == ["M", "S"]
        assert not r.rejected
    assert len({d for r in records for d in r.participants}) > 2  # selection varies by round

    # Each upload held the base plus its own group's layers, nothing else.
    uploads = [round_messages.UpdateMessage.decode(p) for t, p in sniffer.messages if "/task/tool/up/" in t]
    assert {(u.round, u.device) for u in uploads} == {(r.round, d) for r in records for d in r.participants}
    for u in uploads:
        own = GROUPS[u.device]
        assert any(n.startswith(f"group.{own}.") for n in u.params)
        assert not any(n.startswith("group.") and not n.startswith(f"group.{own}.") for n in u.params)
    # Each selected device got its own downlink; the broadcast names them.
    downs = [
        (t, round_messages.Announcement.decode(p)) for t, p in sniffer.messages if "/task/tool/down" in t
    ]
    for topic, ann in downs:
        if ann.state == "done":
            continue
        if topic.endswith("/down"):  # the broadcast names who waits for a personal copy
            assert ann.for_device is None and set(ann.personalized) == set(GROUPS)
            assert len(ann.participants) == 2
        else:
            assert topic.endswith(f"/down/{ann.for_device}")
            assert {n for n in ann.params if n.startswith("group.")} <= {
                n for n in ann.params if n.startswith(f"group.{GROUPS[ann.for_device]}.")
            }
    store = SqliteStore(fleet_procs.db, readonly=True)
    try:
        final, init = store.resume_point("tool")[2], strategy.init_global()
    finally:
        store.close()
    for name in ("fc0.weight", "group.M.fc2.weight", "group.S.fc2.weight"):
        assert not np.allclose(final[name], init[name]), name
    assert final["group.S.fc2.bias"].shape == (3,) and final["group.M.fc2.bias"].shape == (4,)
