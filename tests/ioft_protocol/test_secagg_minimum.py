"""A SecAgg round never reveals a sum of fewer than ``min_participants`` devices: the server abandons
such a round, and a device (whose own floor no task lowers) sends no masked input to it."""

from __future__ import annotations

import pytest

from ioft_protocol.secagg import AbandonReason, ClientSecAgg, SecAggConfig, SecAggRefusedError, ServerSecAgg
from ioft_protocol.secagg.messages import NeighbourKeys, Setup, UnmaskRequest
from ioft_protocol.secagg.simulate import run_round

from .secagg_fixtures import fleet

CFG = SecAggConfig(threshold=0.6, clip=2.0, bits=16, max_weight=50.0)


@pytest.mark.parametrize("n", [1, 2])
def test_the_server_abandons_a_round_of_fewer_devices_than_the_minimum(n):
    updates, weights = fleet(n, 6)
    run = run_round(CFG, updates, weights)
    assert run.outcome.reason is AbandonReason.TOO_FEW_PARTICIPANTS
    assert "min_participants is 3" in run.outcome.detail
    assert run.view["keys"] == {}  # nothing was sent, nothing answered


def test_a_round_that_shrinks_below_the_minimum_is_abandoned_before_anything_is_unmasked():
    updates, weights = fleet(3, 6)
    loose = SecAggConfig(threshold=0.51, clip=2.0, bits=16, max_weight=50.0)  # 2 of 3 holders rebuild
    run = run_round(loose, updates, weights, drop={"masked": {"dev-002"}})
    assert (
        run.outcome.reason is AbandonReason.TOO_FEW_PARTICIPANTS and "2 masked inputs" in run.outcome.detail
    )
    # A task that lowers its minimum to 2 still meets the devices' own floor (3): they refuse to
    # unmask a sum of two, and the round ends without one.
    lowered = SecAggConfig(threshold=0.51, clip=2.0, bits=16, max_weight=50.0, min_participants=2)
    run = run_round(lowered, updates, weights, drop={"masked": {"dev-002"}})
    assert run.outcome.reason is AbandonReason.TOO_FEW_UNMASK


def test_the_task_minimum_is_checked_and_kept_out_of_specs_at_its_default():
    with pytest.raises(ValueError) as err:
        SecAggConfig(min_participants=1)
    assert all(noun in str(err.value) for noun in ("min_participants 1", ">= 2")), err.value
    assert "min_participants" not in SecAggConfig().to_json()
    assert SecAggConfig.from_json({"min_participants": 5}).min_participants == 5
    assert CFG.round_params(4, 3).min_participants == 3


def test_a_device_refuses_a_round_below_its_own_floor_whatever_the_server_says():
    p = CFG.round_params(2, 6).to_json()
    lowered = {**p, "min_participants": 1}  # a server that lowers the task's minimum
    with pytest.raises(SecAggRefusedError, match="minimum of 3 participants"):
        ClientSecAgg("dev-000").setup(Setup("s", lowered, ["dev-001"]))
    with pytest.raises(SecAggRefusedError, match="minimum of 3"):
        ClientSecAgg("dev-000").setup(Setup("s", CFG.round_params(1, 6).to_json(), []))  # alone
    # The setup names enough neighbours, but only one sends keys: no shares, no masked input.
    c = ClientSecAgg("dev-000")
    c.setup(Setup("s", CFG.round_params(3, 6).to_json(), ["dev-001", "dev-002"]))
    other = ClientSecAgg("dev-001")
    keys = other.setup(Setup("s", CFG.round_params(3, 6).to_json(), ["dev-000", "dev-002"]))
    with pytest.raises(SecAggRefusedError, match="2 devices sent keys"):
        c.share_keys(NeighbourKeys({"dev-001": [keys.c_pk, keys.s_pk]}))
    # A device whose floor is 4 refuses a round of 3 the task allows.
    with pytest.raises(SecAggRefusedError, match="minimum of 4"):
        ClientSecAgg("dev-000", min_participants=4).setup(
            Setup("s", CFG.round_params(3, 6).to_json(), ["dev-001", "dev-002"])
        )


def test_a_device_refuses_to_unmask_a_sum_of_too_few_survivors():
    updates, weights = fleet(4, 6)
    run = run_round(CFG, updates, weights, drop={"unmask": set(updates)})  # stop before unmasking
    c = run.clients["dev-000"]
    others = sorted(set(updates) - {"dev-000"})
    with pytest.raises(SecAggRefusedError):
        c.unmask(UnmaskRequest(survivors=["dev-000", others[0]], dropped=others[1:]))


def test_the_server_sends_nothing_to_too_few_devices():
    srv = ServerSecAgg(CFG, ["a", "b"], session="s", length=3)
    assert srv.setup() == {} and srv.outcome.reason is AbandonReason.TOO_FEW_PARTICIPANTS
