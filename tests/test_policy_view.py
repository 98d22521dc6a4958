"""The token-level policy's parts (BatchLoads, RoundPlanner, PrefillBudget) work on a
PolicyView of plain tables: each is built and driven here through its public verbs, with no
policy behind it."""
from __future__ import annotations

from collections import deque

import pytest

from scheduler.batch_loads import BatchLoads
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BLOCK_SIZE, BlockManager, KVShape
from scheduler.policy_view import PolicyView
from scheduler.prefill_budget import PrefillBudget
from scheduler.request import Request, RequestStatus
from scheduler.round_planner import RoundPlanner
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler_config import SchedulerConfig
from scheduler.slo import SLO
from scheduler.step_overhead import StepOverhead
from scheduler.token_level import TokenLevelPolicy

PREFILL_S_PER_TOKEN = 2e-4
DECODE_STEP_S = 0.02


class Tables:
    """A policy's request tables as plain containers, and the three parts built on a view of them."""

    def __init__(self, models: str, config: SchedulerConfig | None = None, resident: str | None = None) -> None:
        self.models = {m: m for m in models}
        self.waiting: dict[str, deque[Request]] = {m: deque() for m in models}
        self.running: dict[str, list[Request]] = {m: [] for m in models}
        self.requests: dict[str, Request] = {}
        self.resident = set(models if resident is None else resident)
        estimator = StepLatencyEstimator(default_prefill_s_per_token=PREFILL_S_PER_TOKEN,
                                         default_decode_step_s=DECODE_STEP_S)
        for m in models:
            estimator.register_model(m, 80_000_000)   # 10 ms to switch in at 8 GB/s
        self.view = PolicyView(self.models, self.waiting, self.running, self.requests, self.resident,
                               estimator, config or SchedulerConfig())
        self.loads = BatchLoads(self.view, StepOverhead())
        self.planner = RoundPlanner(self.view, self.loads)
        self.prefill = PrefillBudget(self.view, self.loads, self.planner)

    def decoding(self, rid: str, model: str, tbt: float = 0.1, now: float = 0.0) -> Request:
        request = _request(rid, model, tbt=tbt, arrival=now)
        request.status, request.num_computed_tokens = RequestStatus.RUNNING, request.num_tokens
        request.output_token_ids.append(7)
        request.first_token_time = now
        request.token_times.append(now)
        self.running[model].append(request)
        self.requests[rid] = request
        return request

    def queued(self, rid: str, model: str, prompt: int = 4, arrival: float = 0.0, ttft: float = 1.0) -> Request:
        request = _request(rid, model, prompt=prompt, arrival=arrival, ttft=ttft)
        self.waiting[model].append(request)
        self.requests[rid] = request
        return request


def _request(rid, model, prompt=4, tbt=0.1, ttft=1.0, arrival=0.0) -> Request:
    return Request(rid, model, list(range(1, prompt + 1)), SamplingParams(max_tokens=64, ignore_eos=True),
                   SLO(ttft_s=ttft, tbt_s=tbt), arrival_time=arrival)


# -- BatchLoads ------------------------------------------------------------------------------


def test_a_batch_load_takes_its_tightest_tbt_and_its_models_predicted_step_and_switch():
    tables = Tables("ab")
    tables.decoding("r1", "a", tbt=0.2)
    tables.decoding("r2", "a", tbt=0.05)
    assert tables.loads.decoding("a") and not tables.loads.decoding("b")
    assert tables.loads.decoding_models() == ["a"]
    load = tables.loads.load("a", now=0.0)
    assert load.tbt_slo_s == 0.05
    assert load.step_s == pytest.approx(DECODE_STEP_S)
    assert load.switch_s == pytest.approx(0.01)
    assert not load.waiting
    waiting = tables.loads.waiting_load("b", 0.0, [tables.queued("q1", "b")])
    assert waiting.waiting and waiting.model == "b"


def test_the_round_rule_sees_the_resident_set_as_it_changes():
    tables = Tables("ab", resident="a")
    assert tables.loads.rule().resident == {"a"}
    tables.resident.add("b")   # the policy updates its set in place; the view reads it live
    assert tables.loads.rule().resident == {"a", "b"}


def test_a_policys_view_follows_the_engines_resident_hint():
    policy = TokenLevelPolicy(BlockManager(8, 4096))
    for m in "ab":
        policy.add_model(m, KVShape(1, 1, 4, 4), weight_bytes=1_000)
    view = policy.view()
    policy.set_resident(["b"])
    assert view.resident == {"b"}
    policy.set_resident(view.resident | {"a"})
    assert view.resident == {"a", "b"}


# -- RoundPlanner ----------------------------------------------------------------------------


