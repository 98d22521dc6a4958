"""Overload control of the token-level policy: the largest set of batches that fits, the
rest held; admission by TTFT deadline; nothing starves. Pure functions and a fake engine."""
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import SLO, Request, SamplingParams, SchedulerConfig, StepLatencyEstimator, TokenLevelPolicy
from scheduler import deadlines
from scheduler.request import RequestStatus
from dataclasses import replace

from scheduler.overload import BatchLoad, RoundRule, admits, plan_round, prefill_budget, priority, select_round
from test_scheduler import SHAPE_A, SHAPE_B, TIGHT_TTFT, FakeEngine, all_free, make_policy

RULE = RoundRule(quota_max_s=4.0, min_quota_steps=4, switch_factor=8.0)


def load(model, step=0.01, tbt=0.05, switch=0.002, slack=1.0):
    return BatchLoad(model, tbt, step, switch, slack)


def test_every_batch_is_served_while_the_round_fits():
    plan = select_round([load("a"), load("b"), load("c")], RULE)
    assert set(plan.models) == {"a", "b", "c"} and plan.held == () and plan.alpha <= 1


def test_overload_serves_the_least_slack_batches_that_fit_and_holds_the_rest():
    # n = TBT / step = 5 per batch: at most four fit (alpha = 1/40 + k/5 <= 1)
    batches = [load(m, slack=s) for m, s in zip("abcdef", [0.5, 0.1, 0.3, 0.9, 0.2, 0.4])]
    everyone = plan_round(batches, RULE)
    assert everyone.alpha > 1
    plan = select_round(batches, RULE)
    assert plan.models == ("b", "e", "c", "f") and set(plan.held) == {"a", "d"}
    assert plan.alpha <= 1
    # first fit: a smaller batch further down the slack order still joins when it fits
    small = select_round(batches[:5] + [load("g", step=0.001, slack=5.0)], RULE)
    assert "g" in small.models and "d" in small.held


_batch = st.builds(
    lambda i, step, tbt, switch, slack, waiting: BatchLoad(f"m{i}", tbt, step, switch, slack, waiting),
    st.integers(0, 9), st.floats(1e-4, 0.2), st.floats(1e-3, 0.5), st.sampled_from([0.0, 1e-3, 0.05, 2.0]),
    st.floats(-1.0, 2.0), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_batch, min_size=1, max_size=9, unique_by=lambda b: b.model),
       st.sets(st.sampled_from([f"m{i}" for i in range(10)])), st.sampled_from([1, 4]),
       st.sampled_from([None, 8.0]), st.floats(0.5, 1.0))
def test_select_round_decides_as_if_it_planned_every_trial_round(batches, resident, steps, factor, admit):
    """select_round grows its round incrementally (O(1) a candidate); the reference below plans
    every trial round in full. Same batches served and held, same quotas, to the last bit."""
    rule = RoundRule(4.0, steps, factor, frozenset(resident))
    order = sorted(batches, key=lambda b: (priority(b, 0.01), b.model))
    chosen, held = [order[0]], []
    for b in order[1:]:
        if plan_round(chosen + [b], rule).alpha <= (admit if b.waiting else 1.0):
            chosen.append(b)
        else:
            held.append(b.model)
    expected = plan_round(chosen, rule)
    plan = select_round(batches, rule, admit, 0.01)
    assert (plan.models, plan.held, plan.quota, plan.decode_s) == (expected.models, tuple(held), expected.quota,
                                                                   expected.decode_s)


def test_the_most_urgent_batch_runs_even_when_nothing_fits():
    plan = select_round([load("slow", step=0.2, tbt=0.05, slack=-1.0), load("b", slack=0.0)], RULE)
    assert plan.models == ("slow",) and plan.held == ("b",) and plan.alpha > 1


