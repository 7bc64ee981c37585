"""``cloud-aggregator serve`` settings: a TOML file, validated against this schema."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cloud_aggregator.aggregation.fedbuff import BufferConfig
from cloud_aggregator.aggregation.strategies import make_strategy
from cloud_aggregator.aggregation.weighting import strategy_args
from cloud_aggregator.rounds.admission import AdmissionPolicy
from cloud_aggregator.rounds.task_rules import (
    buffered_refusal,
    check_next_round,
    check_secagg_task,
    compress_refusal,
    workers_refusal,
)
from ioft_protocol.codec import MAX_PAYLOAD_BYTES, check_id
from ioft_protocol.compress import CompressConfig
from ioft_protocol.config import ConfigError, build
from ioft_protocol.mqtt_options import TlsConfig
from ioft_protocol.round_messages import ROUND_MODES, DeviceSelection
from ioft_protocol.secagg import SecAggConfig
from trainer_lite.algorithms.base import algorithm_hparams
from trainer_lite.privacy import DPConfig
from trainer_lite.task import TaskSpec


@dataclass(frozen=True)
class CollectConfig:
    """See ``cloud_aggregator.serve.mqtt_fleet.CollectPolicy``."""

    deadline_s: float = 30.0
    min_participants: int = 1
    max_extensions: int = 2
    expected: list[str] = field(default_factory=list)
    startup_wait_s: float = 60.0
    #: Without ``expected``, rounds wait only for devices heard live within this many seconds (their
    #: heartbeat, ``device.toml`` heartbeat_s, or a roll-call answer); 0: every "online" status counts.
    liveness_s: float = 90.0  # three of the devices' default 30 s heartbeats (serve.liveness)
    #: Uploads past the deadline: "drop", or "next_round" (see ``cloud_aggregator.rounds.engine``).
    straggler: str = "drop"
    staleness_weight: float = 0.5
    #: A streaming round's partial sum is checkpointed every this many uploads (``mqtt_fleet``).
    checkpoint_every: int = 256
    #: Aggregator workers sharing the uplink (``cloud_aggregator.serve.coordinator``); 1: serve alone.
    workers: int = 1
    #: With ``workers`` > 1: serve starts them beside itself (``false``: an operator runs
    #: ``cloud-aggregator worker`` on other machines).
    spawn_workers: bool = True
    #: Plant workers (``cloud-aggregator worker --plant``, ``fleet add-plant --partial-aggregator``)
    #: serve coordinates and waits for at start: with them serve coordinates even at ``workers = 1``,
    #: then reading no upload itself (every device sits at such a plant).
    plant_workers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.min_participants < 1 or self.max_extensions < 0:
            raise ValueError("need deadline_s > 0, min_participants >= 1, max_extensions >= 0")
        if not self.liveness_s >= 0:
            raise ValueError(f"liveness_s must be >= 0 s (0: off), got {self.liveness_s}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        for w in self.plant_workers:
            check_id("worker", w)
        dupes = sorted({w for w in self.plant_workers if self.plant_workers.count(w) > 1})
        if dupes:
            raise ValueError(f"plant_workers names {dupes} more than once; name each plant worker once")
        own = sorted(
            set(self.plant_workers) & {f"w{i}" for i in range(1, self.workers + 1)}
            if self.workers > 1
            else []
        )
        if own:
            raise ValueError(
                f"plant_workers {own} are named as serve's own workers (w1..w{self.workers}); "
                "rename the plant (fleet add-plant --plant)"
            )
        if self.straggler not in ("drop", "next_round"):
            raise ValueError(f"straggler must be 'drop' or 'next_round', got {self.straggler!r}")
        if not 0.0 < self.staleness_weight <= 1.0:
            raise ValueError(f"staleness_weight must be in (0, 1], got {self.staleness_weight}")


@dataclass(frozen=True)
class StoreConfig:
    """The ``[store]`` table: online backups of ``aggregator.sqlite`` (``cloud_aggregator.store.backup``)."""

    #: A backup (checked as it is taken) every this many saved rounds; 0: none.
    backup_every: int = 10
    #: How many backups are kept (the newest).
    backup_keep: int = 3

    def __post_init__(self) -> None:
        if self.backup_every < 0 or self.backup_keep < 1:
            raise ValueError(
                f"[store] needs backup_every >= 0 (0: no backups) and backup_keep >= 1, "
                f"got {self.backup_every} and {self.backup_keep}"
            )


@dataclass(frozen=True)
class AdmissionConfig:
    """The ``[admission]`` table: bounds of the update-admission checks.

    The fields and defaults of ``cloud_aggregator.rounds.admission.AdmissionPolicy`` (see its
    module docstring): ``max_norm_ratio`` (an upload's change ‖u − g‖ above this many
    times the task's running median change is refused), ``min_history`` (accepted
    changes before that bound applies), ``history`` (how many changes the median is
    over), ``max_update_norm`` / ``max_param_norm`` (absolute bounds on ‖u − g‖ and
    ‖u‖, off by default), ``max_samples`` (the most ``n_samples`` an upload may claim; an
    upload also may not claim more than the training rows its device reported) with
    ``task_max_samples`` per task, and ``max_metrics`` / ``max_metric_name`` (how many
    metrics an upload may carry, how long their names).  ``replay_rounds`` is gone (equal tensors are no evidence of a
    replay; a replay is a second answer to a round): a table that sets it is refused by name.
    TOML has no null: ``inf`` turns a bound off, e.g.::

        [admission]
        max_norm_ratio = 50.0     # a fleet known to be homogeneous
        max_update_norm = 1e3
        # max_norm_ratio = inf    # no relative bound
        max_samples = 100000
        task_max_samples = { speed = 20000 }
    """

    max_norm_ratio: float | None = AdmissionPolicy.max_norm_ratio
    min_history: int = AdmissionPolicy.min_history
    history: int = AdmissionPolicy.history
    max_update_norm: float | None = AdmissionPolicy.max_update_norm
    max_param_norm: float | None = AdmissionPolicy.max_param_norm
    max_samples: int = AdmissionPolicy.max_samples
    task_max_samples: dict[str, int] = field(default_factory=dict)
    max_metrics: int = AdmissionPolicy.max_metrics
    max_metric_name: int = AdmissionPolicy.max_metric_name

    def __post_init__(self) -> None:
        self.policy()  # AdmissionPolicy's own checks, at config time

    def policy(self) -> AdmissionPolicy:
        """The ``AdmissionPolicy`` for ``MqttFleet`` (an infinite bound becomes ``None``: off)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("max_norm_ratio", "max_update_norm", "max_param_norm"):
            if kwargs[name] == math.inf:
                kwargs[name] = None
        return AdmissionPolicy(**kwargs)


