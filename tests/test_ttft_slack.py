"""TTFT slack (scheduler/ttft_slack.py): a switch waits while every waiting request can still
make its TTFT, and is made once one would not. The pure rule, then the token-level policy on
the fake engine of test_scheduler."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from scheduler.scheduler_config import admission_alpha
from scheduler.ttft_slack import SAFETY, PendingGroup, due_groups, latest_start, switch_due
from test_overload import STEP, _policy, _req
from test_scheduler import FakeEngine

_group = st.builds(PendingGroup, st.sampled_from("abcdef"), st.floats(0.0, 20.0), st.floats(0.0, 2.0))


@settings(max_examples=300, deadline=None)
@given(st.lists(_group, max_size=8), st.floats(0.0, 20.0), st.floats(0.0, 3.0))
def test_a_switch_waits_only_while_edf_from_after_the_margin_meets_every_deadline(groups, now, margin):
    """Not due: serving the groups one after another in deadline order, starting once the
    device is free (now + margin) and each taking SAFETY x its predicted cost, meets every
    deadline. Due: that schedule misses one (the latest start has come)."""
    t, met = now + margin, True
    for g in sorted(groups, key=lambda g: (g.deadline_s, g.model)):
        t += SAFETY * g.cost_s
        met = met and t <= g.deadline_s + 1e-9
    due = switch_due(groups, now, margin)
    if not due:
        assert met
    elif groups:
        assert not met or math.isclose(now + margin, latest_start(groups), abs_tol=1e-9)
    assert switch_due(groups, now + 1.0, margin) or not due   # once due, due later too


@settings(max_examples=300, deadline=None)
@given(st.lists(_group, max_size=8), st.floats(0.0, 20.0), st.floats(0.0, 3.0))
def test_only_the_groups_that_must_start_now_are_due(groups, now, margin):
    """The due groups are a prefix of the deadline order: the shortest one that holds every
    group whose latest start (its deadline less SAFETY x the costs up to it) has come. The
    groups after it can still wait: served after the prefix, starting once the device is
    free, each meets its deadline."""
    order = sorted(groups, key=lambda g: (g.deadline_s, g.model))
    due = due_groups(groups, now, margin)
    assert due == order[: len(due)] and bool(due) == switch_due(groups, now, margin)
    spent = 0.0
    for k, g in enumerate(order):
        spent += SAFETY * g.cost_s
        if k >= len(due):
            assert now + margin < g.deadline_s - spent
    if due:   # its last group is one whose latest start has come
        assert now + margin >= due[-1].deadline_s - SAFETY * sum(g.cost_s for g in due)


def test_no_waiting_group_never_forces_a_switch():
    assert latest_start([]) == math.inf and not switch_due([], 1e9, 10.0)
    with pytest.raises(ValueError):
        PendingGroup("a", 1.0, -0.1)


# -- the policy ------------------------------------------------------------------------------

_arrival = st.tuples(st.floats(0.0, 2.0), st.sampled_from("bcdef"), st.integers(1, 24), st.integers(1, 20),
                     st.floats(0.2, 3.0))


@settings(max_examples=25, deadline=None)
@given(st.lists(_arrival, min_size=1, max_size=6))
def test_the_running_batch_keeps_the_device_until_a_deadline_nears_and_every_ttft_is_met(arrivals):
    """One long stream of a decodes (TBT 0.1 s, 10 ms steps, all resident: switches free);
    a few requests of other models arrive with TTFT SLOs of 0.2-3 s. The device stays with a
    (once it decodes) until the earliest waiting deadline is within the margin (a round of a lone batch, 4 steps,
    plus a run of 8) and SAFETY x the waiting prefills; and every request makes its TTFT."""
    policy = _policy(models="abcdef")
    reqs = [(0.0, _req("long", "a", 0.0, max_tokens=400, tbt=0.1, ttft=1.0))]
    reqs += [(t, _req(f"r{i}", m, t, max_tokens=n, prompt=p, tbt=0.1, ttft=ttft))
             for i, (t, m, p, n, ttft) in enumerate(arrivals)]
    engine = FakeEngine(policy, step_s=lambda out: 0.005 + 1e-4 * out.num_new_tokens if out.is_prefill else STEP,
                        resident=set(policy.models))
    pending, first_switch = sorted(reqs, key=lambda x: x[0]), None
    while True:
        while pending and pending[0][0] <= engine.now:
            policy.add_request(pending.pop(0)[1])
        waiting = [r for m, q in policy.waiting.items() if m != "a" for r in q]
        decoding, start = bool(policy.running["a"]), engine.now
        step = engine.step()
        if step is None:
            if not pending:
                break
            engine.now = pending[0][0]
            continue
        if first_switch is None and decoding and step[0].model != "a":
            first_switch = (start, waiting)
    assert not policy.has_unfinished()
    for _, r in reqs:
        assert r.first_token_time <= r.arrival_time + r.slo.ttft_s + 1e-9, (r.request_id, r.first_token_time)
    if first_switch is not None:
        now, waiting = first_switch
        costs = sum(SAFETY * (0.005 + 1e-4 * r.num_prompt_tokens) for r in waiting)
        # a round of a alone (4 steps), a run (8), and the round once the group joins (two
        # turns of at most a run each): its tokens' deadlines need that much before its TTFT's
        margin = 4 * STEP + 8 * STEP + 2 * 8 * STEP
        assert min(r.arrival_time + r.slo.ttft_s for r in waiting) - now <= margin + costs + STEP


def _a_decoding(config=None, steps=3):
    """Model a's long stream decoding alone (all resident), after `steps` steps."""
    policy = _policy(config, models="ab")
    engine = FakeEngine(policy, step_s=lambda out: 0.005 if out.is_prefill else STEP, resident={"a", "b"})
    policy.add_request(_req("long", "a", 0.0, max_tokens=200, tbt=0.1, ttft=1.0))
    for _ in range(steps):
        engine.step()
    return policy, engine