def test_prefill_budget_keeps_the_round_inside_its_slo():
    plan = plan_round([load("a"), load("b")], RULE)
    budget = plan.prefill_budget_s
    # the round stretched by its budget gives mean TBT exactly the SLO
    assert plan.alpha * (plan.decode_s + budget) / plan.decode_s == pytest.approx(1.0)
    assert prefill_budget(1.0, 1.2) == 0.0
    # a prefill within what is left is admitted; beyond it only as the first of its round
    two = [load("a"), load("b")]
    assert admits(two, RULE, budget / 2, budget, first_prefill=False)
    assert not admits(two, RULE, 2 * budget, budget, first_prefill=False)
    assert admits(two, RULE, 2 * budget, budget, first_prefill=True)
    # a batch the next round cannot fit is never admitted, first or not
    six = [load(m) for m in "abcdef"]
    assert not admits(six, RULE, 0.0, math.inf, first_prefill=True)
    assert not admits([load("a"), load("b"), load("c"), load("d")], RULE, 0.0, math.inf, True, max_alpha=0.8)


# -- the policy on a fake engine ------------------------------------------------------------

STEP = 0.01  # every decode step; prefill is 0.005 + 1e-4 per token


def _estimator(models):
    est = StepLatencyEstimator()
    for m in models:
        for batch in (1, 2, 4):
            est.observe_decode(m, batch, 50 * batch, STEP)
        for tokens in (8, 64):
            est.observe_prefill(m, tokens, 1, 0.005 + 1e-4 * tokens)
        est.observe_switch(m, 0.0)
    return est


def _policy(config=None, models="abcdef"):
    policy = TokenLevelPolicy(make_policy().block_manager.__class__(64, 2048), config or SchedulerConfig(),
                              _estimator(models), make_policy().host_block_manager.__class__(64, 2048))
    for m in models:
        policy.add_model(m, SHAPE_A if m in "ace" else SHAPE_B, weight_bytes=1_000)
    return policy


def _step_s(out):
    return 0.005 + 1e-4 * out.num_new_tokens if out.is_prefill else STEP


def _req(rid, model, t, max_tokens=30, tbt=0.05, ttft=0.3, prompt=4):
    return Request(rid, model, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   SLO(ttft_s=ttft, tbt_s=tbt), arrival_time=t)


def _drive(policy, arrivals, max_steps=20000):
    """Run to completion; arrivals are (time, request). Returns the engine and the rounds
    seen: (served or reserved models, held models, time)."""
    engine = FakeEngine(policy, step_s=_step_s, resident=set(policy.models))
    pending = sorted(arrivals, key=lambda x: x[0])
    rounds = []
    planner = policy.planner
    plan = planner.plan

    def spy(now):
        planned = plan(now)
        taken_models = planner.order + planner.reserved
        if taken_models or planner.held:
            rounds.append((taken_models, planner.held, now))
        weighed = {b.model: b for b in planner.candidates}
        taken = [weighed[m] for m in taken_models]
        for held in planner.held:   # first fit: it did not fit beside the batches taken before it
            mine = weighed[held]
            key = (priority(mine, planner.guard_s), mine.model)
            ahead = [b for b in taken if (priority(b, planner.guard_s), b.model) < key]
            assert plan_round(ahead + [mine], policy.loads.rule()).alpha > 1.0
        return planned

    planner.plan = spy
    for _ in range(max_steps):
        while pending and pending[0][0] <= engine.now:
            policy.add_request(pending.pop(0)[1])
        if engine.step() is None:
            if not pending:
                break
            engine.now = pending[0][0]
    assert not policy.has_unfinished(), list(policy.requests.values())
    return engine, rounds


