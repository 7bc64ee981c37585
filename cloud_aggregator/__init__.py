"""The cloud side: rounds over MQTT, the papers' aggregations, backbones, provisioning, the console.

Modules that moved into the wings keep importing from their old paths, with a
``DeprecationWarning``, until version 0.2.0 (:mod:`ioft_protocol.moved`); scripts
should import from :mod:`ioft`, whose names stay put.
"""

from ioft_protocol.moved import keep_moved

REMOVED_IN = "0.2.0"
#: Old module path (under ``cloud_aggregator.``) -> where it lives now.
MOVED = {
    "accountant": "cloud_aggregator.aggregation.accountant",
    "admission": "cloud_aggregator.rounds.admission",
    "aggregate": "cloud_aggregator.aggregation.mean",
    "aggregate_second_order": "cloud_aggregator.aggregation.second_order",
    "backbones": "cloud_aggregator.models.backbones",
    "broker": "cloud_aggregator.local.broker",
    "buffered": "cloud_aggregator.rounds.buffered",
    "buffered_mqtt": "cloud_aggregator.serve.buffered_mqtt",
    "console_app": "cloud_aggregator.console.app",
    "console_feed": "cloud_aggregator.console.feed",
    "coordinator": "cloud_aggregator.serve.coordinator",
    "demo": "cloud_aggregator.local.demo",
    "fedbuff": "cloud_aggregator.aggregation.fedbuff",
    "fleet_ca": "cloud_aggregator.fleet.ca",
    "fleet_devices": "cloud_aggregator.fleet.devices",
    "fleet_init": "cloud_aggregator.fleet.init",
    "fleet_layout": "cloud_aggregator.fleet.layout",
    "fleet_plant_files": "cloud_aggregator.fleet.plant_files",
    "fleet_plants": "cloud_aggregator.fleet.plants",
    "fleet_privacy": "cloud_aggregator.console.privacy",
    "fleet_sessions": "cloud_aggregator.fleet.sessions",
    "fleet_status": "cloud_aggregator.console.fleet_status",
    "fleet_units": "cloud_aggregator.fleet.units",
    "fleet_view": "cloud_aggregator.console.fleet_view",
    "fleet_workers": "cloud_aggregator.fleet.workers",
    "local_fleet": "cloud_aggregator.local.fleet",
    "metrics": "cloud_aggregator.console.metrics",
    "mqtt_fleet": "cloud_aggregator.serve.mqtt_fleet",
    "operator_login": "cloud_aggregator.operator",
    "push": "cloud_aggregator.models.push",
    "push_answers": "cloud_aggregator.models.push_answers",
    "push_targets": "cloud_aggregator.models.push_targets",
    "rabbitmq": "cloud_aggregator.local.rabbitmq",
    "reducers": "cloud_aggregator.aggregation.reducers",
    "rollout": "cloud_aggregator.models.rollout",
    "rollout_cli": "cloud_aggregator.models.rollout_cli",
    "rollout_run": "cloud_aggregator.models.rollout_run",
    "secagg_round": "cloud_aggregator.serve.secagg_round",
    "server": "cloud_aggregator.serve.server",
    "simulation": "cloud_aggregator.rounds.simulation",
    "singleton": "cloud_aggregator.serve.singleton",
    "store_backup": "cloud_aggregator.store.backup",
    "store_cli": "cloud_aggregator.store.cli",
    "stragglers": "cloud_aggregator.rounds.stragglers",
    "strategies": "cloud_aggregator.aggregation.strategies",
    "streaming": "cloud_aggregator.aggregation.streaming",
    "task_lanes": "cloud_aggregator.serve.task_lanes",
    "upload_log": "cloud_aggregator.store.upload_log",
    "watchdog": "cloud_aggregator.serve.watchdog",
    "weighting": "cloud_aggregator.aggregation.weighting",
    "worker_wire": "cloud_aggregator.serve.worker_wire",
    "workers": "cloud_aggregator.serve.workers",
}
keep_moved({f"cloud_aggregator.{old}": new for old, new in MOVED.items()}, REMOVED_IN)