def test_at_a_tight_ttft_a_new_model_starts_at_the_next_turn_boundary():
    """TTFT 0.05 s leaves no slack: b is prefilled after a's run, not after a finishes."""
    policy, engine = _a_decoding()
    policy.add_request(_req("b0", "b", engine.now, max_tokens=5, tbt=0.1, ttft=0.05))
    started = engine.now
    while not any(out.model == "b" for out in engine.trace):
        engine.step()
    assert engine.now - started <= 8 * STEP + 0.005 + 1e-9
    # the same request with a loose TTFT waits while a decodes: it has the time
    policy, engine = _a_decoding()
    policy.add_request(_req("b0", "b", engine.now, max_tokens=5, tbt=0.1, ttft=10.0))
    for _ in range(10):
        engine.step()
    assert all(out.model == "a" for out in engine.trace)


def test_the_ablation_switches_at_once():
    policy, engine = _a_decoding(SchedulerConfig(ttft_slack=False), steps=1)
    policy.add_request(_req("b0", "b", engine.now, max_tokens=5, tbt=0.1, ttft=10.0))
    for _ in range(3):
        engine.step()
    assert any(out.model == "b" for out in engine.trace)


def _first_token_of_b(measure):
    """b arrives (TTFT 1 s) while a's long stream decodes: when its first token comes."""
    policy, engine = _a_decoding(SchedulerConfig(slo_measure=measure))
    arrival = engine.now
    b = _req("b0", "b", arrival, max_tokens=5, tbt=0.1, ttft=1.0)
    policy.add_request(b)
    while b.first_token_time is None:
        engine.step()
    return b.first_token_time - arrival


def test_under_per_token_deadlines_a_first_token_leaves_half_its_ttft_to_its_stream():
    """Mean TPOT (the default): b's switch waits until its TTFT deadline nears, since a late
    first token costs its stream nothing later. Per-token deadlines: a first token on its
    deadline would leave the stream no slack, so it is planned by half the budget."""
    waited = _first_token_of_b("mean_tpot")
    assert 0.5 < waited <= 1.0
    assert _first_token_of_b("per_token") <= 0.5 + 1e-9
    with pytest.raises(ValueError):
        SchedulerConfig(slo_measure="p99")


def test_admission_keeps_alpha_headroom_only_where_streams_bank_no_reserve():
    """Overload control admits a new batch while the next round's alpha <= admission_alpha:
    headroom under mean TPOT, none under per-token deadlines (the TTFT reserve is the headroom);
    an explicit admission_alpha wins."""
    assert admission_alpha(SchedulerConfig()) == 0.6
    assert admission_alpha(SchedulerConfig(slo_measure="per_token")) == 1.0
    assert admission_alpha(SchedulerConfig(slo_measure="per_token", admission_alpha=0.8)) == 0.8
    with pytest.raises(ValueError, match="admission_alpha"):
        SchedulerConfig(admission_alpha=1.5)
