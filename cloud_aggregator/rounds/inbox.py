"""A round's inbox and the one way a verdict of admission (``cloud_aggregator.rounds.admission``) is
filed in it."""

from __future__ import annotations

from cloud_aggregator.aggregation.update import Update
from cloud_aggregator.rounds.types import LateUpdate, Reason, Refusal, Rejection

#: Refusals of an upload that is the device's answer to the open round: the round records the
#: device as rejected (unless it has an admitted upload).  The others concern another round,
#: device or task, or repeat an answer, and are only counted.
ROUND_ANSWERS = frozenset(
    {
        Reason.MALFORMED,
        Reason.NOT_SELECTED,
        Reason.SHAPE_DTYPE,
        Reason.NON_FINITE,
        Reason.NORM,
        Reason.N_SAMPLES,
        Reason.METRICS,
    }
)


class Inbox(dict):
    """A round's inbox, ``{device: Update | Rejection}`` and ``{("late", device): LateUpdate}``, that
    knows which devices have an admitted ``Update``: a round asks ``answered`` in O(1) instead of
    scanning N entries every turn (``cloud_aggregator.rounds.collector``)."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: set[str] = set()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if isinstance(value, Update):
            self.answered.add(key)
        else:
            self.answered.discard(key)


def file_verdict(inbox: dict, device: str, verdict: Update | LateUpdate | Refusal) -> None:
    """File ``device``'s verdict in the round's ``inbox``: the one way a verdict is filed.

    A refusal of the device's answer to the open round (``ROUND_ANSWERS``) is filed as a
    ``Rejection`` unless the device has an admitted upload there; other refusals, and a device
    screened out (it sat the round out: the fleet says so in its ``SatOut``), are only counted.
    A late update is filed under ``("late", device)``, beside the device's fresh one.
    """
    if isinstance(verdict, Refusal):
        if (
            verdict.reason in ROUND_ANSWERS
            and not verdict.sat_out
            and not isinstance(inbox.get(device), Update)
        ):
            inbox[device] = Rejection(device, str(verdict))
    elif isinstance(verdict, LateUpdate):
        inbox[("late", device)] = verdict
    else:
        inbox[device] = verdict