def test_overloaded_token_level_keeps_admitted_streams_on_time():
    # six models, one long request each, at once: each step is 10 ms and TBT is 50 ms with
    # every model resident, so 4 steps x 6 models = a 60 ms round would make every stream
    # late. With overload control the round takes what fits and the rest wait queued.
    # (a tight TTFT: no slack for a switch to wait on, scheduler/ttft_slack.py)
    arrivals = [(0.0, _req(f"r{m}", m, 0.0, max_tokens=40, ttft=TIGHT_TTFT)) for m in "abcdef"]
    engine, rounds = _drive(_policy(), arrivals)
    done = {r.request_id: r for out in engine.trace for r in out.requests}
    tpot = {rid: (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for rid, r in done.items()}
    assert all(t <= 0.05 + 1e-9 for t in tpot.values()), tpot     # every admitted stream keeps its TBT
    late_start = [rid for rid, r in done.items() if r.first_token_time > 0.1]
    assert late_start, "some requests must have waited for room"
    # without it every stream shares the device and every mean TBT is over the SLO
    engine, _ = _drive(_policy(SchedulerConfig(overload_control=False)),
                       [(0.0, _req(f"r{m}", m, 0.0, max_tokens=40, ttft=TIGHT_TTFT)) for m in "abcdef"])
    shared = {r.request_id: r for out in engine.trace for r in out.requests}
    assert all((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) > 0.05 for r in shared.values())
    # a stream that started on time keeps its cumulative deadlines (token k by first + k x TBT)
    # within one round of 4-step turns; one that waited for room may be held again once started
    # (its slack is the least), and its mean TPOT is still within the SLO (above)
    for r in done.values():
        if r.first_token_time - r.arrival_time <= r.slo.ttft_s:
            lateness = max(t - (r.token_times[0] + k * r.slo.tbt_s) for k, t in enumerate(r.token_times))
            assert lateness <= 4 * 4 * STEP + 1e-9, (r.request_id, lateness)


arrival = st.tuples(st.floats(0, 0.5), st.sampled_from("abcdef"), st.integers(1, 24), st.integers(1, 40),
                    st.sampled_from([0.03, 0.05, 0.2]))


@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(arrival, min_size=1, max_size=30), admission_alpha=st.sampled_from([0.7, 0.9, 1.0]))
def test_overload_control_finishes_everything_holds_only_what_does_not_fit_and_never_starves(arrivals, admission_alpha):
    policy = _policy(SchedulerConfig(admission_alpha=admission_alpha, max_prefill_tokens=64))
    reqs = [(t, _req(f"r{i}", m, t, max_tokens=n, prompt=p, tbt=tbt)) for i, (t, m, p, n, tbt) in enumerate(arrivals)]
    engine, rounds = _drive(policy, reqs)
    # every admitted request finished, with all its tokens, and every block came back
    assert all(r.is_finished and len(r.output_token_ids) == r.sampling_params.max_tokens for _, r in reqs)
    assert all_free(policy)
    # (_drive checks that a held batch is one that did not fit beside the more urgent ones)
    for served, held, now in rounds:
        assert served, "a round with work serves (or makes room for) at least its most urgent batch"
    # no starvation: a running request never waits longer than a few rounds for its next token
    longest_round = (len(policy.models) + 1) * (4 * STEP + 0.005 + 1e-4 * 64 * 8)
    for _, r in reqs:
        gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
        assert not gaps or max(gaps) <= 3 * longest_round + 1e-9, (r.request_id, max(gaps))


def test_past_capacity_late_requests_wait_behind_every_on_time_one():
    """Four long streams fill the device and model a gets a request every 10 ms for 3 s: more
    than fits. A waiting request already late goes last, behind every request still on time,
    its own model's too (it has missed its TTFT: serving it first saves nothing). Once late
    ones went back to the front after 3x their TTFT SLO, and past capacity the queue became
    FCFS over late requests: none made its TTFT (the load test at 9.6 req/s, issue 42).
    Here the requests of a that are still on time when room appears are served first, the
    late ones after the flood, and every request finishes; the long streams keep their TBT."""
    arrivals = [(0.0, _req(f"long{m}", m, 0.0, max_tokens=300)) for m in "cdef"]
    arrivals += [(0.01 * i, _req(f"a{i}", "a", 0.01 * i, max_tokens=5)) for i in range(300)]
    arrivals += [(0.05, _req("late-b", "b", 0.05, max_tokens=5))]
    # the four streams fill the device to alpha 0.8: the flood's batch fits beside them only with
    # admission headroom above that (the default under mean TPOT is 0.6, scheduler_config.py)
    engine, _ = _drive(_policy(SchedulerConfig(admission_alpha=0.9)), arrivals)
    done = {r.request_id: r for out in engine.trace for r in out.requests}
    assert len(done) == len(arrivals) and all(r.is_finished for r in done.values())
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for rid, r in done.items() if rid.startswith("long")]
    assert max(tpot) <= 0.05   # the TBT SLO of the long streams
    flood = [done[f"a{i}"] for i in range(300)]
    on_time = [r for r in flood if r.first_token_time - r.arrival_time <= r.slo.ttft_s]
    late = [r for r in flood if r not in on_time]
    # the on-time ones stay on time: only those that arrived while the long streams took the
    # device at the start miss (11 of 300 here)
    assert len(on_time) >= 0.9 * len(flood), len(on_time)


