"""The client half of an algorithm: what a device does in a round, and what it uploads.

An algorithm is transport-free: it takes the downlinked shared parameters, the
device's local (personal) state and its local dataset, and returns what to upload
plus the new local state.  The same object runs in the in-process simulator, in
the ``edge-trainer`` daemon over MQTT, and on a Pi.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from trainer_lite.algorithms.training import (  # noqa: F401 -- algorithms and studies import them from base
    GradHook,
    LossFn,
    TrainConfig,
    get_loss,
    loss_and_grads,
    register_loss,
    run_local_steps,
    score,
)
from trainer_lite.data import Dataset
from trainer_lite.layers import Sequential
from trainer_lite.models import build_model
from trainer_lite.params import Params
from trainer_lite.task import TaskSpec


@dataclass(frozen=True)
class ClientResult:
    """What a client hands back after a round.

    ``shared`` is the only thing that leaves the device.
    """

    shared: Params
    n_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


#: Task hyperparameters that the device daemon reads, not the algorithm: ``"features":
#: "onnx:<model>"`` says the task trains on that pushed ONNX encoder's embeddings;
#: ``"scaling": "local"`` that each device standardises its rows with its own training
#: rows' per-feature mean and deviation (weld DWT features span ten decades); ``"fleet"``
#: that every device applies one transform pooled from the devices' feature sums
#: (``ioft_protocol.feature_stats``), over at least ``scaling_min_devices`` devices.
DEVICE_HPARAMS = ("features", "scaling", "scaling_min_devices")
SCALINGS = ("none", "local", "fleet")
#: The fewest devices whose feature sums a fleet scaling pools.  With two, each device could
#: subtract its own sums from the pooled ones and hold the other's exactly; with three it holds
#: only the sum of the other two.
MIN_POOL_DEVICES = 3
#: Local-state names under this prefix are the device's bookkeeping, not the algorithm's:
#: ``trainer_lite.client`` keeps them and algorithms never see them.
PROGRESS_PREFIX = "progress."


def algorithm_state(local: Mapping[str, np.ndarray]) -> Params:
    """``local`` without the device's bookkeeping (:data:`PROGRESS_PREFIX`): what an algorithm sees."""
    return {k: v for k, v in local.items() if not k.startswith(PROGRESS_PREFIX)}


