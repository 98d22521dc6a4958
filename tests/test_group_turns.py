"""A tensor-parallel group's turns in the rounds of a device that follows it (a member: the
group's leader decides its steps; scheduler/group_turns.py). The member's token-level policy
is told each decode step the group ran on its device (`group_stepped`), and its round counts
the group as one more batch: alpha and the quotas see the group's share of the device, its
own batches keep quotas from their own TBT SLOs, overload control holds its own batches,
never the group, and a group that stopped stepping leaves the rounds. Pure Python."""
import pytest

from scheduler.group_turns import ACTIVE_TBTS
from test_overload import _policy
from test_token_level_parts import _streaming

TBT = 0.05
GROUP_STEP = 0.02


def _member(models: str):
    policy = _policy(models=models)
    for m in models:
        _streaming(policy, m, tbt=TBT)
    return policy


def test_a_followed_group_takes_its_share_of_the_round():
    alone = _member("ab").planner.plan(0.0)
    policy = _member("ab")
    for k in range(5):
        policy.group_stepped("big", TBT, GROUP_STEP, now=k * GROUP_STEP)
    planner = policy.planner
    plan = planner.plan(5 * GROUP_STEP)
    assert plan.alpha == pytest.approx(alone.alpha + GROUP_STEP / TBT)   # the group's steps per TBT budget
    assert "big" in plan.models and set(planner.order) == set(planner.quotas) == {"a", "b"}
    assert planner.held == ()
    # the device's own batches keep their quotas (each a few of its own steps): the group
    # lengthens the round, not their turns
    assert planner.quotas == pytest.approx(dict(zip(alone.models, alone.quota.quotas_s)))


def test_overload_holds_the_devices_own_batches_never_the_group():
    """Six own streams and a group that needs 60% of the device: the round keeps the group
    and serves the own batches that still fit beside it."""
    unfollowed = _member("abcdef")
    unfollowed.planner.plan(0.0)
    policy = _member("abcdef")
    policy.group_stepped("big", TBT, 3 * GROUP_STEP / 2, now=0.0)
    planner = policy.planner
    plan = planner.plan(0.0)
    assert "big" in plan.models and "big" not in planner.held and "big" not in planner.order
    assert plan.alpha <= 1 < planner.alpha_all
    assert len(planner.order) < len(unfollowed.planner.order)
    assert set(planner.order) | set(planner.held) == set("abcdef")


def test_a_group_that_stopped_stepping_leaves_the_rounds():
    alone = _member("ab").planner.plan(0.0)
    policy = _member("ab")
    policy.group_stepped("big", TBT, GROUP_STEP, now=0.0)
    assert policy.planner.plan(ACTIVE_TBTS * TBT / 2).alpha > alone.alpha
    later = policy.planner.plan(ACTIVE_TBTS * TBT * 1.01)
    assert "big" not in later.models and later.alpha == pytest.approx(alone.alpha)


def test_a_group_step_must_have_a_time_and_an_slo():
    policy = _member("a")
    for tbt, step in ((0.0, GROUP_STEP), (TBT, 0.0), (float("nan"), GROUP_STEP)):
        with pytest.raises(ValueError, match="big"):
            policy.group_stepped("big", tbt, step, now=0.0)