arrival_slo = st.tuples(st.floats(0, 5), st.sampled_from([0.1, 0.3, 1.0]), st.booleans())


@settings(max_examples=80, deadline=None)
@given(queue=st.lists(arrival_slo, min_size=1, max_size=12), now=st.floats(0, 6))
def test_serving_order_puts_a_split_prefill_first_then_on_time_by_deadline_then_late_oldest_first(queue, now):
    reqs = []
    for i, (t, ttft, split) in enumerate(queue):
        r = _req(f"r{i}", "a", t, ttft=ttft)
        if split:
            r.block_ids = [i]   # a split prefill holds the blocks of its whole prompt
        reqs.append(r)
    order = deadlines.serving_order(reqs, now)
    assert sorted(r.request_id for r in order) == sorted(r.request_id for r in reqs)
    kinds = [0 if r.block_ids else 1 if r.arrival_time + r.slo.ttft_s >= now else 2 for r in order]
    assert kinds == sorted(kinds)   # split first, then on time, then late
    for kind in (1, 2):
        due = [r.arrival_time + r.slo.ttft_s for r, k in zip(order, kinds) if k == kind]
        assert due == sorted(due)   # earliest TTFT deadline first (the late: the latest the most)


def test_a_burst_of_long_prompts_is_prefilled_within_the_budget_not_as_one_stalling_group():
    # a streams alone (a round of 4 steps, 0.04 s: alpha 0.2, prefill budget 0.04 x (1/0.2 - 1)
    # = 0.16 s); then 8 prompts of 300 tokens of b arrive at once (0.035 s of prefill each).
    # As one group (0.245 s) they would hold a's next token past its round's budget; within
    # the budget (one request may exceed it, never a group) a's longest gap stays inside it
    arrivals = [(0.0, _req("a0", "a", 0.0, max_tokens=80))]
    arrivals += [(0.1, _req(f"b{i}", "b", 0.1, max_tokens=10, prompt=300, ttft=2.0)) for i in range(8)]
    engine, _ = _drive(_policy(), arrivals)
    done = {r.request_id: r for out in engine.trace for r in out.requests}
    times = done["a0"].token_times
    assert max(b - a for a, b in zip(times, times[1:])) <= 0.16 + STEP + 1e-9
    assert (times[-1] - times[0]) / (len(times) - 1) <= 0.05
    prefills = [out for out in engine.trace if out.is_prefill and out.model == "b"]
    assert len(prefills) > 1   # the rest went in as a's steps earned room for them


def _prefill_steps(engine, model):
    """(index, seconds) of each prefill step of `model`, from the tokens it computed then."""
    steps = []
    for i, (out, (_, _, rows)) in enumerate(zip(engine.trace, engine.log)):
        if out.is_prefill and out.model == model:
            tokens = sum(out.num_scheduled_tokens[rid] for rid, _, _ in rows)
            steps.append((i, 0.005 + 1e-4 * tokens))
    return steps


def _gaps(engine, rid):
    times = next(r for out in engine.trace for r in out.requests if r.request_id == rid).token_times
    return [b - a for a, b in zip(times, times[1:])]


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_longer_than_the_prefill_budget_is_split_with_decode_between(chunked):
    # a streams alone (alpha 0.25, a round of 4 steps: prefill budget 0.04 x (1/0.25 - 1) = 0.12 s);
    # b's prompt of 1500 tokens takes 0.155 s. Chunked, no prefill step exceeds the budget and a
    # decodes between the chunks; whole, a waits for all of it.
    arrivals = [(0.0, _req("a0", "a", 0.0, max_tokens=60, tbt=0.04)),
                (0.05, _req("b0", "b", 0.05, max_tokens=5, prompt=1500, ttft=0.3))]
    engine, _ = _drive(_policy(SchedulerConfig(chunked_prefill=chunked), models="ab"), arrivals)
    steps = _prefill_steps(engine, "b")
    b0 = engine.trace[steps[0][0]].requests[0]
    assert len(b0.output_token_ids) == 5 and b0.num_computed_tokens == 1504
    if chunked:
        assert len(steps) >= 2 and all(s <= 0.12 * 1.01 for _, s in steps)   # as the estimator predicts it
        assert sum(s - 0.005 for _, s in steps) == pytest.approx(1500 * 1e-4)
        assert max(_gaps(engine, "a0")) <= 0.12 * 1.01 + STEP
    else:
        assert len(steps) == 1 and max(_gaps(engine, "a0")) >= 0.155


