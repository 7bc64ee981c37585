"""The device's SecAgg sessions over MQTT: masks its update instead of uploading it in the clear.

When a task's spec has ``secagg``, the daemon uploads its round answer without parameters
(sample count and metrics only: the aggregator learns who is ready) and :meth:`arm`\\ s this
object with the update vector.  The aggregator then drives the four SecAgg stages on
``.../secagg/down/<device>``; each request is answered on ``.../secagg/up/<device>`` by the
round's :class:`~ioft_protocol.secagg.ClientSecAgg`.

``IOFT_SECAGG_FAULT=<stage>[@<task>]`` (``setup``, ``neighbour_keys``, ``inbox`` or
``unmask``) makes the process kill itself (SIGKILL) when that stage's request (of that task)
arrives: a device lost mid-round, for the end-to-end tests.  Unset, it costs one lookup.

A session id is answered once.  A lying aggregator that sends the setup of a session this
device already answered (to have it re-key and send a second masked input of the same update)
is refused in one line, and so is any stage it repeats within a session.  The answered ids are
kept in ``<state_dir>/secagg-answered.json`` (the newest :data:`MAX_ANSWERED`), written before
the keys leave, so a restarted daemon does not answer one again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from edge.config import DeviceConfig
from ioft_protocol.config import ConfigError
from ioft_protocol.secagg import ClientSecAgg, SecAggRefusedError
from ioft_protocol.secagg.config import MIN_PARTICIPANTS
from ioft_protocol.secagg.identity import FleetTrust, KeySigner
from ioft_protocol.secagg.messages import SecAggWireError
from ioft_protocol.secagg.transport import ANSWERS, REQUESTS, Envelope, SecAggTopic, key_scope, topic_up
from ioft_protocol.state import atomic_write_json

log = logging.getLogger(__name__)
FAULT_ENV = "IOFT_SECAGG_FAULT"
ANSWERED_FILE = "secagg-answered.json"
MAX_ANSWERED = 1024
"""Session ids remembered: a few per round, so months of rounds; an id older than these belongs
to a round the device no longer holds an update for, and it answers nothing for that."""


class AnsweredSessions:
    """The SecAgg session ids this device sent keys for, newest last, bounded, kept on disk.

    Parameters
    ----------
    path
        The file (``None``: in memory only, as in unit tests).
    limit
        How many ids are kept.
    """

    def __init__(self, path: Path | None, limit: int = MAX_ANSWERED) -> None:
        self.path, self.limit = path, limit
        self._ids: list[str] = []
        if path is None or not path.exists():
            return
        try:
            ids = json.loads(path.read_text(encoding="utf-8"))["answered"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("answered is not a list of session ids")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("%s unreadable (%s); starting without the answered SecAgg sessions", path, exc)
            return
        self._ids = ids[-limit:]

    def __contains__(self, session: str) -> bool:
        return session in self._ids

    def add(self, session: str) -> None:
        """Remember ``session``, on disk before returning (an ``OSError`` means: do not answer)."""
        ids = [*self._ids, session][-self.limit :]
        if self.path is not None:
            atomic_write_json(self.path, {"answered": ids})
        self._ids = ids


class SecAggIdentity(TypedDict):
    signer: KeySigner | None
    trust: FleetTrust | None
    require_signed: bool


def secagg_identity(config: DeviceConfig) -> SecAggIdentity:
    """What signs this device's SecAgg keys and checks its neighbours', from device.toml's ``[tls]``.

    A certificate issued to another name (a swarm's virtual devices share one) signs nothing: its
    signature would be refused by every neighbour.

    Raises
    ------
    ConfigError
        A certificate, key or CA file that does not load as one.
    """
    tls = config.tls
    signer = trust = None
    try:
        if tls is not None and tls.cert_file is not None and tls.key_file is not None:
            signer = KeySigner.load(tls.cert_file, tls.key_file)
            signer = signer if signer.name == config.device else None
        if tls is not None:
            trust = FleetTrust.load(tls.ca_file)
    except ValueError as exc:
        raise ConfigError("device.toml [tls]", [str(exc)]) from None
    return SecAggIdentity(signer=signer, trust=trust, require_signed=config.demands_signed_secagg_keys)


@dataclass
class _Pending:
    round: int
    phase: str
    update: np.ndarray
    weight: float
    client: ClientSecAgg | None = None
    session: str | None = None
    stages: set[str] = field(default_factory=set)  # the stages of the session answered


class SecAggDevice:
    """This device's SecAgg state, per task: at most one armed round each.

    One session per (task, round, phase): the first ``setup`` of a round fixes its session, and
    a second one is refused (logged), however the round was armed: the difference of two sums
    over one round is one device's update.  Kept in memory: a restarted daemon arms no round it
    answered before the restart (it re-sends the stored upload without arming), so it answers no
    session for it.  ``min_participants`` is the device's floor (device.toml
    ``secagg_min_participants``), which no task's parameters lower.  ``signer`` and ``trust``
    (its certificate and key, the fleet CA) sign its keys and check its neighbours';
    ``require_signed`` (device.toml ``secagg_signed_keys``) demands signed keys in every round.
    """

    def __init__(
        self,
        fleet: str,
        device: str,
        publish: Callable[[str, bytes], None],
        *,
        min_participants: int = MIN_PARTICIPANTS,
        signer: KeySigner | None = None,
        trust: FleetTrust | None = None,
        require_signed: bool = False,
        answered: Path | None = None,
    ) -> None:
        self.fleet = fleet
        self.device = device
        self.min_participants = min_participants
        self.signer = signer
        self.trust = trust
        self.require_signed = require_signed
        self._publish = publish
        self._pending: dict[str, _Pending] = {}
        #: (task, round, phase) -> the one session this device answered for it
        self._sessions: dict[tuple[str, int, str], str] = {}
        #: every session id it sent keys for (``answered``: the file that keeps them over restarts)
        self._answered = AnsweredSessions(answered)

    def arm(self, task: str, round_: int, phase: str, update: np.ndarray, weight: float) -> None:
        """Hold ``update`` (the change from the global, or its compressed codes) for ``task``'s round until the server asks."""
        # integer codes (a compressed task) stay integers; a change is float64
        update = np.asarray(update)
        update = update if update.dtype.kind in "ui" else update.astype(np.float64)
        self._pending[task] = _Pending(round_, phase, update, weight)

    def handle(self, topic: SecAggTopic, payload: bytes) -> None:
        """Answer one request of the server; a bad or unexpected one is logged and dropped."""
        try:
            env = Envelope.decode(payload)
            request = env.open(REQUESTS)
        except SecAggWireError as exc:
            log.warning("%s: dropped a SecAgg message on task %s: %s", self.device, topic.task, exc)
            return
        fault = os.environ.get(FAULT_ENV)
        if fault is not None and fault in (env.stage, f"{env.stage}@{topic.task}"):
            log.warning("%s: %s=%s: dying at this stage", self.device, FAULT_ENV, fault)
            os.kill(os.getpid(), signal.SIGKILL)
        pending = self._session(topic.task, env)
        if pending is None:
            return
        answer = self._answer(topic.task, env, request, pending)
        if answer is None:
            return
        reply = Envelope(env.session, env.round, env.phase, env.stage, answer.encode())
        pending.stages.add(env.stage)
        self._publish(topic_up(self.fleet, topic.task, self.device), reply.encode())
        if env.stage == "unmask":
            del self._pending[topic.task]  # answered once; the update is forgotten

    def _session(self, task: str, env: Envelope) -> _Pending | None:
        """The held update whose session ``env`` belongs to (a setup opens it), or ``None`` (logged):
        no update for that round, a session refused or unknown, a stage answered already."""
        pending = self._pending.get(task)
        if pending is None or (pending.round, pending.phase) != (env.round, env.phase):
            log.info(
                "%s: SecAgg %s for task %s round %d, which it holds no update for",
                self.device,
                env.stage,
                task,
                env.round,
            )
            return None
        if env.stage == "setup" and not self._first_session(task, env):
            return None
        if env.stage == "setup" and not self._new_session(task, env):
            return None
        if env.stage == "setup":
            pending.client = ClientSecAgg(
                self.device,
                min_participants=self.min_participants,
                signer=self.signer,
                trust=self.trust,
                require_signed=self.require_signed,
                scope=key_scope(self.fleet, task, env.round, env.phase),
            )
            pending.session = env.session
        if pending.client is None or env.session != pending.session:
            log.info("%s: SecAgg %s of an unknown session %s", self.device, env.stage, env.session)
            return None
        if env.stage in pending.stages:
            log.warning(
                "%s: task %s round %d: refused SecAgg %s of session %s: already answered (each stage "
                "is answered once)",
                self.device,
                task,
                env.round,
                env.stage,
                env.session,
            )
            return None
        return pending

    def _answer(self, task: str, env: Envelope, request: Any, pending: _Pending) -> Any:
        """The client's answer to the stage's ``request``, or ``None`` where it refuses (logged)."""
        c = pending.client
        assert c is not None
        try:
            if env.stage == "setup":
                answer = c.setup(request)
            elif env.stage == "neighbour_keys":
                answer = c.share_keys(request)
            elif env.stage == "inbox":
                answer = c.masked_input(request, pending.update, pending.weight)
            else:
                answer = c.unmask(request)
        except (SecAggRefusedError, ValueError) as exc:  # ValueError: an update of the wrong length
            log.warning(
                "%s: task %s round %d: refused SecAgg %s: %s", self.device, task, env.round, env.stage, exc
            )
            return None
        if env.stage == "neighbour_keys" and c.signed:
            log.info(
                "%s: task %s round %d: SecAgg keys of %s signed by their fleet certificates",
                self.device,
                task,
                env.round,
                ", ".join(sorted(request.keys)),
            )
        if not isinstance(answer, ANSWERS[env.stage]):
            raise TypeError(f"stage {env.stage} answered with {type(answer).__name__}")
        return answer

    def _new_session(self, task: str, env: Envelope) -> bool:
        """Whether ``env`` (a setup) is of a session never answered; remembered (on disk) if so."""
        if env.session in self._answered:
            log.warning(
                "%s: task %s round %d: refused SecAgg session %s: it answered that session already "
                "(a repeated session would have it re-key and mask its update a second time)",
                self.device,
                task,
                env.round,
                env.session,
            )
            return False
        try:
            self._answered.add(env.session)
        except OSError as exc:  # unrecorded, it could be answered again after a restart: not at all
            log.error(
                "%s: SecAgg session %s not answered: cannot record it (%s)", self.device, env.session, exc
            )
            return False
        return True

    def _first_session(self, task: str, env: Envelope) -> bool:
        """Whether ``env`` (a setup) opens the round's first session; a second is refused, logged."""
        key = (task, env.round, env.phase)
        first = self._sessions.setdefault(key, env.session)
        if first != env.session:
            log.warning(
                "%s: task %s round %d %s: refused SecAgg session %s, it answered session %s for this "
                "round (one session per round: two sums would give away its update)",
                self.device,
                task,
                env.round,
                env.phase,
                env.session,
                first,
            )
            return False
        # rounds before the previous one of this task are closed: forget their sessions
        self._sessions = {k: v for k, v in self._sessions.items() if k[0] != task or k[1] >= env.round - 1}
        return True