@dataclass(frozen=True)
class TaskConfig:
    """One task to train (becomes a ``TaskSpec``)."""

    name: str
    algorithm: str
    model: str
    rounds: int = 10
    seed: int = 0
    dtype: str = "float32"
    model_args: dict[str, Any] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    #: The feature schema the task's inputs follow: a sha256 hex digest, ``"weld-dwt"`` for
    #: the default 624-feature weld schema (``sensors.features.schema``), or the path of a schema
    #: file that ``edge-recorder schema --save`` wrote (read once, at start; relative to the
    #: working folder).  Devices whose dataset carries another schema refuse the task instead of
    #: training on the wrong columns.
    feature_schema: str | None = None
    #: Which devices run the task (``devices = { kind = "welder", tags = [...], ids = [...] }``;
    #: ``None``: every device).  Not part of the spec: narrowing it keeps the task's history.
    devices: DeviceSelection | None = None
    #: Held-out devices (``holdout = ["printer5"]``): each round they score the global model on
    #: their rows and report it, and never train or upload.  Not part of the spec either.
    holdout: tuple[str, ...] = ()
    #: Differential privacy (``[task.dp]``: mode, clip, noise_multiplier, delta, epsilon_budget,
    #: devices_per_round, fleet_size; ``trainer_lite.privacy.DPConfig``), for mean-family servers.
    dp: DPConfig | None = None
    #: Secure aggregation (``[task.secagg]``: threshold, degree, clip, bits, max_weight;
    #: ``ioft_protocol.secagg.SecAggConfig``), for mean-family tasks: the aggregator learns only sums.
    secagg: SecAggConfig | None = None
    #: Compressed uplinks (``[task.compress]``: bits = 1 | 2 | 4 | 8, rotation, block;
    #: ``ioft_protocol.compress.CompressConfig``), for tasks whose server step is a streaming mean.
    compress: CompressConfig | None = None
    #: ``"sync"`` (rounds) or ``"buffered"`` (FedBuff: ``cloud_aggregator.serve.buffered_mqtt``; then
    #: ``rounds`` counts server updates).  Not part of the spec.
    mode: str = "sync"
    #: ``[task.buffered]``: ``k``, ``server_lr``, ``staleness``, ``max_staleness``
    #: (``cloud_aggregator.aggregation.fedbuff.BufferConfig``; ``max_staleness`` defaults to
    #: :data:`MAX_STALENESS` here).  Only with ``mode = "buffered"``.
    buffered: BufferConfig | None = None

    def __post_init__(self) -> None:
        if self.feature_schema is not None:  # a file is read once: the spec never changes under a task
            object.__setattr__(self, "feature_schema", self._schema_hash())
        self.check()

    def buffer_config(self) -> BufferConfig:
        """The buffered task's settings, ``max_staleness`` defaulted (TOML has no null)."""
        cfg = self.buffered or BufferConfig()
        if cfg.max_staleness is None:
            cfg = BufferConfig(cfg.k, cfg.server_lr, cfg.staleness, MAX_STALENESS)
        return cfg

    def check(self) -> None:
        """Resolve the algorithm, model, hyperparameters and server options as ``serve`` will.

        Raises
        ------
        ValueError
            Naming what is wrong (an unknown algorithm or model lists the valid names; a
            hyperparameter of the wrong name or type names it), so a config is refused at
            start-up, before anything connects or writes, never mid-run.
        """
        spec = self.spec()
        for device in self.holdout:
            check_id(f"task {self.name!r} holdout entry", device)  # a WireError is a ValueError
        if self.dp is not None and self.dp.fleet_size not in (None, self.dp.devices_per_round):
            raise ValueError(  # amplification by sampling needs a secret random draw, which serve never makes
                f"task {self.name!r}: dp fleet_size: serve does not draw devices at random (every selected "
                "online device takes part in every round), so the sampling rate is 1; leave fleet_size out"
            )
        try:
            strategy = make_strategy(spec)  # the client algorithm, its model and both configs
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"task {self.name!r}: {exc}") from None
        for what, cls, values in (
            ("hparams", strategy.client.config_cls, algorithm_hparams(spec.hparams)),
            ("server", strategy.config_cls, strategy_args(spec.server)),
        ):
            try:
                build(cls, dict(values), f"task {self.name!r} {what}")
            except ConfigError as exc:
                raise ValueError(f"task {self.name!r} {what}: {'; '.join(exc.errors)}") from None
        check_secagg_task(spec)
        self._check_mode(spec, strategy)
        if self.compress is not None:
            why = compress_refusal(spec, self.mode)
            if why is not None:
                raise ValueError(f"task {self.name!r}: [task.compress]: {why}")

    def _check_mode(self, spec: TaskSpec, strategy: object) -> None:
        if self.mode not in ROUND_MODES:
            raise ValueError(
                f"task {self.name!r}: mode must be one of {list(ROUND_MODES)}, got {self.mode!r}"
            )
        if self.mode == "sync":
            if self.buffered is not None:
                raise ValueError(f"task {self.name!r}: [task.buffered] needs mode = 'buffered'")
            return
        why = buffered_refusal(spec, strategy)
        if why is None and self.holdout:
            why = "held-out devices score a round's global; a buffered task has none, leave holdout out"
        if why is not None:
            raise ValueError(f"task {self.name!r}: mode = 'buffered': {why}")

    def spec(self) -> TaskSpec:
        return TaskSpec(
            name=self.name,
            algorithm=self.algorithm,
            model=self.model,
            model_args=self.model_args,
            hparams=self.hparams,
            server=self.server,
            dtype=self.dtype,
            rounds=self.rounds,
            seed=self.seed,
            feature_schema=self._schema_hash(),
            dp=None if self.dp is None else self.dp.to_spec(),
            secagg=None if self.secagg is None else self.secagg.to_json(),
            compress=None if self.compress is None else self.compress.to_json(),
        )

    def _schema_hash(self) -> str | None:
        value = self.feature_schema
        if value == "weld-dwt":
            # Lazy: sensors.features.schema imports PyWavelets (the device extra), and the
            # aggregator's config must load with the core dependencies alone.
            from sensors.features.schema import schema_hash

            return schema_hash()
        if not isinstance(value, str) or _HEX64.fullmatch(value):
            return value  # a hash (or None); TaskSpec checks its form
        if not value.lower().endswith(".json") and not Path(value).exists():
            raise ValueError(
                f"task {self.name!r}: feature_schema {value!r} is neither a sha256 hex digest, "
                "'weld-dwt', nor a schema file (edge-recorder schema --from FOLDER --save schema.json)"
            )
        from sensors.features.infer import load_schema_file
        from sensors.welding.recording import WeldDataError

        try:
            return load_schema_file(value).schema_hash()
        except WeldDataError as exc:  # FeatureInputError: one line naming the file and the fix
            raise ValueError(f"task {self.name!r}: {exc}") from None