@pytest.mark.parametrize("smooth", [True, False])
def test_smooth_streams_run_turns_in_slices_and_spread_prefill(smooth):
    # three resident streams with room to spare (TBT 0.5 s: alpha 0.06) run 4-step quotas; with
    # smooth_streams they run a step at a time, round-robin (no turn cost to amortise here), and a
    # prompt of 600 tokens (0.065 s) arriving meanwhile is prefilled in chunks of at most a rotation
    # of slices (3 steps), each followed by a slice of every stream
    arrivals = [(0.0, _req(f"{m}0", m, 0.0, max_tokens=80, tbt=0.5)) for m in "abc"]
    arrivals += [(0.3, _req("d0", "d", 0.3, max_tokens=5, prompt=600, tbt=0.5, ttft=2.0))]
    engine, _ = _drive(_policy(SchedulerConfig(smooth_streams=smooth), models="abcd"), arrivals)
    runs = [(out.model, out.num_steps) for out in engine.trace if not out.is_prefill and out.model != "d"][6:40]
    prefill = _prefill_steps(engine, "d")
    worst = max(max(_gaps(engine, f"{m}0")) for m in "abc")
    if smooth:
        assert all(n == 1 for _, n in runs) and all(x != y for (x, _), (y, _) in zip(runs, runs[1:]))
        assert len(prefill) >= 3 and all(s <= 3 * STEP + 1e-9 for _, s in prefill)
        for (i, _), (j, _) in zip(prefill, prefill[1:]):   # every stream had a slice between two prefill steps
            assert {out.model for out in engine.trace[i + 1:j]} >= set("abc")
        assert worst <= 3 * STEP + 3 * STEP + 1e-9   # a rotation and a chunk
    else:
        assert all(n == 4 for _, n in runs) and len(prefill) == 1
        assert worst >= 8 * STEP + 0.065 - 1e-9   # two other turns and the whole prefill


def test_the_model_announced_for_prefetch_is_the_one_that_runs_next():
    """Rounds run the batches just started first, then the one whose turn was longest ago; the
    model announced at a round's last turn must be the next round's first (its weights copied
    meanwhile), not the next by name. Four streams arrive in the order d, b, c, a: d starts and
    takes a turn alone, then b, c and a start, so the rounds run b, c, a, d."""
    arrivals = [(0.001 * i, _req(f"{m}0", m, 0.001 * i, max_tokens=40, tbt=0.5)) for i, m in enumerate("dbca")]
    engine, _ = _drive(_policy(models="abcd"), arrivals)
    trace = engine.trace
    pairs = [(a, b) for a, b in zip(trace, trace[1:]) if not a.is_prefill and not b.is_prefill and a.model != b.model]
    assert [out.model for out in trace if not out.is_prefill][1:5] == list("bcad")
    assert len(pairs) > 20
    assert all(a.prefetch_model == b.model for a, b in pairs), \
        [(a.model, a.prefetch_model, b.model) for a, b in pairs if a.prefetch_model != b.model][:5]


def test_a_lost_stream_goes_last_until_it_is_aged():
    on_time = load("a", slack=0.3)
    lost = BatchLoad("b", 0.05, 0.01, 0.0, -0.2, lost=True)
    waiting = BatchLoad("c", 0.05, 0.01, 0.0, 0.1, waiting=True)
    order = sorted([lost, on_time, waiting], key=lambda b: (priority(b, 0.05), b.model))
    assert [b.model for b in order] == ["c", "a", "b"]   # behind the waiting one too
    aged = replace(lost, aged=True)   # no token for 1.5x its TTFT SLO: first again (least slack)
    assert priority(aged, 0.05) == -math.inf
    # with room for two, the lost batch is the one held
    plan = select_round([load("a", step=0.02, slack=0.3), replace(lost, step_s=0.02),
                         load("d", step=0.02, slack=0.5)], RULE, guard_s=0.05)
    assert plan.held == ("b",)


