"""An in-process fleet of virtual clients: the papers' studies and benchmarks run here.

The clients run the very ``trainer_lite`` algorithm code that ``edge-trainer``
runs, every upload passes the same admission pipeline (``cloud_aggregator.rounds.admission``)
as over MQTT, and the server runs the same ``RoundEngine`` and ``Strategy`` as the MQTT
aggregator; only the transport differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission import Admission, AdmissionPolicy
from cloud_aggregator.rounds.collector import CollectPolicy, FixedRoster, RoundCollector
from cloud_aggregator.rounds.engine import RoundEngine
from cloud_aggregator.rounds.secagg import collect_in_process
from cloud_aggregator.rounds.types import CollectRequest, LateUpdate, Reason, Refusal, Rejection, RoundRecord
from ioft_protocol.compress import encode_upload
from ioft_protocol.round_messages import UpdateMessage
from sensors.features.scaling import Standardizer, feature_sums, pool_feature_sums, standardize_locally
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.client import derive_rng, initial_local, participate
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec

log = logging.getLogger(__name__)

#: One upload as a fleet receives it: the sending device (a topic's over MQTT) and the message,
#: decoded (what a simulated client sends) or as bytes (decoded by admission).
Uplink = tuple[str, UpdateMessage | bytes]


@dataclass(frozen=True)
class ClientData:
    """A virtual client's local data: a training split and an optional test split."""

    train: Dataset
    test: Dataset | None = None


class SimulatedFleet:
    """Virtual clients holding their data and local state in memory.

    Parameters
    ----------
    spec
        The task every client runs.
    clients
        ``{device id: ClientData}``.
    participation
        Fraction C of clients sampled each round (at least one), seeded by the task seed.
    admission
        Bounds of the admission pipeline's norm check.
    uplinks
        Sees each round's uploads before admission and returns what is delivered instead
        (tests inject hostile uploads here); ``None`` delivers them as sent.
    fleet
        The fleet id the uploads name.
    """

    def __init__(
        self,
        spec: TaskSpec,
        clients: Mapping[str, ClientData],
        *,
        participation: float = 1.0,
        admission: AdmissionPolicy | None = None,
        uplinks: Callable[[CollectRequest, list[Uplink]], Sequence[Uplink]] | None = None,
        fleet: str = "sim",
    ) -> None:
        if not clients:
            raise ValueError("a simulated fleet needs at least one client")
        if not 0.0 < participation <= 1.0:
            raise ValueError(f"participation must be in (0, 1], got {participation}")
        self.spec = spec
        self.algo: ClientAlgorithm = make_client(spec)
        # scaling = "fleet": pooled once from the first clients' sums, as the aggregator does
        self.fleet_scaler = (
            pool_feature_sums(
                {d: feature_sums(c.train.x) for d, c in clients.items()}, self.algo.scaling_min_devices
            )
            if self.algo.scaling == "fleet"
            else None
        )
        self.clients = {d: _scaled(c, self.algo.scaling, self.fleet_scaler) for d, c in clients.items()}
        self.participation = participation
        self.local: dict[str, Params] = {d: initial_local(self.algo, d) for d in self.clients}
        # A simulated device's status would report its training rows: the samples bound.
        self.admission = Admission(
            fleet,
            admission,
            reported_rows=lambda d: len(self.clients[d].train) if d in self.clients else None,
        )
        self.uplinks = uplinks

    def add_device(self, device: str, data: ClientData) -> None:
        """A device that joins the fleet: sampled from the next round on, with a new local state.

        Its personal state is new, so at its first round the algorithm's cold start fits it
        from the downlink and ``data`` (``trainer_lite.client.participate``).
        """
        if device in self.clients:
            raise ValueError(f"device {device!r} is in the fleet already; pick another id")
        self.clients[device] = _scaled(
            data, self.algo.scaling, self.fleet_scaler
        )  # a joiner takes it as published
        self.local[device] = initial_local(self.algo, device)

    def sample(self, round_: int) -> list[str]:
        devices = sorted(self.clients)
        k = max(1, round(self.participation * len(devices)))
        if k == len(devices):
            return devices
        rng = derive_rng(self.spec.seed, "participation", round_)
        return sorted(rng.choice(devices, size=k, replace=False).tolist())

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection | LateUpdate]:
        sent: list[Uplink] = []
        if request.participants is None:
            devices = self.sample(request.round)
        else:  # the server chose (e.g. FTL-TP's fraction per task group); unknown ids are absent
            devices = [d for d in request.participants if d in self.clients]
        for device in devices:
            shared = request.downlinks.get(device, request.global_params)
            msg = self.train(device, shared, request.round, request.phase, request.global_hash)
            sent.append((device, msg))
        delivered = sent if self.uplinks is None else self.uplinks(request, sent)
        # The round's collector, as over MQTT: every sampled device online, each upload filed once.
        collector = RoundCollector(request, CollectPolicy(expected=tuple(devices)), FixedRoster(devices))
        for device, upload in delivered:
            verdict = self.admission.verdict(device, upload, request)
            if isinstance(verdict, Update) and request.fold is not None:
                # Streaming, as MqttFleet does it: the sum takes the params, the inbox the count.
                request.fold.add_many([verdict])
                verdict = replace(verdict, params={})
            collector.file(device, verdict)
            if isinstance(verdict, Refusal):  # a copy of a counted upload is routine
                level = logging.INFO if verdict.reason is Reason.RESENT else logging.WARNING
                log.log(level, "dropped update from %s: %s", device, verdict)
        if request.spec.secagg is not None:  # masked and summed as over MQTT, in this process
            return collect_in_process(request, list(collector.inbox.values()))
        return list(collector.inbox.values())

    def train(self, device: str, shared: Params, round_: int, phase: str, global_hash: str) -> UpdateMessage:
        """``device``'s client update from ``shared`` (its local state moves on): the upload it sends."""
        data = self.clients[device]
        result, self.local[device] = participate(
            self.algo, device, shared, self.local[device], data.train, data.test, round_=round_, phase=phase
        )
        return UpdateMessage(
            self.admission.fleet,
            self.spec.name,
            device,
            round_,
            phase,
            result.n_samples,
            global_hash,
            result.metrics,
            encode_upload(  # under SecAgg the codes go masked (``collect_in_process``), as on a device
                result.shared,
                shared,
                None if self.spec.secagg is not None else self.spec.compress,
                task=self.spec.name,
                round_=round_,
                phase=phase,
                device=device,
                global_hash=global_hash,
            ),
            self.spec.compress,
        )

    def evaluate(self, global_params: Params, split: str = "test") -> dict[str, dict[str, float]]:
        """Every client's personalized-model metrics on its ``split`` (``"test"`` or ``"train"``)."""
        out = {}
        for device, data in self.clients.items():
            ds = data.test if split == "test" else data.train
            if ds is not None and len(ds):
                out[device] = self.algo.evaluate(global_params, self.local[device], ds)
        return out