def algorithm_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` without :data:`DEVICE_HPARAMS` (what the algorithm's config validates)."""
    return {k: v for k, v in hparams.items() if k not in DEVICE_HPARAMS}


def build_config(cls: type, hparams: Mapping[str, Any]) -> Any:
    """Instantiate a config dataclass, listing unknown and valid fields on error."""
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = set(hparams) - valid
    if unknown:
        raise ValueError(
            f"unknown hyperparameters {sorted(unknown)} for {cls.__name__}; valid: {sorted(valid)}"
        )
    return cls(**hparams)


class ClientAlgorithm(ABC):
    """Base of every client algorithm.

    Subclasses set ``name``, ``server``, ``config_cls`` and implement
    ``shared_names``, ``init_local``, ``update`` and ``personal_params``.

    Attributes
    ----------
    name
        The algorithm's key in a task spec (``TaskSpec.algorithm``).
    server
        The key of the server strategy that aggregates this algorithm's uploads
        (``cloud_aggregator.aggregation.strategies``), e.g. ``"fedavg"``.  Every registered
        class names its own, even where a parent class already does.
    config_cls
        The dataclass that validates ``TaskSpec.hparams``.
    answers_rows
        Whether :meth:`predict` answers a row on its own (FedDAR's answers need each row's domain:
        a device's serving, which answers rows one by one, leaves its tasks alone).
    """

    name: ClassVar[str]
    server: ClassVar[str]
    config_cls: ClassVar[type] = TrainConfig
    answers_rows: ClassVar[bool] = True

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.model: Sequential = build_model(spec.model, **spec.model_args)
        self.config = build_config(self.config_cls, algorithm_hparams(spec.hparams))
        self.loss: LossFn = get_loss(self.config.loss)
        self.scaling  # noqa: B018 -- checked with the other hyperparameters, at construction
        self.scaling_min_devices  # noqa: B018

    @property
    def scaling(self) -> str:
        """The task's ``scaling`` device hyperparameter (:data:`DEVICE_HPARAMS`): one of :data:`SCALINGS`."""
        value = self.spec.hparams.get("scaling", "none")
        if value not in SCALINGS:
            raise ValueError(f"hyperparameter scaling={value!r}: choose one of {list(SCALINGS)}")
        return value

    @property
    def scaling_min_devices(self) -> int:
        """How many devices' statistics a ``scaling = "fleet"`` transform pools at least."""
        value = self.spec.hparams.get("scaling_min_devices", MIN_POOL_DEVICES)
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_POOL_DEVICES:
            raise ValueError(
                f"hyperparameter scaling_min_devices={value!r}: an integer >= {MIN_POOL_DEVICES} "
                "(pooled statistics of fewer devices give a device the others' sums)"
            )
        return value

    def input_width(self) -> int | None:
        """Input features per row the task's model takes (``None``: it does not say)."""
        return self.model.input_width()

    # -- what is shared ---------------------------------------------------
    @abstractmethod
    def shared_names(self) -> list[str]:
        """Names of the parameters that leave the device (the server's global state)."""

    def init_global(self, rng: np.random.Generator) -> Params:
        """Initial shared parameters (the server calls this once)."""
        full = self.model.init(rng)
        return {n: full[n] for n in self.shared_names()}

    def check_shared(self, shared: Params, phase: str) -> None:
        """Raise ``ValueError`` unless ``shared`` is what this client can train from.

        By default: exactly the names and shapes of ``init_global``, all finite.
        Algorithms whose downlink differs per phase or per device override this.
        """
        if not hasattr(self, "_shared_shapes"):
            self._shared_shapes = {n: v.shape for n, v in self.init_global(np.random.default_rng(0)).items()}
        expected = self._shared_shapes
        if set(shared) != set(expected):
            raise ValueError(
                f"downlink names differ: missing {sorted(set(expected) - set(shared))}, "
                f"unexpected {sorted(set(shared) - set(expected))}"
            )
        for n, shape in expected.items():
            arr = np.asarray(shared[n])
            if arr.shape != shape:
                raise ValueError(f"downlink {n!r} has shape {arr.shape}, expected {shape}")
            if not np.isfinite(arr).all():
                raise ValueError(f"downlink {n!r} holds NaN or Inf")

    # -- device state -----------------------------------------------------
    @abstractmethod
    def init_local(self, rng: np.random.Generator) -> Params:
        """Initial local (personal) state of a device; never uploaded."""

    @abstractmethod
    def update(
        self,
        shared: Params,
        local: Params,
        data: Dataset,
        *,
        rng: np.random.Generator,
        round_: int,
        phase: str,
    ) -> tuple[ClientResult, Params]:
        """One round on one device: ``(what to upload, new local state)``. Never mutates inputs.

        ``round_`` is the device's own round (1-based: the rounds it has taken part in,
        this one included), which keys the learning-rate schedule; through
        :func:`trainer_lite.client.participate` it equals the fleet's round for a device
        that took part in every round.  The fleet's round keys what must agree across
        devices instead (the minibatch streams, the server's phases and selection).
        """

    def cold_start(
        self, shared: Params, local: Params, data: Dataset, *, rng: np.random.Generator, phase: str
    ) -> Params:
        """The local state of a device whose personal state is new, joining a trained fleet.

        :func:`trainer_lite.client.participate` calls it once, before the device's first
        round, when that round is not the fleet's first (at round 1 the downlink is the
        server's random start, and every device keeps its seeded :meth:`init_local`).
        ``shared`` is the round's downlink and ``data`` the device's first training rows.
        Each algorithm documents its rule in its module; this default keeps ``local``
        (algorithms with nothing personal, or whose personal model restarts from the
        downlink every round).
        """
        return local

    @abstractmethod
    def personal_params(self, shared: Params, local: Params) -> Params:
        """The full parameter dict the device predicts with."""

    # -- inference and scoring --------------------------------------------
    def predict(self, shared: Params, local: Params, x: np.ndarray) -> np.ndarray:
        return self.model(self.personal_params(shared, algorithm_state(local)), x)

    def evaluate(self, shared: Params, local: Params, data: Dataset) -> dict[str, float]:
        """Loss of the personalized model on ``data``, and accuracy for class targets."""
        return score(self.loss, self.predict(shared, local, data.x), data.y)

    # -- optional multi-phase rounds (FedDAR) -----------------------------
    def phases(self) -> tuple[str, ...]:
        return ("train",)

    # -- local optimisation -----------------------------------------------
    def local_steps(
        self,
        params: Params,
        data: Dataset,
        rng: np.random.Generator,
        *,
        round_: int,
        trainable: Iterable[str] | None = None,
        steps: int | None = None,
        lr: float | None = None,
        model: Sequential | None = None,
        grad_hook: GradHook | None = None,
    ) -> float:
        """Train ``params`` in place with the algorithm's loss and optimizer; the mean minibatch loss.

        For algorithms whose config is a :class:`TrainConfig`: a fresh optimizer from
        ``self.config`` for ``round_``, minibatches of ``self.config.batch_size``
        (see :func:`run_local_steps`).

        Parameters
        ----------
        params
            The parameters to train; updated in place.
        data, rng
            The rows to train on, and the round's generator (it draws the minibatches).
        round_
            The device's own round, for the learning-rate schedule (see :meth:`update`).
        trainable, steps, model
            Names of ``params`` to step, optimizer steps and the model to differentiate;
            ``None``: all of ``params``, ``self.config.local_steps`` and ``self.model``.
        lr
            A learning rate in place of ``self.config.lr`` (same schedule), e.g. a
            head's or a fine-tune's own rate; ``None``: the config's.
        grad_hook
            ``grad_hook(params, grads)`` adds regularisation gradients in place.
        """
        cfg = self.config
        opt_cfg = cfg if lr is None else dataclasses.replace(cfg, lr=lr)
        return run_local_steps(
            self.model if model is None else model,
            params,
            params if trainable is None else trainable,
            data,
            self.loss,
            opt_cfg.make_optimizer(round_),
            cfg.local_steps if steps is None else steps,
            cfg.batch_size,
            rng,
            grad_hook=grad_hook,
        )


_CLIENTS: dict[str, type[ClientAlgorithm]] = {}


def register_client(cls: type[ClientAlgorithm]) -> type[ClientAlgorithm]:
    """Class decorator: register a client algorithm under ``cls.name``.

    The class must name its server strategy itself (``server = "..."`` in its own
    body), so which server serves which client is read where the client is written.
    """
    if cls.name in _CLIENTS:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    if not isinstance(cls.__dict__.get("server"), str):
        raise TypeError(
            f"{cls.__name__} must name its server strategy in its class body, "
            f'e.g. server = "fedavg" (cloud_aggregator.aggregation.strategies)'
        )
    _CLIENTS[cls.name] = cls
    return cls


def client_class(algorithm: str) -> type[ClientAlgorithm]:
    """The client algorithm class registered under ``algorithm``; the error lists valid names."""
    try:
        return _CLIENTS[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(_CLIENTS)}") from None


def algorithm_names() -> list[str]:
    """The names :func:`client_class` accepts, sorted."""
    return sorted(_CLIENTS)


def make_client(spec: TaskSpec) -> ClientAlgorithm:
    """The client algorithm named by ``spec.algorithm``; the error lists valid names."""
    return client_class(spec.algorithm)(spec)