_HEX64 = re.compile(r"[0-9a-f]{64}")

#: ``max_staleness`` of a buffered task that does not set it: the versions it keeps in memory.
MAX_STALENESS = 20


@dataclass(frozen=True)
class AggregatorConfig:
    fleet: str = "default"
    broker: str = "mqtt://127.0.0.1:1883"
    state_dir: str = "/var/lib/ioft-aggregator"
    client_id: str = "ioft-aggregator"
    allow_plaintext: bool = False
    username: str | None = None
    password: str | None = None
    tls: TlsConfig | None = None
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    #: Tasks whose stored rounds ``serve`` deletes before it starts them afresh (``serve
    #: --restart TASK``); ``true``: every task.  Any other change of a stored task's spec
    #: than its ``rounds`` is refused (``cloud_aggregator.store.sqlite.TaskChange``).
    restart: bool | list[str] = False
    #: Go on from past the round the devices trained last, when the store is behind them (an older
    #: ``aggregator.sqlite`` restored, or a fresh one): ``serve --resume-from-devices``.
    resume_from_devices: bool = False
    collect: CollectConfig = field(default_factory=CollectConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    task: list[TaskConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_id("fleet", self.fleet)
        names = [t.name for t in self.task]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")
        if self.collect.straggler == "next_round":  # refused at start-up, not when the task's turn comes
            for t in self.task:
                check_next_round(make_strategy(t.spec()))
                if t.dp is not None:  # a late upload would count in a round it was not clipped for
                    raise ValueError(f"task {t.name!r}: dp needs [collect] straggler = 'drop'")
                if t.secagg is not None:  # a late upload carries no parameters, only a sum counts
                    raise ValueError(f"task {t.name!r}: secagg needs [collect] straggler = 'drop'")
                if t.compress is not None:  # its codes stand for a change from last round's global
                    raise ValueError(f"task {t.name!r}: [task.compress] needs [collect] straggler = 'drop'")
        # Workers (the cloud's or the plants') fold partial sums: only the mean family splits.
        if self.collect.workers > 1 or self.collect.plant_workers:
            what = (f"workers = {self.collect.workers}" if self.collect.workers > 1
                    else f"plant_workers = {self.collect.plant_workers}")  # fmt: skip
            for t in self.task:
                why = workers_refusal(t.spec(), self.collect.straggler, t.mode)
                if why is not None:
                    raise ValueError(f"task {t.name!r}: [collect] {what}: {why}")
        if isinstance(self.restart, list):
            unknown = sorted(set(self.restart) - set(names))
            if unknown:
                raise ValueError(f"restart names tasks that are not configured: {unknown}; tasks: {names}")

    def restarts(self, task: str) -> bool:
        """Whether ``task``'s stored rounds are to be deleted before it starts (``restart``)."""
        return self.restart is True or (isinstance(self.restart, list) and task in self.restart)