class Simulation:
    """A running in-process simulation: run some rounds, add devices, run more.

    ::

        sim = Simulation(spec, clients)
        sim.run()                                   # spec.rounds rounds
        sim.add_device("printer5", ClientData(train, test))
        sim.run_more(20)                            # rounds spec.rounds + 1 ... spec.rounds + 20

    The rounds run on one ``RoundEngine`` and its store, so continuing is the engine
    resuming from its last completed round (the strategy's state included).

    Parameters
    ----------
    spec, clients, participation
        As :class:`SimulatedFleet`.
    on_record
        Called with each round's record, the fleet and the global after it.
    """

    def __init__(
        self,
        spec: TaskSpec,
        clients: Mapping[str, ClientData],
        *,
        participation: float = 1.0,
        on_record: Callable[[RoundRecord, SimulatedFleet, Params], None] | None = None,
    ) -> None:
        self.fleet = SimulatedFleet(spec, clients, participation=participation)
        self.records: list[RoundRecord] = []
        self.on_record = on_record
        self.engine = RoundEngine(spec, self.fleet, on_record=self._record)

    def _record(self, rec: RoundRecord) -> None:
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec, self.fleet, self.engine.global_params)

    @property
    def global_params(self) -> Params:
        """The global after the last completed round (empty before any round ran)."""
        return self.engine.global_params

    @property
    def rounds_done(self) -> int:
        """Rounds completed (or abandoned) so far."""
        point = self.engine.store.resume_point(self.engine.spec.name)
        return 0 if point is None else point[0] - 1

    def run(self, until: int | None = None) -> Params:
        """Run rounds up to round ``until`` (``None``: ``spec.rounds``); returns the global."""
        total = self.engine.spec.rounds if until is None else until
        if total < self.rounds_done:
            raise ValueError(f"round {total} is behind the {self.rounds_done} rounds done already")
        self.engine.spec = replace(self.engine.spec, rounds=total)
        return self.engine.run()

    def run_more(self, rounds: int) -> Params:
        """Continue for ``rounds`` more rounds; returns the global."""
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        return self.run(self.rounds_done + rounds)

    def add_device(self, device: str, data: ClientData) -> None:
        """:meth:`SimulatedFleet.add_device`: it takes part from the next round run."""
        self.fleet.add_device(device, data)


def simulate(
    spec: TaskSpec,
    clients: Mapping[str, ClientData],
    *,
    participation: float = 1.0,
    on_record: Callable[[RoundRecord, SimulatedFleet, Params], None] | None = None,
) -> tuple[Params, SimulatedFleet, list[RoundRecord]]:
    """Run ``spec`` over in-process clients; returns the final global, the fleet and the records."""
    sim = Simulation(spec, clients, participation=participation, on_record=on_record)
    final = sim.run()
    return final, sim.fleet, sim.records


def mean_test_loss(fleet: SimulatedFleet, global_params: Params, metric: str = "loss") -> float:
    """Mean of every client's personalized test metric."""
    values = [m[metric] for m in fleet.evaluate(global_params).values()]
    return float(np.mean(values))


def _scaled(data: ClientData, scaling: str, pooled: Standardizer | None = None) -> ClientData:
    """``data`` as the device would train on it under the task's ``scaling`` (see ``edge.task_inputs``):
    ``pooled`` is the fleet's transform where ``scaling = "fleet"``."""
    if scaling not in ("local", "fleet"):
        return data
    train, test = data.train, data.test
    test_x = test.x if test is not None else train.x[:0]
    if pooled is not None:
        dtype = np.result_type(train.x.dtype, np.float32)
        tx, ex = pooled.transform(train.x, dtype), pooled.transform(test_x, dtype)
    else:
        tx, ex = standardize_locally(train.x, test_x)
    scaled_test = None if test is None else Dataset(ex, test.y, test.domain)
    return replace(data, train=Dataset(tx, train.y, train.domain), test=scaled_test)