def test_a_round_serves_every_decoding_batch_with_a_quota_and_nothing_when_nothing_decodes():
    tables = Tables("abc")
    assert tables.planner.plan(0.0) is None and tables.planner.order == ()
    tables.decoding("r1", "a")
    tables.decoding("r2", "b")
    plan = tables.planner.plan(0.0)
    assert set(plan.models) == {"a", "b"} and plan.held == ()
    assert set(tables.planner.order) == {"a", "b"}
    assert all(q > 0 for q in tables.planner.quotas.values())
    assert tables.planner.alpha == plan.alpha < 1


def test_a_batch_just_started_goes_first_and_one_just_served_waits_for_the_others():
    tables = Tables("abc")
    for rid, m in (("r1", "a"), ("r2", "b"), ("r3", "c")):
        tables.decoding(rid, m)
    tables.planner.ran("a")                               # decode turns of a, then b
    tables.planner.ran("c", prefill=True, starts=True)    # c's batch started
    tables.planner.ran("b")
    tables.planner.ran("a", prefill=True)                 # a join moves nothing
    tables.planner.plan(0.0)
    assert tables.planner.order == ("c", "a", "b")
    first = tables.planner.next_turn()
    assert first == "c" and "c" not in tables.planner.order


def test_an_overloaded_round_holds_the_batches_that_do_not_fit():
    tables = Tables("abcdef")
    for i, m in enumerate("abcdef"):   # six batches of 20 ms steps against a 50 ms TBT
        tables.decoding(f"r{i}", m, tbt=0.05)
    plan = tables.planner.plan(0.0)
    assert plan.held and tables.planner.held == plan.held
    assert plan.alpha <= 1 < tables.planner.alpha_all
    assert tables.planner.num_held_rounds == 1


def test_a_switch_is_due_at_once_when_nothing_decodes_and_not_while_a_waiting_request_has_slack():
    tables = Tables("ab")
    tables.queued("q1", "b", ttft=10.0)
    assert tables.planner.due_models(0.0) == {"b"}
    tables.decoding("r1", "a")
    tables.planner.forget_due()
    assert not tables.planner.switch_due(0.0)       # 10 s of TTFT left: a keeps decoding
    tables.planner.forget_due()
    assert tables.planner.switch_due(9.9)            # its first token is due


# -- PrefillBudget ---------------------------------------------------------------------------


def test_an_idle_device_admits_a_whole_group_and_spends_no_credit():
    tables = Tables("a", SchedulerConfig(max_prefill_group=2))
    for i in range(3):
        tables.queued(f"q{i}", "a")
    assert tables.prefill.admissible("a", 0.0) == ["q0", "q1"]
    assert tables.prefill.credit_s == 0.0


def test_credit_is_earned_by_decode_capped_by_the_round_and_spent_by_prefill():
    tables = Tables("a")
    tables.prefill.start_round(budget_s=0.1, alpha=0.5)   # a second of decode earns a second of prefill
    tables.prefill.earn(0.03)
    assert tables.prefill.credit_s == pytest.approx(0.03)
    tables.prefill.earn(1.0)
    assert tables.prefill.credit_s == pytest.approx(0.1)
    tables.prefill.spend(0.04)
    assert tables.prefill.credit_s == pytest.approx(0.06)
    tables.prefill.start_round(budget_s=0.02, alpha=1.2)   # overloaded: nothing more is earned
    tables.prefill.earn(1.0)
    assert tables.prefill.credit_s == pytest.approx(0.02)


def test_a_reserved_group_keeps_the_prefix_whose_prefill_fits_the_credit():
    tables = Tables("a")
    for i in range(3):
        tables.queued(f"q{i}", "a", prompt=100)   # 20 ms of prefill each
    tables.prefill.start_round(budget_s=0.05, alpha=0.5)
    tables.prefill.earn(0.05)
    assert tables.prefill.within_credit("a", ["q0", "q1", "q2"]) == ["q0", "q1"]
    tables.prefill.spend(0.05)
    assert tables.prefill.within_credit("a", ["q0", "q1", "q2"]) == ["q0"]   # the first always goes


def test_a_long_prompt_is_chunked_to_what_fits_while_streams_decode():
    tables = Tables("ab")
    tables.queued("q1", "b", prompt=2000)   # 400 ms of prefill
    assert tables.prefill.chunk_tokens("b", 2000) is None   # nothing decodes: whole prompts
    tables.decoding("r1", "a", tbt=0.05)
    tables.prefill.start_round(budget_s=0.01, alpha=0.9)
    chunk = tables.prefill.chunk_tokens("b", 2000)
    cap = 0.05   # the larger of the round's budget and the streams' TBT
    assert BLOCK_SIZE <= chunk < 2000
    assert chunk * PREFILL_S_PER_TOKEN <= cap < (chunk + 1) * PREFILL_S_PER_TOKEN
    assert tables.prefill.chunk_tokens("b", 100) is None   # fits: not split
    off = Tables("ab", SchedulerConfig(chunked_prefill=False))
    off.decoding("r1", "a", tbt=0.05)
    assert off.prefill.chunk_tokens("b", 2000) is None
