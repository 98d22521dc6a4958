"""The token-level policy's parts, each through its public verbs: the round planner, the
prefill budget, the turn strategies (whole turns, smooth streams) and the step overhead."""
import math

import pytest

from scheduler import SchedulerConfig
from scheduler.request import RequestStatus
from scheduler.smooth_streams import SmoothStreams, WholeTurns
from scheduler.step_overhead import StepOverhead
from test_overload import STEP, _policy, _req


def _streaming(policy, model, rid=None, tbt=0.05, now=0.0):
    """A stream of `model` with its first token out at `now`."""
    r = _req(rid or f"{model}0", model, now, max_tokens=40, tbt=tbt)
    r.first_token_time, r.output_token_ids, r.token_times, r.status = now, [7], [now], RequestStatus.RUNNING
    policy.running[model].append(r)
    return r


def _three_streams():
    """The round planner of a policy whose models a, b and c each stream (TBT 0.5 s)."""
    policy = _policy(models="abc")
    for m in "abc":
        _streaming(policy, m, tbt=0.5)
    return policy.planner


def test_a_round_runs_the_batch_that_ran_longest_ago_first():
    planner = _three_streams()
    planner.ran("a")
    planner.ran("c")
    plan = planner.plan(0.0)
    assert planner.order == ("b", "a", "c") and planner.held == () and set(planner.quotas) == set("abc")
    assert planner.alpha == plan.alpha <= 1
    assert [planner.next_turn() for _ in range(4)] == ["b", "a", "c", None]
    assert planner.next_batch_after("c") == "b"   # the next round's first: b ran longest ago


def test_a_batch_just_started_takes_the_first_turn_of_the_next_round():
    """Its stream's first token is out and its next is due a TBT later: it does not wait a
    round behind batches that had their turns. A prefill that joins a batch moves nothing."""
    planner = _three_streams()
    planner.ran("a")
    planner.ran("b")
    planner.ran("c", prefill=True, starts=True)
    planner.ran("a", prefill=True, starts=False)   # a request joins a's batch
    planner.plan(0.0)
    assert planner.order == ("c", "a", "b")
    assert planner.next_batch_after("b") == "c"


def test_an_overloaded_round_holds_the_batches_that_do_not_fit():
    policy = _policy()   # six streams, 10 ms steps, free switches, TBT 50 ms: alpha = 0.01 N / 0.05
    for m in "abcdef":
        _streaming(policy, m)
    planner = policy.planner
    plan = planner.plan(0.0)
    assert len(planner.order) == 5 and len(planner.held) == 1 and plan.alpha <= 1 < planner.alpha_all
    assert planner.num_held_rounds == 1
    assert {b.model for b in planner.candidates} == set("abcdef")
    off = _policy(SchedulerConfig(overload_control=False))
    for m in "abcdef":
        _streaming(off, m)
    assert off.planner.plan(0.0).alpha > 1 and off.planner.held == () and len(off.planner.order) == 6


def test_a_switch_waits_while_every_waiting_request_can_still_make_its_ttft():
    policy = _policy(models="ab")
    planner = policy.planner
    policy.add_request(_req("b0", "b", 0.0, ttft=10.0))
    assert planner.switch_due(0.0)   # nothing decodes: a switch is always due
    _streaming(policy, "a")
    planner.forget_due()
    assert [g.model for g in planner.pending_groups({"a"}, 0.0)] == ["b"]
    assert not planner.switch_due(0.0) and planner.switch_due(9.9)
    policy.add_request(_req("b1", "b", 0.0, ttft=0.01))
    planner.forget_due()
    assert planner.switch_due(0.0)   # a tight TTFT: due at once


def test_the_prefill_bucket_earns_with_decode_up_to_a_round_and_spends_with_prefill():
    budget = _policy(models="a").prefill
    budget.start_round(budget_s=0.1, alpha=0.5)   # a decode second earns 1 / 0.5 - 1 = 1 s
    budget.earn(0.03)
    assert budget.credit_s == pytest.approx(0.03)
    budget.earn(1.0)
    assert budget.credit_s == pytest.approx(0.1)   # capped at the round's budget
    budget.spend(0.25)
    budget.start_round(budget_s=0.05, alpha=1.2)   # overloaded: decode earns nothing
    budget.earn(1.0)
    assert budget.credit_s == pytest.approx(-0.15)


def test_an_idle_device_admits_a_whole_group_and_resets_the_credit():
    policy = _policy(models="ab")
    for i in range(3):
        policy.add_request(_req(f"b{i}", "b", 0.0))
    policy.prefill.earn(1.0)
    assert policy.prefill.admissible("b", 0.0) == ["b0", "b1", "b2"] and policy.prefill.credit_s == 0.0
    assert policy.prefill.within_credit("b", ["b0", "b1", "b2"]) == ["b0"]   # its first always goes


def test_smooth_streams_run_a_free_round_in_slices_and_whole_turns_do_not():
    policy = _policy(SchedulerConfig(smooth_streams=True), models="ab")
    policy.set_resident({"a", "b"})
    for m in "ab":
        _streaming(policy, m, tbt=0.5)
    assert isinstance(policy.turns, SmoothStreams)
    policy.planner.plan(0.0)
    quotas = policy.planner.quotas
    policy.turns.start_round(policy.planner.order, quotas, alpha=0.1, held=False)
    first = policy.planner.next_turn()
    assert policy.turns.turn_s(first, quotas[first]) == pytest.approx(STEP)   # one step: no turn cost to amortise
    assert policy.planner.order[-1] == first   # the rest of its quota comes back at the round's end
    assert policy.turns.rotation_s == pytest.approx(2 * STEP)
    policy.turns.start_round(policy.planner.order, quotas, alpha=0.9, held=False)   # no room to spare
    assert policy.turns.turn_s("a", quotas["a"]) == quotas["a"] and math.isinf(policy.turns.rotation_s)
    whole = WholeTurns()
    assert whole.turn_s("a", 0.04) == 0.04 and not whole.decode_first and math.isinf(whole.rotation_s)


def test_step_overhead_is_the_gap_between_schedule_calls_less_the_steps():
    overhead = StepOverhead()
    overhead.scheduled(0.0, decode=True, num_steps=2)
    overhead.stepped(0.01)
    overhead.stepped(0.01)
    assert overhead.observe(0.024)   # it ran both its steps; 2 ms of overhead each
    assert overhead.step_s == pytest.approx(0.05 * 0.002)
    overhead.scheduled(1.0, decode=True, num_steps=4)
    overhead.stepped(0.01)
    assert not overhead.observe(1.012)   # a run cut short
    overhead.scheduled(2.0, decode=False, num_steps=1)
    overhead.idle()
    assert not overhead.observe(5.0)   # the device went idle: no sample
