"""An in-process fleet of virtual clients: the papers' studies and benchmarks run here.

The clients run the very ``trainer_lite`` algorithm code that ``edge-trainer``
runs, and the server runs the same ``RoundEngine`` and ``Strategy`` as the MQTT
aggregator; only the transport differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cloud_aggregator.rounds import CollectRequest, Rejection, RoundEngine, RoundRecord
from cloud_aggregator.strategies import Update
from trainer_lite.algorithms import ClientAlgorithm, make_client
from trainer_lite.client import derive_rng, initial_local, participate
from trainer_lite.data import Dataset
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec


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
    """

    def __init__(
        self, spec: TaskSpec, clients: Mapping[str, ClientData], *, participation: float = 1.0
    ) -> None:
        if not clients:
            raise ValueError("a simulated fleet needs at least one client")
        if not 0.0 < participation <= 1.0:
            raise ValueError(f"participation must be in (0, 1], got {participation}")
        self.spec = spec
        self.algo: ClientAlgorithm = make_client(spec)
        self.clients = dict(clients)
        self.participation = participation
        self.local: dict[str, Params] = {d: initial_local(self.algo, d) for d in self.clients}

    def sample(self, round_: int) -> list[str]:
        devices = sorted(self.clients)
        k = max(1, round(self.participation * len(devices)))
        if k == len(devices):
            return devices
        rng = derive_rng(self.spec.seed, "participation", round_)
        return sorted(rng.choice(devices, size=k, replace=False).tolist())

    def collect(self, request: CollectRequest) -> Sequence[Update | Rejection]:
        out: list[Update | Rejection] = []
        if request.participants is None:
            devices = self.sample(request.round)
        else:  # the server chose (e.g. FTL-TP's fraction per task group); unknown ids are absent
            devices = [d for d in request.participants if d in self.clients]
        for device in devices:
            data = self.clients[device]
            shared = request.downlinks.get(device, request.global_params)
            result, self.local[device] = participate(
                self.algo,
                device,
                shared,
                self.local[device],
                data.train,
                data.test,
                round_=request.round,
                phase=request.phase,
            )
            out.append(Update(device, result.shared, result.n_samples, result.metrics))
        return out

    def evaluate(self, global_params: Params, split: str = "test") -> dict[str, dict[str, float]]:
        """Every client's personalized-model metrics on its ``split`` (``"test"`` or ``"train"``)."""
        out = {}
        for device, data in self.clients.items():
            ds = data.test if split == "test" else data.train
            if ds is not None and len(ds):
                out[device] = self.algo.evaluate(global_params, self.local[device], ds)
        return out


def simulate(
    spec: TaskSpec,
    clients: Mapping[str, ClientData],
    *,
    participation: float = 1.0,
    on_record: Callable[[RoundRecord, SimulatedFleet, Params], None] | None = None,
) -> tuple[Params, SimulatedFleet, list[RoundRecord]]:
    """Run ``spec`` over in-process clients; returns the final global, the fleet and the records."""
    fleet = SimulatedFleet(spec, clients, participation=participation)
    records: list[RoundRecord] = []
    engine: RoundEngine

    def record(rec: RoundRecord) -> None:
        records.append(rec)
        if on_record is not None:
            on_record(rec, fleet, engine.global_params)

    engine = RoundEngine(spec, fleet, on_record=record)
    final = engine.run()
    return final, fleet, records


def mean_test_loss(fleet: SimulatedFleet, global_params: Params, metric: str = "loss") -> float:
    """Mean of every client's personalized test metric."""
    values = [m[metric] for m in fleet.evaluate(global_params).values()]
    return float(np.mean(values))
