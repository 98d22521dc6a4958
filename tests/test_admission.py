"""Admission control and the stall deadline at the HTTP edge, as a client meets them: 429s in
OpenAI's shape with Retry-After when a model is over its bounds, every accepted request
completes, and a request whose engine goes quiet fails with a clear error and is aborted."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from deploy.openai_api.admission import Admission, AdmissionConfig
from deploy.openai_api.config import IngressConfig
from deploy.openai_api.errors import OpenAIError
from deploy.openai_api.ingress import OpenAIIngress
from deploy.openai_api.protocol import IngressRequest
from edge_helpers import MAX_TOKENS_CAP, MODEL, OTHER_MODEL, expected_output, make_engine, running_server


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refusal(admission: Admission, model: str = MODEL, ttft_slo_s: float = 1.0) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        admission.admit(model, ttft_slo_s)
    e = info.value
    assert e.status == 429 and e.to_dict()["error"]["code"] == "rate_limit_exceeded"
    assert e.to_dict()["error"]["type"] == "requests"
    assert int(e.headers["Retry-After"]) >= 1
    return e


def test_a_model_with_max_waiting_requests_refuses_more_and_others_still_start():
    admission = Admission(AdmissionConfig(max_waiting=3, max_active=5, ttft_slo_multiple=0))
    tickets = [admission.admit(MODEL, 1.0) for _ in range(3)]
    assert "3 requests waiting" in refusal(admission).message
    other = admission.admit(OTHER_MODEL, 1.0)            # another model's queue is its own
    tickets[0].first_token()                             # started: its waiting place frees
    tickets.append(admission.admit(MODEL, 1.0))
    assert admission.active == 5
    assert "limit of 5 requests in flight" in refusal(admission, OTHER_MODEL).message
    for t in [*tickets, other]:
        t.release()
        t.release()                                      # idempotent
    assert admission.active == 0 and admission.waiting(MODEL) == 0


def test_a_request_predicted_to_start_past_twice_its_ttft_slo_is_refused_with_the_wait():
    clock = Clock()
    admission = Admission(AdmissionConfig(max_waiting=1000, ttft_slo_multiple=2.0, adaptive=False), clock=clock)
    queue = [admission.admit(MODEL, 1.0) for _ in range(6)]
    for _ in range(5):                                   # a standing queue serves 2 first tokens / s
        clock.now += 0.5
        queue.pop(0).first_token()
    assert admission.predicted_ttft_s(MODEL) == pytest.approx(1.0)   # (1 waiting + 1) / 2 per s
    queue += [admission.admit(MODEL, 1.0) for _ in range(3)]          # 4 waiting: the last at (3 + 1) / 2 = 2 s
    e = refusal(admission)                                            # (4 + 1) / 2 = 2.5 s > 2 x 1 s
    assert "about 2.5 s" in e.message and "2 x its TTFT SLO of 1 s" in e.message
    assert e.headers["Retry-After"] == "1"                            # 0.5 s over, rounded up
    assert admission.admit(MODEL, 5.0) is not None       # a request with a looser SLO still fits
    assert admission.rejected == 1


def test_a_first_burst_waits_only_up_to_the_cold_bound_until_its_start_rate_is_measured():
    clock = Clock()
    admission = Admission(AdmissionConfig(max_waiting=1000, ttft_slo_multiple=2.0, cold_waiting=8, adaptive=False), clock=clock)
    queue = [admission.admit(MODEL, 1.0) for _ in range(8)]
    e = refusal(admission)                                            # no rate yet: the 9th waits outside
    assert "8 requests waiting to start and no known start rate yet" in e.message
    assert e.headers["Retry-After"] == "1"
    assert admission.admit(OTHER_MODEL, 1.0) is not None              # the bound is per model
    for _ in range(5):                                                # the standing queue serves 4 / s
        clock.now += 0.25
        queue.pop(0).first_token()
    assert admission.predicted_ttft_s(MODEL) == pytest.approx(1.0)    # (3 waiting + 1) / 4 per s
    queue += [admission.admit(MODEL, 1.0) for _ in range(5)]          # measured: the prediction decides now,
    assert admission.waiting(MODEL) == 8                              # past the cold bound: up to (7 + 1) / 4 = 2 s
    assert "about 2.2 s" in refusal(admission).message                # (8 + 1) / 4 > 2 x 1 s


def test_an_idle_gap_is_not_taken_for_a_slow_server():
    clock = Clock()
    admission = Admission(AdmissionConfig(max_waiting=1000, ttft_slo_multiple=2.0, adaptive=False), clock=clock)
    for _ in range(3):                                   # bursts of 6, each drained at 10 / s, then idle
        burst = [admission.admit(MODEL, 0.5) for _ in range(6)]
        for t in burst:
            clock.now += 0.1
            t.first_token()
            t.release()
        clock.now += 60.0
    assert admission.predicted_ttft_s(MODEL) == pytest.approx(0.1)


def measure_rate(admission: Admission, clock: Clock, per_s: float, model: str = MODEL) -> None:
    """Give `model` a measured start rate: a standing queue of 6 starting `per_s` a second."""
    queue = [admission.admit(model, 100.0) for _ in range(6)]
    for t in queue:
        clock.now += 1 / per_s
        t.first_token()
    for t in queue:
        t.release()


def test_late_starts_of_requests_admitted_on_a_measured_rate_cut_the_limit_and_an_idle_edge_forgets_them():
    clock = Clock()
    admission = Admission(AdmissionConfig(ttft_slo_multiple=0, initial_active=16, min_active=2), clock=clock)
    measure_rate(admission, clock, per_s=20)
    first = [admission.admit(MODEL, 1.0) for _ in range(16)]
    assert "limit of 16 requests in flight" in refusal(admission).message
    clock.now += 1.5                                     # the edge fell behind: they start 1.5 s in, SLO 1 s
    for t in first:
        t.first_token()
    # cut once, not once per late request: all 16 were admitted under the old limit
    assert admission.limit_now() == 8
    for t in first[:9]:
        t.release()
    admission.check_room()                               # 7 in flight < 8: room
    late = admission.admit(MODEL, 1.0, arrived_at=clock.now - 0.5)   # 0.5 s already spent reading it
    e = refusal(admission)
    assert "limit of 8 requests in flight (lowered while recent requests started late)" in e.message
    clock.now += 0.6                                     # 1.1 s after it arrived: late under the new limit too
    late.first_token()
    assert admission.limit_now() == 4                    # min(limit 8, 8 in flight) x 0.5
    kept = first[9]                                      # one stays in flight: the edge is not idle
    for t in [*first[10:], late]:
        t.release()
    for _ in range(3):                                   # on time while the limit is in use: + 1 each
        tickets = [admission.admit(MODEL, 1.0) for _ in range(admission.limit_now() - 1)]
        refusal(admission)
        clock.now += 0.2
        for t in tickets:
            t.first_token()
        for t in tickets:
            t.release()
    assert admission.limit_now() == 4 + 3 + 6 + 12
    stuck = [admission.admit(MODEL, 1.0) for _ in range(20)]
    clock.now += 1.01                                    # past their deadline, still no first token:
    with pytest.raises(OpenAIError):                     # the next arrival sees it, before any token comes,
        admission.check_room()                           # and is refused: 21 in flight, limit now
    assert admission.limit_now() == 10                   # min(25, 21 in flight) x 0.5, once
    for t in stuck:
        t.first_token()                                  # counted late already: not again
    assert admission.limit_now() == 10
    for t in [*stuck, kept]:
        t.release()
    assert admission.limit_now() == 16                   # nothing in flight: the edge forgets the overload
    assert Admission(AdmissionConfig(adaptive=False, max_active=50)).limit_now() == 50
    assert Admission(AdmissionConfig(max_active=50)).limit_now() == 50   # open from the start


def test_a_first_burst_that_starts_late_lowers_no_limit():
    """Nothing measured yet: the burst is admitted blind, and a cold server's slow first starts
    are the ordinary burst, not overload."""
    clock = Clock()
    admission = Admission(AdmissionConfig(ttft_slo_multiple=0, initial_active=40), clock=clock)
    burst = [admission.admit(m, 1.0) for m in (MODEL, OTHER_MODEL) for _ in range(12)]
    clock.now += 3.0                                     # every one 2 s past its TTFT SLO
    for t in burst:
        t.first_token()
    assert admission.limit_now() == 40
    assert [admission.admit(MODEL, 1.0) for _ in range(16)]   # 24 + 16 = the whole limit


def test_before_anything_is_measured_the_engines_known_speed_predicts_the_start():
    clock = Clock()
    rates = {MODEL: 10.0}                                # the cluster starts 10 of MODEL a second
    admission = Admission(AdmissionConfig(max_waiting=1000, cold_waiting=4), clock=clock, engine_rate=rates.get)
    queue = [admission.admit(MODEL, 1.0) for _ in range(10)]   # past the cold bound: (9 + 1) / 10 = 1 s
    assert admission.predicted_ttft_s(MODEL) == pytest.approx(1.1)
    assert "about 1.1 s" in refusal(admission).message  # (10 + 1) / 10 > 1 x its SLO
    assert admission.admit(MODEL, 2.0) is not None       # a looser SLO still fits
    others = [admission.admit(OTHER_MODEL, 1.0) for _ in range(4)]   # nothing known of it: the cold bound
    assert "4 requests waiting to start and no known start rate yet" in refusal(admission, OTHER_MODEL).message
    for t in queue[:5]:                                  # a standing queue starts 2 a second: measured wins
        clock.now += 0.5
        t.first_token()
    assert admission.predicted_ttft_s(MODEL) == pytest.approx((6 + 1) / 2)


def test_a_client_asking_for_an_impossible_ttft_slo_does_not_lower_the_limit_for_everyone():
    engine = make_engine(tokens_per_frame=2, frame_interval_s=0.3)   # first tokens 0.3 s after arrival
    ingress = OpenAIIngress(engine, IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16,
                                                  admission=AdmissionConfig(initial_active=8)))

    async def run() -> None:
        async def one(body: dict) -> None:
            async for _ in ingress.generate_frames(IngressRequest("completions", body)):
                pass
        tight = {"model": MODEL, "prompt": "x", "max_tokens": 2, "ttft_slo_s": 0.001}
        await asyncio.gather(*(one(tight) for _ in range(6)))

    asyncio.run(run())
    assert ingress.admission.limit_now() >= 8            # late for their 1 ms, on time for the server's SLO


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "first", "release"]), st.sampled_from([MODEL, OTHER_MODEL]),
                          st.integers(0, 20)), max_size=80))
def test_counts_stay_within_bounds_and_return_to_zero(ops):
    clock = Clock()
    config = AdmissionConfig(max_waiting=4, max_active=6)
    admission = Admission(config, clock=clock)
    tickets = {MODEL: [], OTHER_MODEL: []}
    for op, model, pick in ops:
        clock.now += 0.01
        live = tickets[model]
        if op == "admit":
            try:
                live.append(admission.admit(model, 1.0))
            except OpenAIError as e:
                assert e.status == 429
        elif live:
            t = live[pick % len(live)]
            if op == "first":
                t.first_token()
            else:
                t.release()
                live.remove(t)
        assert admission.active <= config.max_active
        assert all(0 <= admission.waiting(m) <= config.max_waiting for m in tickets)
    for live in tickets.values():
        for t in live:
            t.release()
    assert admission.active == 0 and admission.waiting(MODEL) == admission.waiting(OTHER_MODEL) == 0


def _post(base_url: str, body: dict) -> tuple[int, dict, str]:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        if not body.get("stream"):
            resp = client.post("/v1/completions", json=body)
            return resp.status_code, dict(resp.headers), resp.text
        with client.stream("POST", "/v1/completions", json=body) as resp:
            return resp.status_code, dict(resp.headers), "".join(resp.iter_text())


def test_over_capacity_some_get_429_with_retry_after_and_every_accepted_request_completes():
    engine = make_engine(tokens_per_frame=2, frame_interval_s=1.5)   # the first token 1.5 s after arrival
    config = IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16,
                           admission=AdmissionConfig(max_waiting=4, ttft_slo_multiple=0))
    tok = engine.tokenizer(MODEL)
    prompt = "admission keeps a bounded queue"
    _, text = expected_output(tok, tok.encode(prompt), 6)
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": 6, "stream": i % 2 == 1} for i in range(16)]
    with running_server(engine, config) as base_url, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda b: _post(base_url, b), bodies))
        refused = [(h, json.loads(t)) for s, h, t in results if s == 429]
        accepted = [(b, t) for b, (s, _, t) in zip(bodies, results) if s == 200]
        assert len(refused) + len(accepted) == len(bodies)
        assert refused and len(accepted) >= 4
        for headers, body in refused:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded" and "waiting" in body["error"]["message"]
        for body, raw in accepted:   # nothing accepted is lost or cut
            if body["stream"]:
                chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
                assert "".join(c["choices"][0]["text"] for c in chunks) == text and raw.rstrip().endswith("[DONE]")
            else:
                assert json.loads(raw)["choices"][0]["text"] == text
        # Every place was given back: a full queue's worth is accepted again.
        again = list(pool.map(lambda b: _post(base_url, b), bodies[:4]))
        assert [s for s, _, _ in again] == [200] * 4


def test_a_request_whose_engine_goes_quiet_fails_with_a_clear_error_and_is_aborted():
    engine = make_engine(frame_interval_s=30.0)   # never produces within the test
    config = IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16, stall_timeout_s=0.5)
    with running_server(engine, config) as base_url, httpx.Client(base_url=base_url, timeout=20) as client:
        resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
        assert resp.status_code == 500
        error = resp.json()["error"]
        assert "timed out" in error["message"] and "0.5 s" in error["message"]
        with client.stream("POST", "/v1/chat/completions",
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "stream": True}) as stream:
            assert stream.status_code == 200
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "timed out" in json.loads(lines[-2][6:])["error"]["message"]
        assert {r.request_id for r in engine.seen} <= engine.aborted   # the engine was told to stop both


def test_in_cluster_callers_get_the_429_as_an_error_chunk():
    engine = make_engine(frame_interval_s=2.0)
    ingress = OpenAIIngress(engine, IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16,
                                                  admission=AdmissionConfig(max_waiting=1, ttft_slo_multiple=0)))

    async def run() -> list[list[dict]]:
        async def collect() -> list[dict]:
            return [c async for c in ingress.generate_frames(
                IngressRequest("completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}))]
        return await asyncio.gather(collect(), collect())

    served, refused = sorted(asyncio.run(run()), key=lambda chunks: "error" in chunks[0])   # either may win
    assert served[-1]["usage"]["completion_tokens"] == 2
    [error] = refused
    assert error["status"] == 429 and error["error"]["code"] == "rate_limit_exceeded"


def test_a_request_admission_refuses_is_refused_before_it_is_tokenised():
    """Under overload most requests are refused: each refusal must cost the edge no tokenising
    (the ingress admits once, before it tokenises; a request that is then not valid gives its
    place back)."""
    engine = make_engine(frame_interval_s=2.0)
    tokenized = []
    tokenizer = engine.tokenizer(MODEL)

    class Counting:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, *args, **kwargs):
            tokenized.append(args)
            return tokenizer(*args, **kwargs)

        def encode(self, *args, **kwargs):
            tokenized.append(args)
            return tokenizer.encode(*args, **kwargs)

    engine.tokenizer = lambda model: Counting()
    ingress = OpenAIIngress(engine, IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16,
                                                  admission=AdmissionConfig(max_waiting=1, ttft_slo_multiple=0)))
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}

    async def run() -> None:
        first = await ingress.prepare("completions", json.dumps(body))   # the model's one waiting place
        assert len(tokenized) == 1
        with pytest.raises(OpenAIError) as info:
            await ingress.prepare("completions", json.dumps(body))
        assert info.value.status == 429 and len(tokenized) == 1   # refused, never tokenised
        await first.frames.aclose()   # the request ends: its place is given back
        empty = {**body, "prompt": ""}
        with pytest.raises(OpenAIError) as info:   # admitted, then found invalid: its place is given back
            await ingress.prepare("completions", json.dumps(empty))
        assert info.value.status == 400 and ingress.admission.waiting(MODEL) == 0
        second = await ingress.prepare("completions", json.dumps(body))   # room again: tokenised as before
        assert len(tokenized) == 3 and ingress.admission.waiting(MODEL) == 1
        await second.frames.aclose()

    asyncio.run(run())