def test_a_stream_is_lost_when_even_full_speed_to_max_tokens_ends_late():
    """A stream 10 tokens into 40 (TBT 50 ms, first token at 0): its last token is due at 1.95 s,
    and 30 more steps of 10 ms take 0.3 s. At 1.0 s it is behind its pace (token 11 was due at
    0.5 s) but can catch up; at 1.7 s it cannot, at any length. Its batch goes last then."""
    policy = _policy(models="a")
    r = _req("r", "a", 0.0, max_tokens=40)
    r.first_token_time, r.output_token_ids, r.token_times = 0.0, [7] * 10, [1.6]
    r.status, policy.running["a"] = RequestStatus.RUNNING, [r]
    assert deadlines.slack(r, 1.0) == pytest.approx(-0.5)
    assert deadlines.last_slack(r, 1.0, 0.01) == pytest.approx(1.95 - 1.0 - 0.3)
    assert deadlines.last_slack(r, 1.7, 0.01) < 0 and deadlines.lost(r, 1.7, 0.01)
    # a step longer than the TBT SLO: ending sooner is its best case, and that is judged too
    assert deadlines.last_slack(r, 0.52, 0.06) < 0 and not deadlines.lost(r, 0.4, 0.06)
    # per-token deadlines (arrival + TTFT + k x TBT, TTFT 0.3 s): its first token at 0 banked
    # 0.3 s, so token 10 is due at 0.8 s and the last at 2.25 s; at 1.7 s it can still make it
    assert deadlines.slack(r, 1.0, per_token=True) == pytest.approx(-0.2)
    assert deadlines.last_slack(r, 1.7, 0.01, per_token=True) == pytest.approx(2.25 - 1.7 - 0.3)
    assert not deadlines.lost(r, 1.7, 0.01, per_token=True)
    assert not policy.loads.load("a", 1.0).lost
    lost = policy.loads.load("a", 1.7)
    assert lost.lost and not lost.aged and priority(lost, 0.05) == math.inf
    # no token for 1.5x its TTFT SLO (0.3 s): aged, back in deadline order (first)
    aged = policy.loads.load("a", 1.6 + 0.46)
    assert aged.lost and aged.aged and priority(aged, 0.05) == -math.inf


def _stream(done, max_tokens, first=0.0, tbt=0.05):
    r = _req("s", "a", 0.0, max_tokens=max_tokens, tbt=tbt)
    r.first_token_time, r.output_token_ids, r.status = first, [7] * done, RequestStatus.RUNNING
    return r


def test_a_stream_near_its_end_finishes_before_the_gap_that_would_make_it_miss():
    """TBT 50 ms, first token at 0, 10 ms steps: a stream of 8 tokens with 6 out has its last
    due at 0.35 s. At 0.28 s two steps end it on time (0.30 s), but not after a 60 ms gap
    (0.36 s): it finishes now. With a 10 ms gap it can wait; with 20 tokens left it is no
    stream a run can end (at most 8 steps); a stream already past saving is left alone."""
    near = _stream(6, 8)
    assert deadlines.finishing_steps([near], 0.28, 0.01, 0.06, most=8) == 2
    assert deadlines.finishing_steps([near], 0.28, 0.01, 0.01, most=8) == 0
    assert deadlines.finishing_steps([_stream(6, 26)], 0.28, 0.01, 0.06, most=8) == 0
    assert deadlines.finishing_steps([near], 0.34, 0.01, 0.06, most=8) == 0   # late even now
    # of two that need it, the one ending soonest decides (the other may still be on time later)
    assert deadlines.finishing_steps([near, _stream(5, 8)], 0.28, 0.01, 0.06, most=8) == 2


