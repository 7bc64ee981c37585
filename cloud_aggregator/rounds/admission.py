"""Update admission: the one pipeline every upload passes, in simulation and over MQTT alike.

:meth:`Admission.verdict` judges a device's upload for the open round, :func:`file_verdict` files the verdict
(an ``Update``, a straggler's ``LateUpdate``, or a :class:`Refusal`) in the round's inbox.
``cloud_aggregator.rounds.simulation.SimulatedFleet`` hands it ``UpdateMessage`` objects,
``cloud_aggregator.serve.mqtt_fleet.MqttFleet`` the payload bytes that came with a topic; every
step after decoding is the same code.  A refusal names a :class:`Reason` (data, not text)
and is counted per device in :attr:`Admission.refused`.

Steps, in order (the first failing one names the reason):

decode: ``malformed``
    The payload is not an update message (size, format, version, ids, field types).
    ``no_round``: it arrived while no round was open.
identity: ``impersonation``
    The message names another device than its topic.  Who may publish on a topic is the
    broker's ACL's job; this step keeps the topic and the message in agreement.
task, round and phase: ``wrong_task``, ``stale_round``, ``future_round``, ``wrong_global``
    The message is for another fleet or task, another round, or this round but another
    phase or starting global.  Stale uploads are normal after a restart; they are counted,
    never aggregated.  An upload quoting the previous round exactly is a straggler when the
    request has a ``LateWindow`` (``cloud_aggregator.rounds.stragglers``): it goes on to the
    tensor and replay steps as a ``LateUpdate``.
selection: ``not_selected``
    The server selected the round's participants and this device is not one of them.
compression: ``malformed``
    A task with ``[task.compress]`` takes only uploads compressed as it says, and a task
    without it none; the codes are decoded against what the device was sent
    (``ioft_protocol.compress``) into the parameters every later step judges.
tensors: ``shape_dtype``, ``non_finite``
    Names, shapes or dtypes differ from what the round expects, or a tensor holds NaN or
    Inf (``ioft_protocol.codec.validate_tensors``, the one tensor check).
samples: ``n_samples``
    The sample count weighs the upload (``samples`` weighting): a count above the task's cap
    (``max_samples``, per task in ``task_max_samples``) or above the training rows the device
    reported in its status (``data.train``; a device that reported none is bounded by the cap
    alone) would let one device become the mean.
metrics: ``metrics``, ``non_finite``
    More than ``max_metrics`` metrics, a name longer than ``max_metric_name`` characters, or
    a NaN / infinite value: metrics are stored in the round record and averaged fleet-wide.
replay: ``replay``, ``resent``
    The device already answered this task, round and phase: the first upload stands.  A copy
    of the upload already counted (a QoS 1 redelivery, the re-send of a restarted device or of
    a re-announced round: the same :func:`fingerprint`) is ``resent``, routine and kept apart
    from refusals; another answer is a ``replay``.  A ``stale_round`` upload that is a copy of
    the one counted for that round is ``resent`` too.  Together with the round-field checks above this is
    the whole replay defence: equal tensors are no evidence of a replay, neither across
    devices nor from one device across rounds (a converged model repeats itself).
norm: ``norm``
    ``‖u − g‖₂`` (the change from the parameters the device was sent, over all tensors,
    in float64) above ``max_norm_ratio × r``, where ``r`` is the *median* of the last
    ``history`` accepted change norms of that task and phase (tasks train different
    models: one task's converged steps say nothing of another's first): a running
    reference that a minority of attackers cannot drag up, unlike a mean.  The relative
    bound applies once ``min_history`` norms are known and ``r > 0``.  A reference that
    refuses most of a round (an honest trajectory can speed up by orders of magnitude,
    e.g. leaving a plateau) is stale, not a majority attack: :meth:`Admission.forget_stale`
    drops it when a round would otherwise stall, and the resent uploads are judged afresh.
    Optional absolute bounds ``max_update_norm`` (on ``‖u − g‖``) and ``max_param_norm``
    (on ``‖u‖``) apply always.  Stragglers skip this step.

The norm bound is a coarse filter against absurd uploads (×100 scaling, garbage); a
robust reducer (``cloud_aggregator.aggregation.reducers``) handles subtler poisoning.  Uploads
restored from the store after a restart were admitted once and skip the norm check, so a
restarted aggregator (whose in-memory history is empty) reaches the same decision about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.admission_checks import (
    AdmissionPolicy,
    change_norm,
    check_finite,
    check_layout,
    check_metrics,
    check_round,
    check_samples,
    check_tensors,
    fingerprint,
    param_norm,
    reported_train_rows,
)
from cloud_aggregator.rounds.inbox import ROUND_ANSWERS, Inbox, file_verdict
from cloud_aggregator.rounds.norm_reference import NormReference
from cloud_aggregator.rounds.types import CollectRequest, LateUpdate, Reason, Refusal
from ioft_protocol import codec, compress
from ioft_protocol.codec import TensorSpec
from ioft_protocol.round_messages import UpdateMessage

__all__ = [  # the steps and the inbox live beside it; their importers may name them here
    "ROUND_ANSWERS",
    "Admission",
    "AdmissionPolicy",
    "Inbox",
    "Reason",
    "Refusal",
    "change_norm",
    "check_metrics",
    "check_round",
    "check_samples",
    "check_tensors",
    "file_verdict",
    "fingerprint",
    "param_norm",
    "reported_train_rows",
]


class Admission:
    """The admission pipeline of one fleet, with its state across rounds.

    Parameters
    ----------
    fleet
        The fleet id uploads must name.
    policy
        Bounds of the norm check.
    max_payload_bytes
        Payloads above this size are refused before they are parsed.
    reported_rows
        A device's training rows as it last reported them (its status), ``None`` when unknown:
        the ``samples`` step's per-device bound.
    statuses
        Instead of ``reported_rows``: the devices' statuses as the fleet keeps them (device ->
        status), read here (:func:`reported_train_rows`) without a call back into the fleet.
    """

    def __init__(
        self,
        fleet: str,
        policy: AdmissionPolicy | None = None,
        *,
        max_payload_bytes: int = codec.MAX_PAYLOAD_BYTES,
        reported_rows: Callable[[str], int | None] | None = None,
        statuses: Mapping[str, Mapping] | None = None,
    ) -> None:
        self.fleet = fleet
        self.policy = policy or AdmissionPolicy()
        self.max_payload_bytes = max_payload_bytes
        self.reported_rows = reported_rows
        self.statuses = statuses
        #: device -> reason -> refusals
        self.refused: dict[str, dict[Reason, int]] = {}
        # (task, round, phase) -> device admitted (fresh or late) -> its upload's fingerprint
        # (``None`` where unknown): whoever is in it already answered
        self._answered: dict[tuple[str, int, str], dict[str, int | None]] = {}
        self.norms = NormReference(self.policy)

    # -- the pipeline ---------------------------------------------------------------------
    def count_refusal(self, device: str, reason: Reason) -> None:
        """One more refused upload of ``device`` for ``reason`` (:attr:`refused`, the fleet's counts)."""
        per = self.refused.setdefault(device, {})
        per[reason] = per.get(reason, 0) + 1

    def screen(self, device: str, *, outside: str | None, held_out: bool) -> Refusal | None:
        """The first step, before a payload is read: a held-out device (it scores the global and
        uploads no update) or one outside the task's selection (``outside``: why, from its status)
        is refused ``not_selected`` and counted; ``None``: read on (:meth:`receive`)."""
        if held_out:
            outside = "held out: it scores the global model and uploads no update"
        if outside is None:
            return None
        self.count_refusal(device, Reason.NOT_SELECTED)
        return Refusal(Reason.NOT_SELECTED, outside, sat_out=True)

    def receive(
        self,
        device: str,
        upload: bytes | UpdateMessage,
        request: CollectRequest | None,
        inbox: dict,
        *,
        restored: bool = False,
        outside: str | None = None,
        held_out: bool = False,
    ) -> Update | LateUpdate | Refusal:
        """:meth:`verdict` on ``device``'s upload, then :func:`file_verdict` it in ``inbox``."""
        verdict = self.verdict(device, upload, request, restored=restored, outside=outside, held_out=held_out)
        file_verdict(inbox, device, verdict)
        return verdict

    def verdict(
        self,
        device: str,
        upload: bytes | UpdateMessage,
        request: CollectRequest | None,
        *,
        restored: bool = False,
        outside: str | None = None,
        held_out: bool = False,
    ) -> Update | LateUpdate | Refusal:
        """Judge ``device``'s upload (:meth:`screen`, then :meth:`judge`) and count a refusal.

        The caller files the verdict (:func:`file_verdict`) once the upload is durable; a streaming round
        folds an admitted one first (``cloud_aggregator.aggregation.streaming.RoundFold``).
        """
        screened = self.screen(device, outside=outside, held_out=held_out)  # counted there
        if screened is not None:
            return screened
        verdict = self.judge(device, upload, request, restored=restored)
        if isinstance(verdict, Refusal):
            self.count_refusal(device, verdict.reason)
        return verdict

    def restore_folded(self, request: CollectRequest, devices: list[str]) -> None:
        """Mark ``devices`` as having answered ``request``'s round: a checkpointed fold holds
        their uploads, so a re-send after a restart is a replay."""
        for device in devices:
            self._answer((request.spec.name, request.round, request.phase), device, None)

    def forget_answers(self, task: str, round_: int, phase: str) -> None:
        """Forget who answered a round here: an aggregator worker (``cloud_aggregator.serve.worker_loop``)
        whose coordinator re-announced the round judges re-sends afresh; the coordinator,
        which merges every worker's uploads, refuses the true replays."""
        self._answered.pop((task, round_, phase), None)

    def judge(
        self,
        device: str,
        upload: bytes | UpdateMessage,
        request: CollectRequest | None,
        *,
        restored: bool = False,
    ) -> Update | LateUpdate | Refusal:
        """decode → identity → task/round/phase → selection → tensors → samples → metrics → replay → norm.

        ``device`` is who sent it (the topic's device); ``restored`` marks an upload admitted
        before a restart, read back from the store: it skips the norm check.  Never raises.
        """
        if request is None:
            return Refusal(Reason.NO_ROUND, "update arrived while no round is open")
        if isinstance(upload, UpdateMessage):
            msg = upload
        else:
            try:
                msg = UpdateMessage.decode(upload, max_bytes=self.max_payload_bytes)
            except codec.WireError as exc:
                return Refusal(Reason.MALFORMED, str(exc))
        if msg.device != device:
            return Refusal(Reason.IMPERSONATION, f"payload claims to be from {msg.device!r}")
        task = request.spec.name
        if (msg.fleet, msg.task) != (self.fleet, task):
            return Refusal(Reason.WRONG_TASK, f"update for {msg.fleet}/{msg.task}, not {self.fleet}/{task}")
        off_round = check_round(msg.round, msg.phase, msg.global_hash, request)
        late = request.late
        if off_round is not None:
            if late is None or (msg.round, msg.phase, msg.global_hash) != (
                late.round,
                late.phase,
                late.global_hash,
            ):
                return self._resent(device, msg, (task, msg.round, msg.phase)) or off_round
            return self._judge_late(device, msg, request)
        if request.participants is not None and device not in request.participants:
            return Refusal(Reason.NOT_SELECTED, "device was not selected for this round")
        expected = request.expected_by_device.get(device, request.expected)
        params = self._decompressed(device, msg, request, expected)
        if isinstance(params, Refusal):
            return params
        bad = check_layout(params, expected)
        if bad is not None:
            return bad
        # The change norm is a sum of squares over every value: finite, it says that every value is
        # (what was sent is finite, or it is not and every look is taken), so the look at each
        # value for NaN or Inf is taken only when it is not.
        delta = change_norm(params, self.norms.sent64(device, request))
        finite = math.isfinite(delta)
        bad = None if finite else check_finite(params)
        if bad is None:
            bad = self.check_counts(device, msg, task)
        if bad is not None:
            return bad
        key = (task, request.round, request.phase)
        if device in self._answered.get(key, ()):
            return self._resent(device, msg, key) or Refusal(
                Reason.REPLAY, f"device already answered round {request.round}/{request.phase}"
            )
        if not restored:
            bad = self.check_norm(device, delta, params, request)
            if bad is not None:
                return bad
        self._answer(key, device, fingerprint(msg))  # of the upload as sent: copies match copies
        if finite:
            self.norms.add(task, request.phase, delta)
        return Update(device, params, msg.n_samples, msg.metrics)

    def _decompressed(
        self, device: str, msg: UpdateMessage, request: CollectRequest, expected: Mapping[str, TensorSpec]
    ) -> Mapping[str, np.ndarray] | Refusal:
        """The upload's parameters: as sent, or decoded from the task's compressed form."""
        want = request.spec.compress
        if msg.compress != want:
            return Refusal(
                Reason.MALFORMED,
                f"upload compressed as {msg.compress}, task {request.spec.name!r} takes {want}",
            )
        if want is None or request.spec.secagg is not None:  # masked: the codes travel in the ring
            return msg.params
        sent = self.norms.sent(device, request)
        seed = compress.derive_seed(msg.task, msg.round, msg.phase, device, msg.global_hash)
        try:
            return compress.decode(
                msg.params,
                sent,
                {n: spec.dtype for n, spec in expected.items()},
                compress.CompressConfig.from_json(want),
                seed,
            )
        except ValueError as exc:  # CompressError, or a task's compress table this code cannot read
            return Refusal(Reason.MALFORMED, f"compressed upload: {exc}")

    def _judge_late(self, device: str, msg: UpdateMessage, request: CollectRequest) -> LateUpdate | Refusal:
        """A straggler for ``request.late``: tensors against the open round's, then replay."""
        late = request.late
        if msg.compress is not None:  # configs refuse compress with straggler = 'next_round'
            return Refusal(Reason.MALFORMED, "late update: compressed uploads are not taken late")
        bad = check_tensors(msg.params, request.expected)
        if bad is None:
            bad = self.check_counts(device, msg, request.spec.name)
        if bad is not None:
            return Refusal(bad.reason, f"late update: {bad.detail}")
        key = (request.spec.name, late.round, late.phase)
        if device in late.counted or device in self._answered.get(key, ()):
            return self._resent(device, msg, key) or Refusal(
                Reason.REPLAY, f"device already answered round {late.round}/{late.phase}"
            )
        self._answer(key, device, fingerprint(msg))
        return LateUpdate(Update(device, msg.params, msg.n_samples, msg.metrics), late.round)

    def check_counts(self, device: str, msg: UpdateMessage, task: str) -> Refusal | None:
        """The ``samples`` and ``metrics`` steps."""
        p = self.policy
        if self.reported_rows is not None:
            rows = self.reported_rows(device)
        else:
            rows = reported_train_rows(self.statuses.get(device)) if self.statuses is not None else None
        bad = check_samples(msg.n_samples, p.task_max_samples.get(task, p.max_samples), rows)
        return bad if bad is not None else check_metrics(msg.metrics, p)

    def _answer(self, key: tuple[str, int, str], device: str, print_: int | None) -> None:
        if key not in self._answered:  # rounds before the previous one are closed for good
            task, round_, _ = key
            self._answered = {k: v for k, v in self._answered.items() if k[0] != task or k[1] >= round_ - 1}
        self._answered.setdefault(key, {})[device] = print_

    def _resent(self, device: str, msg: UpdateMessage, key: tuple[str, int, str]) -> Refusal | None:
        """``resent`` if ``msg`` is a copy of the upload ``device`` had admitted for ``key``."""
        kept = self._answered.get(key, {}).get(device)
        if kept is None or kept != fingerprint(msg):
            return None
        return Refusal(Reason.RESENT, f"a copy of the upload counted for round {key[1]}/{key[2]}")

    # -- the norm reference (:class:`~cloud_aggregator.rounds.norm_reference.NormReference`) ----------------
    def check_norm(
        self, device: str, delta: float, params: Mapping[str, np.ndarray], request: CollectRequest
    ) -> Refusal | None:
        """The ``norm`` step for an upload whose change from what ``device`` was sent is ``delta``."""
        return self.norms.check(device, delta, params, request)

    def reference(self, phase: str, task: str) -> float | None:
        """The median of recent accepted change norms of ``task``'s ``phase``; ``None`` until ``min_history``."""
        return self.norms.reference(phase, task)

    def forget_stale(self, request: CollectRequest, admitted: int) -> bool:
        """:meth:`NormReference.forget_stale <cloud_aggregator.rounds.norm_reference.NormReference.forget_stale>`."""
        return self.norms.forget_stale(request, admitted)
