"""Scheduling policies driven by a fake engine loop: fake clock, fake KV memory, no torch.

The fake engine keeps the content of every device and host block, performs the swaps of
each SchedulerOutput, checks that every request reads back exactly the KV it wrote, and
"samples" a token that is a deterministic function of the request's tokens, like greedy
decoding. So a run under memory pressure must produce the same tokens as a roomy run.
"""
import math
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import (
    SLO, BlockManager, DedicatedPolicy, KVShape, Request, RequestLevelPolicy, RequestStatus,
    SamplingParams, SchedulerConfig, StepLatencyEstimator, StepResult, TokenLevelPolicy, decode_quotas,
)

SHAPE_A = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # 512-byte blocks
SHAPE_B = KVShape(num_layers=4, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # 1024-byte blocks
SLAB = 2048  # 4 blocks of A, 2 of B
EOS = 0
VOCAB = 40


def greedy_token(request: Request) -> int:
    return zlib.crc32(repr((request.request_id, request.all_token_ids)).encode()) % VOCAB


class FakeEngine:
    """Applies SchedulerOutputs the way the real engine must, against fake KV memory."""

    def __init__(self, policy, step_s=0.01, switch_s=0.0, resident=None, run_overhead_s=0.0):
        self.policy = policy
        self.step_s = step_s  # seconds, or a function of the SchedulerOutput
        self.run_overhead_s = run_overhead_s  # the engine's own time per run, outside the steps
        self.switch_s = switch_s
        self.resident = resident  # fixed resident set; None: one weight slot (the last model run)
        self.now = 0.0
        self.device: dict[tuple, list] = {}  # (shape, block id) -> 16 slots of (request id, token)
        self.host: dict[tuple, list] = {}
        self.trace = []  # every output, in order
        self.log = []  # per step: (model, is_prefill, [(request id, num_computed_tokens, num_tokens)])
        self.loaded: str | None = None

    def step(self, sample=greedy_token):
        out = self.policy.schedule(self.now)
        if out is None:
            return None
        self.trace.append(out)
        self.log.append((out.model, out.is_prefill,
                         [(r.request_id, r.num_computed_tokens, r.num_tokens) for r in out.requests]))
        shape_of = {m: e.kv_shape for m, e in self.policy.models.items()}
        for copy in out.swap_out:   # device -> host
            shape = shape_of[self._model_of(copy.request_id, out)]
            for d, h in zip(copy.src, copy.dst, strict=True):
                # a block given ahead for a multi-step run may be unwritten: the engine copies its garbage
                self.host[(shape, h)] = list(self.device.get((shape, d), [None] * 16))
        for copy in out.swap_in:   # host -> device
            shape = shape_of[self._model_of(copy.request_id, out)]
            for h, d in zip(copy.src, copy.dst, strict=True):
                self.device[(shape, d)] = list(self.host[(shape, h)])
        shape = shape_of[out.model]
        switch = self.switch_s if out.model != self.loaded else 0.0
        self.loaded = out.model
        assert out.num_steps == 1 or not out.is_prefill
        for i in range(out.num_steps):   # a multi-step run, as the engine runs it: until a request ends
            live = [r for r in out.requests if self.policy.requests.get(r.request_id) is r]
            for r in live:
                ids = r.all_token_ids
                assert len(r.block_ids) * 16 >= r.num_tokens
                for p in range(r.num_computed_tokens):  # the KV this step attends to is intact
                    assert self.device[(shape, r.block_ids[p // 16])][p % 16] == (r.request_id, ids[p]), r
                for p in range(r.num_computed_tokens, r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]):
                    self.device.setdefault((shape, r.block_ids[p // 16]), [None] * 16)[p % 16] = (r.request_id, ids[p])
            step_s = self.step_s(out) if callable(self.step_s) else self.step_s
            self.now += step_s + (switch if i == 0 else 0.0)
            sampled = {r.request_id: sample(r) for r in live}
            finished = self.policy.update(out, StepResult(sampled, self.now, step_s, switch if i == 0 else 0.0))
            self._check_invariants()
            if finished:
                break
        self.policy.set_resident(self.resident if self.resident is not None else {out.model})
        self.now += self.run_overhead_s
        return out, finished

    def _model_of(self, rid, out):
        r = self.policy.requests.get(rid)
        return r.model if r else out.model

    def _check_invariants(self):
        owners = {}
        for r in self.policy.requests.values():
            for g in r.block_ids:
                key = (self.policy.models[r.model].kv_shape, g)
                assert key not in owners, f"block {key} held by {owners[key]} and {r.request_id}"
                owners[key] = r.request_id
            if r.status is RequestStatus.SWAPPED:
                assert not r.block_ids and r.host_block_ids
            if r.status is RequestStatus.WAITING and r.num_computed_tokens:   # a split prefill
                assert 0 < r.num_computed_tokens < r.num_tokens and len(r.block_ids) * 16 >= r.num_tokens
            elif r.status is RequestStatus.WAITING:
                assert not r.block_ids

    def run(self, max_steps=5000):
        for _ in range(max_steps):
            if self.step() is None:
                break
        assert not self.policy.has_unfinished(), "policy stopped with unfinished requests"


def make_policy(cls=TokenLevelPolicy, num_slabs=32, host_slabs=32, config=None, estimator=None, **kw):
    host = BlockManager(host_slabs, SLAB) if host_slabs else None
    policy = cls(BlockManager(num_slabs, SLAB), config or SchedulerConfig(), estimator, host, **kw)
    policy.add_model("a", SHAPE_A, weight_bytes=10_000_000)
    policy.add_model("b", SHAPE_B, weight_bytes=20_000_000)
    return policy


TIGHT_TTFT = 0.05  # s: no slack for a switch to wait on (scheduler/ttft_slack.py): the quota rule alone


def req(rid, model="a", prompt=5, max_tokens=8, t=0.0, tbt=0.1, ttft=10.0, **params):
    return Request(rid, model, list(range(1, prompt + 1)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   SLO(ttft_s=ttft, tbt_s=tbt), arrival_time=t, eos_token_ids=(EOS,))


def all_free(policy):
    return policy.block_manager.usage()["used_bytes"] == 0 and (
        policy.host_block_manager is None or policy.host_block_manager.usage()["used_bytes"] == 0)


# -- the quota rule -------------------------------------------------------------------------


def test_quota_rule_worked_example():
    # n = TBT/d = (10, 5); S = 1/10 + 1/5 = 0.3
    # c0 = 1: alpha = max(1/(5*4) + 0.3, 0.5) = 0.5; q = 1/(n*(0.5-0.3)) = (0.5, 1.0)
    plan = decode_quotas([0.1, 0.1], [0.01, 0.02], switch_time_s=1.0, quota_max_s=4.0)
    assert plan.alpha == pytest.approx(0.5)
    assert plan.quotas_s == pytest.approx((0.5, 1.0))
    # c0 = 10: alpha = 10/20 + 0.3 = 0.8; q = 10/(n*0.5) = (2, 4): the largest hits Q_max
    plan = decode_quotas([0.1, 0.1], [0.01, 0.02], switch_time_s=10.0, quota_max_s=4.0)
    assert plan.alpha == pytest.approx(0.8)
    assert plan.quotas_s == pytest.approx((2.0, 4.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 2.0), st.floats(0.001, 0.2)), min_size=2, max_size=6),
       st.floats(0.001, 20.0), st.floats(0.5, 8.0))
def test_quota_rule_gives_every_batch_mean_tbt_alpha_times_slo(batches, c0, q_max):
    slos, steps = zip(*batches)
    plan = decode_quotas(slos, steps, c0, q_max)
    round_s = c0 + sum(plan.quotas_s)
    for slo, d, q in zip(slos, steps, plan.quotas_s):
        tokens_per_round = q / d
        assert round_s / tokens_per_round == pytest.approx(plan.alpha * slo, rel=1e-9)
    assert max(plan.quotas_s) <= q_max * (1 + 1e-9)
    assert plan.alpha >= 0.5


def test_quota_rule_corner_cases():
    alone = decode_quotas([0.1], [0.02], switch_time_s=1.0, quota_max_s=4.0)
    assert alone.quotas_s == (math.inf,)
    free = decode_quotas([0.1, 0.1], [0.01, 0.02], switch_time_s=0.0, quota_max_s=4.0, min_quota_steps=3)
    assert free.quotas_s == pytest.approx((0.03, 0.06))
    with pytest.raises(ValueError, match="one TBT SLO per step"):
        decode_quotas([0.1], [0.01, 0.02], 1.0, 4.0)


# -- requests and update --------------------------------------------------------------------


def test_update_finishes_on_eos_stop_token_and_length():
    policy = make_policy(DedicatedPolicy)
    eos = Request("eos", "a", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=(EOS,))
    ign = Request("ign", "a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=(EOS,))
    stop = Request("stop", "a", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(7,)), eos_token_ids=(EOS,))
    for r in (eos, ign, stop):
        policy.add_request(r)
    out = policy.schedule(0.0)
    assert out.is_prefill and {r.request_id for r in out.requests} == {"eos", "ign", "stop"}
    finished = policy.update(out, StepResult({"eos": EOS, "ign": EOS, "stop": 7}, now=1.0))
    assert {r.request_id for r in finished} == {"eos", "stop"}
    assert eos.status is RequestStatus.FINISHED_STOPPED and stop.status is RequestStatus.FINISHED_STOPPED
    assert ign.first_token_time == 1.0 and ign.output_token_ids == [EOS]
    for t in (2.0, 3.0):
        out = policy.schedule(t)
        assert not out.is_prefill and out.requests == [ign]
        finished = policy.update(out, StepResult({"ign": EOS}, now=t + 0.5))
    assert finished == [ign] and ign.status is RequestStatus.FINISHED_LENGTH
    assert ign.token_times == [1.0, 2.5, 3.5]
    assert all_free(policy) and not policy.has_unfinished()


def test_add_request_rejects_bad_input():
    policy = make_policy(num_slabs=2)
    with pytest.raises(ValueError, match="'zzz' is not registered"):
        policy.add_request(req("x", model="zzz"))
    policy.add_request(req("x"))
    with pytest.raises(ValueError, match="already scheduled"):
        policy.add_request(req("x"))
    with pytest.raises(ValueError, match="needs 9 KV blocks"):  # pool: 2 slabs * 4 blocks of A
        policy.add_request(req("huge", prompt=100, max_tokens=40))
    with pytest.raises(ValueError, match="still has 1 unfinished"):
        policy.remove_model("a")
    with pytest.raises(ValueError, match="max_prefill_group"):
        SchedulerConfig(max_prefill_group=0)


def test_from_generate_request():
    from scheduler import GenerateRequest

    g = GenerateRequest("r1", "a", (5, 6, 7), SamplingParams(max_tokens=4), SLO(2.0, 0.2), arrival_time=3.0)
    r = Request.from_generate_request(g, eos_token_ids=[2])
    assert (r.request_id, r.model, r.prompt_token_ids, r.arrival_time) == ("r1", "a", [5, 6, 7], 3.0)
    assert r.eos_token_ids == (2,) and r.slo.tbt_s == 0.2 and r.status is RequestStatus.WAITING


def test_abort_frees_blocks_wherever_the_request_is():
    policy = make_policy(num_slabs=2, host_slabs=8)
    engine = FakeEngine(policy)
    for i in range(3):  # 2 blocks of prompt each; a third block each overflows the 8-block pool
        policy.add_request(req(f"r{i}", prompt=30, max_tokens=30, t=i))
    for _ in range(30):
        engine.step()
        if any(r.status is RequestStatus.SWAPPED for r in policy.requests.values()):
            break
    statuses = {r.status for r in policy.requests.values()}
    assert RequestStatus.SWAPPED in statuses
    for rid in list(policy.requests):
        r = policy.abort_request(rid)
        assert r.status is RequestStatus.FINISHED_ABORTED and not r.block_ids and not r.host_block_ids
    assert policy.abort_request("r0") is None
    assert all_free(policy) and policy.schedule(engine.now) is None


# -- token-level policy ---------------------------------------------------------------------


def test_grouped_fcfs_prefill_order():
    policy = make_policy()
    policy.add_request(req("b0", "b", t=0.0))
    for i in range(10):
        policy.add_request(req(f"a{i}", "a", t=1.0 + i))
    policy.add_request(req("b1", "b", t=20.0))
    engine = FakeEngine(policy)
    prefills = []
    while (step := engine.step()) is not None:
        if step[0].is_prefill:
            prefills.append([r.request_id for r in step[0].requests])
    # b's head arrived first: its group (both b requests) goes first; then a's in groups of 8
    assert prefills[0] == ["b0", "b1"]
    assert prefills[1] == [f"a{i}" for i in range(8)]
    assert prefills[2] == ["a8", "a9"]


def test_prefill_token_budget_splits_a_group_over_steps():
    policy = make_policy(config=SchedulerConfig(max_prefill_tokens=12))
    for i in range(4):
        policy.add_request(req(f"a{i}", prompt=5, t=i))
    out = policy.schedule(0.0)
    assert [r.request_id for r in out.requests] == ["a0", "a1"]  # 10 tokens; a third would make 15


def _estimator(decode_s):
    est = StepLatencyEstimator()
    for m, d in decode_s.items():
        for batch in (1, 2, 3):
            est.observe_decode(m, batch, 100 * batch, d)
        est.observe_switch(m, 0.5)
    return est


def test_round_robin_turns_follow_the_quota_rule():
    decode_s = {"a": 0.01, "b": 0.02}
    policy = make_policy(estimator=_estimator(decode_s))
    for i in range(2):
        policy.add_request(req(f"a{i}", "a", prompt=3, max_tokens=400, tbt=0.1, t=i, ttft=TIGHT_TTFT))
        policy.add_request(req(f"b{i}", "b", prompt=3, max_tokens=400, tbt=0.1, t=i, ttft=TIGHT_TTFT))
    # decode steps take what the estimator predicts; a switch costs 0.5 s (one weight slot)
    engine = FakeEngine(policy, switch_s=0.5,
                        step_s=lambda out: 0.01 if out.is_prefill else decode_s[out.model])
    turns = []  # [model, seconds spent in its decode steps, its switch excluded]
    while engine.now < 20.0:
        start, loaded = engine.now, engine.loaded
        step = engine.step()
        if step is None:   # every request finished
            break
        out, _ = step
        if not out.is_prefill:
            spent = engine.now - start - (0.5 if out.model != loaded else 0.0)
            if turns and turns[-1][0] == out.model:
                turns[-1][1] += spent
            else:
                turns.append([out.model, spent])
    models = [m for m, _ in turns]
    assert len(turns) > 6 and all(x != y for x, y in zip(models, models[1:]))
    # the quotas of the rule, with c0 = two switches of 0.5 s per round
    plan = decode_quotas([0.1, 0.1], [decode_s["a"], decode_s["b"]], 1.0, 4.0)
    quota = dict(zip("ab", plan.quotas_s))
    for model, spent in turns[1:-1]:
        # a turn steps until the next step would overrun the quota
        assert quota[model] - decode_s[model] - 1e-9 <= spent <= quota[model] + 1e-9


@pytest.mark.parametrize("run_overhead_s, tbt, steps", [(0.0, 0.5, 3), (0.0013, 0.5, 6), (0.003, 0.5, 8),
                                                        (0.003, 0.11, 5)])
def test_all_resident_turns_amortise_the_engine_cost_and_prefetch_names_next_model(run_overhead_s, tbt, steps):
    # free switches: a turn is min_quota_steps (3) unless the engine's fixed cost of a run
    # (learnt from the time between schedule calls) needs a longer one to stay under 2% of it
    # (1.3 ms -> 65 ms, 6 steps of ~10.2 ms); at most max_decode_steps (8), and a round of the
    # two turns stays within the TBT SLO (0.11 s -> 5 steps)
    policy = make_policy(config=SchedulerConfig(min_quota_steps=3, turn_overhead_frac=0.02),
                         estimator=_estimator({"a": 0.01, "b": 0.01}))
    for m in "ab":
        policy.add_request(req(f"{m}0", m, prompt=3, max_tokens=200, tbt=tbt, ttft=TIGHT_TTFT))
    engine = FakeEngine(policy, step_s=0.01, resident={"a", "b"}, run_overhead_s=run_overhead_s)
    decode = [step[0] for step in (engine.step() for _ in range(60)) if step and not step[0].is_prefill]
    runs = []   # [model, decode steps] per turn (an output may be a multi-step run)
    for out in decode:
        if runs and runs[-1][0] == out.model:
            runs[-1][1] += out.num_steps
        else:
            runs.append([out.model, out.num_steps])
    # not the ends: the first rounds learn the cost, the last tokens end a turn early
    assert len(runs) > 10 and all(n == steps for _, n in runs[4:-2]), str(runs)
    for out in decode[: len(decode) // 2]:  # while one model decodes, the other (not finished yet) is announced for prefetch
        assert out.prefetch_model == ({"a", "b"} - {out.model}).pop()


def test_single_model_runs_until_another_arrives():
    policy = make_policy(estimator=_estimator({"a": 0.01, "b": 0.01}))
    policy.add_request(req("a0", "a", prompt=3, max_tokens=300))
    engine = FakeEngine(policy)
    for _ in range(20):   # a batch alone runs max_decode_steps steps per schedule call
        out, _ = engine.step()
        assert out.model == "a" and out.prefetch_model is None
        assert out.is_prefill or out.num_steps == policy.config.max_decode_steps
    policy.add_request(req("b0", "b", prompt=3, max_tokens=5, t=engine.now, ttft=TIGHT_TTFT))
    out, _ = engine.step()
    assert out.model == "b" and out.is_prefill  # the lone turn ends at once; prefill goes first


def test_waiting_prefill_of_running_model_joins_its_turn_without_switch():
    policy = make_policy(estimator=_estimator({"a": 0.01, "b": 0.01}))
    policy.add_request(req("a0", "a", prompt=3, max_tokens=300))
    policy.add_request(req("b0", "b", prompt=3, max_tokens=300))
    engine = FakeEngine(policy)
    for _ in range(4):
        engine.step()
    turn_model = engine.trace[-1].model
    policy.add_request(req("late", turn_model, prompt=3, max_tokens=5, t=engine.now))
    out, _ = engine.step()
    assert out.model == turn_model and out.is_prefill and [r.request_id for r in out.requests] == ["late"]


@pytest.mark.parametrize("ttft", [TIGHT_TTFT, 10.0])
def test_token_level_avoids_head_of_line_blocking_request_level_shows_it(ttft):
    """At a tight TTFT, b starts at once; at a loose one (10 s, a's 500 tokens take 5 s) the
    switch waits for a to finish, as request-level's does, and b still makes its TTFT."""
    def first_token_of_b(cls):
        policy = make_policy(cls, estimator=_estimator({"a": 0.01, "b": 0.01}))
        policy.add_request(req("long", "a", prompt=3, max_tokens=500, t=0.0, ttft=ttft))
        policy.add_request(req("short", "b", prompt=3, max_tokens=4, t=0.001, ttft=ttft))
        engine = FakeEngine(policy)
        engine.run()
        long, short = (next(o for out in engine.trace for o in out.requests if o.request_id == rid)
                       for rid in ("long", "short"))
        return short.first_token_time, long.token_times[-1]

    b_first, a_last = first_token_of_b(RequestLevelPolicy)
    assert b_first > a_last  # b waited for all 500 tokens of a
    b_first, a_last = first_token_of_b(TokenLevelPolicy)
    if ttft == TIGHT_TTFT:
        assert b_first < 0.1 < a_last
    else:
        assert a_last < b_first < 0.001 + ttft


def test_request_level_runs_one_model_to_completion_before_switching():
    policy = make_policy(RequestLevelPolicy)
    for i in range(3):
        policy.add_request(req(f"a{i}", "a", max_tokens=10 + i, t=2 * i))
        policy.add_request(req(f"b{i}", "b", max_tokens=10, t=2 * i + 1))
    engine = FakeEngine(policy)
    engine.run()
    models = [out.model for out in engine.trace]
    assert models == sorted(models)  # all of a, then all of b: exactly one switch
    assert engine.trace[0].prefetch_model == "b"


def test_dedicated_refuses_other_models():
    policy = make_policy(DedicatedPolicy)
    with pytest.raises(ValueError, match="dedicated to model 'a'.*'b'"):
        policy.add_request(req("x", "b"))
    policy = make_policy(DedicatedPolicy, model="b")
    with pytest.raises(ValueError, match="dedicated to model 'b'"):
        policy.add_request(req("x", "a"))


# -- preemption -----------------------------------------------------------------------------


def _run_tokens(num_slabs, host_slabs, cls=TokenLevelPolicy):
    policy = make_policy(cls, num_slabs=num_slabs, host_slabs=host_slabs)
    for i in range(6):
        model = "ab"[i % 2] if cls is not DedicatedPolicy else "a"
        policy.add_request(req(f"r{i}", model, prompt=10 + 3 * i, max_tokens=25, t=i))
    engine = FakeEngine(policy)
    engine.run()
    outputs = {r.request_id: r.output_token_ids for out in engine.trace for r in out.requests}
    return outputs, engine, policy


@pytest.mark.parametrize("cls", [TokenLevelPolicy, RequestLevelPolicy, DedicatedPolicy])
def test_preemption_by_swap_keeps_output_identical(cls):
    roomy, engine, policy = _run_tokens(num_slabs=64, host_slabs=64, cls=cls)
    assert policy.num_preemptions == 0
    tight, engine, policy = _run_tokens(num_slabs=3, host_slabs=64, cls=cls)
    assert policy.num_preemptions > 0
    assert any(out.swap_out for out in engine.trace) and any(out.swap_in for out in engine.trace)
    assert tight == roomy and all(len(v) == 25 for v in tight.values())
    assert all_free(policy)


def test_recompute_fallback_without_host_pool():
    roomy, _, _ = _run_tokens(num_slabs=64, host_slabs=64)
    tight, engine, policy = _run_tokens(num_slabs=3, host_slabs=0)
    assert policy.num_preemptions > 0
    assert not any(out.swap_out or out.swap_in for out in engine.trace)
    # a recomputed request comes back as a prefill of prompt + its generated tokens
    prompt_len = {r.request_id: r.num_prompt_tokens for out in engine.trace for r in out.requests}
    assert any(is_prefill and any(computed == 0 and n > prompt_len[rid] for rid, computed, n in reqs)
               for _, is_prefill, reqs in engine.log)
    assert tight == roomy and all_free(policy)


# -- random workloads -----------------------------------------------------------------------

arrival = st.tuples(
    st.integers(0, 30),  # arrival step
    st.sampled_from("ab"),
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 24),  # max_tokens
    st.booleans(),  # ignore_eos
)


@pytest.mark.parametrize("cls, smooth", [(TokenLevelPolicy, False), (TokenLevelPolicy, True),
                                         (RequestLevelPolicy, False), (DedicatedPolicy, False)],
                         ids=["token", "token-smooth", "request", "dedicated"])
@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(arrival, min_size=1, max_size=20), host_slabs=st.sampled_from([0, 2, 16]),
       aborts=st.lists(st.integers(0, 60), max_size=3), seed=st.integers(0, 1000))
def test_random_workloads_always_finish_and_free_everything(cls, smooth, arrivals, host_slabs, aborts, seed):
    run_random_workload(cls, smooth, arrivals, host_slabs, aborts, seed)


def test_a_prefill_without_room_gives_way_to_one_that_can_run():
    """A case the random workloads found (1 make test run in ~5): every request waiting, none
    running, the first group by TTFT finding no room (a half-prefilled request of the other model
    held the blocks), and schedule() None for ever while that request could have gone on."""
    arrivals = [(11, "b", 7, 24, True), (7, "b", 18, 13, False), (4, "b", 18, 7, False), (20, "a", 27, 3, True),
                (12, "a", 7, 7, False), (14, "b", 34, 11, True), (14, "b", 26, 3, True), (20, "a", 35, 21, False),
                (25, "b", 27, 6, True), (24, "a", 8, 9, True), (19, "b", 13, 12, True), (24, "b", 29, 20, False),
                (13, "b", 15, 21, True), (4, "a", 14, 21, False)]
    run_random_workload(TokenLevelPolicy, True, arrivals, host_slabs=16, aborts=[5, 53, 37], seed=480)


def run_random_workload(cls, smooth, arrivals, host_slabs, aborts, seed):
    """Arrivals (step, model, prompt tokens, max_tokens, ignore_eos) on 3 slabs of KV: every
    request finishes, with its length when it ran to max_tokens, and every block is free after."""
    # smooth: both models resident, so rounds run in slices and prefill is split and spread
    policy = make_policy(cls, num_slabs=3, host_slabs=host_slabs,
                         config=SchedulerConfig(max_prefill_tokens=48, smooth_streams=smooth))
    engine = FakeEngine(policy, resident={"a", "b"} if smooth else None)
    if cls is DedicatedPolicy:
        arrivals = [(t, "a", p, m, i) for t, _, p, m, i in arrivals]
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    admitted = []

    def sample(r):  # random tokens, EOS included, so some requests stop early
        return zlib.crc32(repr((seed, r.request_id, r.num_tokens)).encode()) % 12

    for step in range(3000):
        while pending and pending[0][1][0] <= step:
            i, (_, model, prompt, max_tokens, ignore_eos) = pending.pop(0)
            r = Request(f"r{i}", model, [5] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                        arrival_time=engine.now, eos_token_ids=(EOS,))
            policy.add_request(r)
            admitted.append(r)
        if step in aborts and policy.requests:
            policy.abort_request(sorted(policy.requests)[0])
        if engine.step(sample) is None and not pending:
            break
    assert not policy.has_unfinished(), [r for r in policy.requests.values()]
    assert all(r.is_finished for r in admitted)
    for r in admitted:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.sampling_params.max_tokens
    assert all_free(policy)


def test_make_policy_by_name():
    from scheduler.policy_registry import make_policy

    for name, cls in (("token", TokenLevelPolicy), ("request", RequestLevelPolicy), ("dedicated", DedicatedPolicy)):
        policy = make_policy(name, BlockManager(4, SLAB), BlockManager(4, SLAB))
        assert type(policy) is cls and policy.host_block_manager is not None
    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        make_policy("fifo", BlockManager(4, SLAB))


def test_cheap_switches_cap_quotas_at_a_multiple_of_the_switch_cost():
    from scheduler.quota import decode_quotas

    # three busy batches, n = 5 each (S = 0.6): Aegaeon's fixed Q_max makes every quota 4 s,
    # so each batch stalls ~8 s per round although a switch costs 10 ms in all
    fixed = decode_quotas([0.05] * 3, [0.01] * 3, 0.01, quota_max_s=4.0)
    capped = decode_quotas([0.05] * 3, [0.01] * 3, 0.01, quota_max_s=4.0, switch_factor=8.0)
    assert max(fixed.quotas_s) == pytest.approx(4.0)
    assert max(capped.quotas_s) == pytest.approx(0.08)
    round_s = 0.01 + sum(capped.quotas_s)
    assert 0.01 / round_s < 0.05                        # switching stays a small share of the device
    assert capped.alpha == pytest.approx(0.6 + 1 / 40)  # mean TBT barely above the switch-free ideal
    # expensive switches (a 7B model on a GPU): K * c0 > Q_max, the rule is Aegaeon's unchanged
    gpu = decode_quotas([0.1] * 3, [0.02] * 3, 2.4, quota_max_s=4.0, switch_factor=8.0)
    assert gpu == decode_quotas([0.1] * 3, [0.02] * 3, 2.4, quota_max_s=4.0)


# -- multi-step decode -------------------------------------------------------------------


def _decode_output(policy, engine):
    """The decode output after the prefill (scheduled, not run: run `engine` on to apply it)."""
    out, _ = engine.step()
    assert out.is_prefill
    return policy.schedule(engine.now)


def test_multi_step_run_is_capped_by_tokens_left_stop_strings_and_config():
    for config, params, expected in [(SchedulerConfig(), {}, 8), (SchedulerConfig(max_decode_steps=1), {}, 1),
                                     (SchedulerConfig(max_decode_steps=5), {}, 5), (SchedulerConfig(), {"stop": "x"}, 1)]:
        policy = make_policy(config=config, estimator=_estimator({"a": 0.01, "b": 0.01}))
        policy.add_request(req("a0", "a", prompt=3, max_tokens=300, **params))
        policy.add_request(req("a1", "a", prompt=20, max_tokens=300))
        out = _decode_output(policy, FakeEngine(policy))
        assert out.num_steps == expected, (config, params)
        for r in out.requests:   # every request holds the blocks of the whole run
            assert len(r.block_ids) * 16 >= r.num_tokens + out.num_steps - 1
    policy = make_policy(estimator=_estimator({"a": 0.01, "b": 0.01}))
    policy.add_request(req("a0", "a", prompt=3, max_tokens=4))   # 3 tokens left after the prefill's
    assert _decode_output(policy, FakeEngine(policy)).num_steps == 3


def test_multi_step_run_shrinks_to_the_room_its_blocks_have_when_the_pool_is_full():
    policy = make_policy(num_slabs=1, estimator=_estimator({"a": 0.01, "b": 0.01}))
    per_slab = policy.block_manager.blocks_per_slab(SHAPE_A)
    # a0 has room for 2 more tokens in its one block; a1 fills the rest of the pool, 4 tokens of room left
    policy.add_request(req("a0", "a", prompt=14, max_tokens=8))
    policy.add_request(req("a1", "a", prompt=16 * (per_slab - 1) - 4, max_tokens=20))
    engine = FakeEngine(policy)
    out = _decode_output(policy, engine)
    assert policy.block_manager.allocate(SHAPE_A, 1) is None   # nothing left to look ahead with
    assert out.num_steps == 2
    engine.run()   # the runs' blocks were enough (FakeEngine asserts it every step) and all finish
    assert all_free(policy)


@pytest.mark.parametrize("config", [SchedulerConfig(), SchedulerConfig(max_decode_steps=1, smooth_streams=True),
                                    SchedulerConfig(overload_control=False)], ids=["default", "smooth", "no-overload"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_under_memory_pressure_finish_with_their_kv_intact(config, seed):
    """Six models of two KV shapes, up to 60 requests with mixed SLOs, a pool small enough that
    batches are preempted and swapped while holding blocks given ahead for multi-step runs.
    Every request finishes, and every step attends to KV that is intact (FakeEngine checks each
    position). A swap-in once brought back fewer device blocks than the host copy held (the
    look-ahead blocks), and the engine's block copy refused the unequal lists."""
    import random

    rng = random.Random(seed)
    est = StepLatencyEstimator()
    for m in "abcdef":
        for b in (1, 2, 4):
            est.observe_decode(m, b, 50 * b, 0.01)
        for t in (8, 64):
            est.observe_prefill(m, t, 1, 0.005 + 1e-4 * t)
        est.observe_switch(m, 0.002)
    policy = TokenLevelPolicy(BlockManager(12, SLAB), config, est, BlockManager(32, SLAB))
    for m in "abcdef":
        policy.add_model(m, SHAPE_A if m in "ace" else SHAPE_B, weight_bytes=1000)
    arrivals = sorted((rng.uniform(0, 2.0), i) for i in range(rng.randint(5, 60)))
    pending = [(t, Request(f"r{i}", rng.choice("abcdef"), [rng.randint(1, 90) for _ in range(rng.randint(1, 180))],
                           SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True),
                           SLO(ttft_s=rng.choice([0.05, 0.3, 3.0]), tbt_s=rng.choice([0.03, 0.05, 0.5])),
                           arrival_time=t)) for t, i in arrivals]
    step = lambda o: 0.005 + 1e-4 * o.num_new_tokens if o.is_prefill else 0.01 + 0.001 * len(o.requests)  # noqa: E731
    engine = FakeEngine(policy, step_s=step, switch_s=0.003, run_overhead_s=0.0007,
                        resident=set("abcdef") if seed % 2 == 0 else None)   # all resident, or one slot
    for _ in range(50_000):
        while pending and pending[0][0] <= engine.now:
            policy.add_request(pending.pop(0)[1])
        if engine.step() is None:   # nothing to run now: time passes, as on a real worker
            if not pending and not policy.has_unfinished():
                break
            engine.now = min(pending[0][0], engine.now + 0.01) if pending else engine.now + 0.01
    assert not pending and not policy.has_unfinished()