def test_a_stream_behind_its_pace_gets_the_steps_that_cover_the_next_gap():
    """TBT 50 ms, 10 ms steps: a stream 10 tokens out at 0.55 s is 50 ms late (token 10 was
    due at 0.5 s). Before a gap of 100 ms its next token must have 110 ms of slack: each step
    gains 40 ms, so (0.11 + 0.05) / 0.04 = 4 steps, less the turn's own. A stream with slack
    to spare, one that ends within the turn, and one past saving need none."""
    late = _stream(10, 60)
    assert deadlines.catch_up_steps([late], 0.55, 0.01, 0.1, turn_steps=0) == pytest.approx(4.0)
    assert deadlines.catch_up_steps([late], 0.55, 0.01, 0.1, turn_steps=3) == pytest.approx(1.0)
    assert deadlines.catch_up_steps([_stream(10, 60)], 0.2, 0.01, 0.1, turn_steps=0) == 0.0
    assert deadlines.catch_up_steps([_stream(10, 12)], 0.55, 0.01, 0.1, turn_steps=3) == 0.0
    assert deadlines.catch_up_steps([_stream(10, 12)], 2.0, 0.01, 0.1, turn_steps=0) == 0.0   # lost


def test_a_prefill_shorter_than_one_tbt_is_not_split_near_capacity():
    """Near capacity a round's prefill budget is a sliver (here 1 ms); a prompt whose prefill
    fits one TBT SLO of the decoding streams (50 ms) goes in whole, and a longer one is cut
    to what fits that TBT, not to the sliver (block-sized chunks each paid a step's fixed
    cost and a decode turn)."""
    policy = _policy(models="ab")
    r = _req("a0", "a", 0.0, max_tokens=40)
    r.first_token_time, r.output_token_ids, r.status = 0.0, [7], RequestStatus.RUNNING
    policy.running["a"] = [r]
    policy.prefill.start_round(budget_s=0.001, alpha=0.99)
    assert policy.prefill.chunk_tokens("b", 200) is None    # 0.025 s
    assert policy.prefill.chunk_tokens("b", 600) == 450     # 0.065 s: cut to 0.005 + 1e-4 x 450 = 0.05 s
    assert policy.prefill.chunk_tokens("b", 600, limit_s=0.025) == 200   # a strategy's cap (smooth streams)
    assert _policy(SchedulerConfig(chunked_prefill=False), models="ab").prefill.chunk_tokens("b", 600) is None


def _flood(config, seed):
    """60 req/s of short requests over six models, one weight slot and 20 ms switches: far past
    what the device serves. Returns the requests, all finished."""
    rnd = random.Random(seed)
    policy = _policy(config)
    for m in policy.models:
        policy.estimator.observe_switch(m, 0.02)
    engine = FakeEngine(policy, step_s=_step_s, switch_s=0.02)
    arrivals, t = [], 0.0
    for i in range(300):
        t += rnd.expovariate(60)
        arrivals.append((t, _req(f"r{i}", rnd.choice("aabbcdef"), t, max_tokens=rnd.choice([5, 10, 16, 30, 60]),
                                 prompt=rnd.choice([4, 40, 200]))))
    pending = list(arrivals)
    while pending or policy.has_unfinished():
        while pending and pending[0][0] <= engine.now:
            policy.add_request(pending.pop(0)[1])
        if engine.step() is None:
            engine.now = pending[0][0]
    return [r for _, r in arrivals]


def _made(requests):
    """(requests that made their TTFT, those of them that also made their mean TPOT)"""
    ttft = [r for r in requests if r.first_token_time - r.arrival_time <= r.slo.ttft_s]
    tpot = [r for r in ttft if (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) <= r.slo.tbt_s]
    return ttft, tpot


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_under_a_flood_the_requests_that_make_their_ttft_keep_their_tpot(seed):
    """Past capacity, admission keeps the rounds at alpha <= 0.6 under mean TPOT: fewer models
    a round, a margin for every stream. At 0.9 the rounds filled with switch-bound batches, each
    with its largest quota, and about a third of the requests that made their TTFT missed their
    mean TPOT (as on the load test, issue 42); at 0.6 at most a fifth do, and more requests meet
    both."""
    ttft, good = _made(_flood(SchedulerConfig(), seed))
    ttft_09, good_09 = _made(_flood(SchedulerConfig(admission_alpha=0.9), seed))
    assert len(good) >= 0.8 * len(ttft), (len(good), len(ttft))
    assert len(good) > len(good_09), (len(good), len(good_09))
