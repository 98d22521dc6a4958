"""Open-loop driver against in-process targets that sleep per token, and against HTTP/SSE.

Timing is asserted only where it cannot flake on a loaded machine: a sleep never ends early,
so a measured gap is at least the target's sleep; where the driver must not wait (open loop,
timeouts, cancellation, skipped idle time), a target that would make it wait for an hour
fails the test through a generous bound on the whole run instead."""
import asyncio
import json
import time

import pytest

from cluster.planner.workloads import TraceRequest, Workload
from load_tests.driver import CallableTarget, OpenAIHTTPTarget, make_prompt, run
from scheduler.messages import OutputFrame


def workload(n, gap_s, model="m", input_len=4, output_len=3):
    return Workload(tuple(TraceRequest(i * gap_s, model, input_len, output_len) for i in range(n)))


HOUR = 3600.0
RUN_BOUND_S = 60.0   # a run that waits for what it must not wait for takes an hour, not this


def bounded(coro):
    return asyncio.run(asyncio.wait_for(coro, RUN_BOUND_S))


class SlowEngine:
    """Streams one token per `token_s`; notes when each request was sent and closed. With
    `hold_until`, no request streams before that many have been sent."""

    def __init__(self, token_s, hold_until=0):
        self.token_s = token_s
        self.hold_until = hold_until
        self.sent, self.closed, self.prompts = {}, set(), {}
        self._all_sent = None

    async def __call__(self, model, prompt, max_tokens, request_id):
        self.sent[request_id] = time.perf_counter()
        self.prompts[request_id] = prompt
        if self.hold_until:
            self._all_sent = self._all_sent or asyncio.Event()
            if len(self.sent) >= self.hold_until:
                self._all_sent.set()
            await self._all_sent.wait()
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.token_s)
                yield [i]
        finally:
            self.closed.add(request_id)


def test_open_loop_arrivals_do_not_wait_for_completions():
    # No request streams a token before all 8 were sent: a driver that waited for a
    # completion before the next send would wait for ever (here: fail the run's bound).
    engine = SlowEngine(token_s=0.1, hold_until=8)
    w = workload(8, gap_s=0.05)
    records = bounded(run(CallableTarget(engine), w))
    assert all(r.ok and r.num_output_tokens == 3 for r in records)
    assert [r.arrival for r in records] == [r.arrival_s for r in w]
    for r in records:   # the gaps the target made, as the client saw them
        assert r.ttft >= engine.token_s - 1e-3 and len(r.tbts) == 2
        assert all(g >= engine.token_s - 1e-3 for g in r.tbts)


def test_bounded_by_count_and_duration():
    engine = SlowEngine(token_s=0.01)
    w = workload(20, gap_s=0.1)
    assert len(asyncio.run(run(CallableTarget(engine), w, max_requests=3))) == 3
    recs = asyncio.run(run(CallableTarget(engine), w, duration_s=0.25))
    assert [r.arrival for r in recs] == pytest.approx([0.0, 0.1, 0.2])


def test_errors_timeouts_and_cancellation_are_recorded_not_raised():
    async def flaky(model, prompt, max_tokens, request_id):
        yield [1]
        if model == "raises":
            raise RuntimeError("engine died")
        if model == "frame-error":
            yield OutputFrame(request_id, finish_reason="error", error="out of memory")
        if model == "hangs":
            await asyncio.sleep(HOUR)
        yield [2]

    reqs = [TraceRequest(0.0, m, 2, 2) for m in ("ok", "raises", "frame-error", "hangs")]
    recs = bounded(run(CallableTarget(flaky), Workload(tuple(reqs)), request_timeout_s=0.3))
    by_model = {r.model: r for r in recs}
    assert by_model["ok"].error is None and by_model["ok"].num_output_tokens == 2
    assert by_model["raises"].error == "RuntimeError: engine died"
    assert by_model["raises"].num_output_tokens == 1  # the token before the failure counts
    assert by_model["frame-error"].error == "out of memory"
    assert by_model["hangs"].error.startswith("timeout")

    # a short drain cancels what is still running after the last arrival
    recs = bounded(run(CallableTarget(flaky), Workload((TraceRequest(0.0, "hangs", 2, 2),)),
                       request_timeout_s=HOUR, drain_timeout_s=0.2))
    assert recs[0].error == "cancelled" and recs[0].end is not None


def test_shutdown_cancels_and_closes_every_stream():
    engine = SlowEngine(token_s=HOUR)   # a shutdown that waited for the streams would take hours

    async def main():
        task = asyncio.create_task(run(CallableTarget(engine), workload(5, gap_s=0.02)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    bounded(main())
    assert len(engine.sent) == 5 and engine.closed == set(engine.sent)


def test_tokens_are_timed_when_the_client_gets_them_and_server_stamps_kept_beside():
    async def timed(model, prompt, max_tokens, request_id):
        now = time.time()
        # the server made both tokens long ago, but the client sees them only now, together
        yield OutputFrame(request_id, token_ids=[7, 8], token_times=[now - 0.5, now - 0.25],
                          num_prompt_tokens=11, worker_id="w3")
        await asyncio.sleep(0.2)
        yield OutputFrame(request_id, token_ids=[9], token_times=[time.time()])

    (r,) = asyncio.run(run(CallableTarget(timed), workload(1, 0.0)))
    assert r.tbts[0] == 0.0 and r.tbts[1] >= 0.2 - 1e-3
    assert r.ttft >= 0   # timed when received (the server's stamp is 0.5 s before the request was sent)
    server = r.server_token_times
    assert server[1] - server[0] == pytest.approx(0.25, abs=1e-6)
    assert server[0] < r.token_times[0] - 0.4
    assert r.num_prompt_tokens == 11 and r.worker_id == "w3"


def test_prompts_are_deterministic_token_ids_within_the_vocab():
    engine = SlowEngine(token_s=0.0)
    asyncio.run(run(CallableTarget(engine), workload(3, 0.0, input_len=50), vocab_size=100, seed=1))
    first = dict(engine.prompts)
    asyncio.run(run(CallableTarget(engine), workload(3, 0.0, input_len=50), vocab_size=100, seed=1))
    assert engine.prompts == first
    p = first["req-000000"]
    assert len(p) == 50 and all(0 <= t < 100 for t in p)
    assert p != first["req-000001"]
    text = make_prompt(20, seed=0)
    assert isinstance(text, str) and len(text.split()) == 20
    with pytest.raises(ValueError, match="num_tokens"):
        make_prompt(0, seed=0)


def _sse_app(seen):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        seen.append(body)
        if body["model"] == "missing":
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)

        async def events():
            for i in range(body["max_tokens"]):
                choice = ({"text": f" t{i}", "token_ids": [i]} if body["model"] == "ids"
                          else {"text": f" t{i}"})
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_openai_http_target_streams_sse():
    import httpx

    seen = []
    reqs = [TraceRequest(0.0, m, 6, 4) for m in ("ids", "text", "missing")]

    async def main():
        target = OpenAIHTTPTarget("http://test", transport=httpx.ASGITransport(app=_sse_app(seen)))
        async with target:
            return await run(target, Workload(tuple(reqs)), vocab_size=1000)

    recs = {r.model: r for r in asyncio.run(main())}
    assert recs["ids"].ok and recs["ids"].num_output_tokens == 4
    assert recs["text"].ok and recs["text"].num_output_tokens == 4
    assert recs["ids"].num_prompt_tokens == 6
    assert recs["missing"].error.startswith("TargetError: HTTP 404")
    body = next(b for b in seen if b["model"] == "ids")
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 4
    assert len(body["prompt"]) == 6 and all(isinstance(t, int) for t in body["prompt"])


def test_idle_stretches_are_skipped_and_times_stay_on_the_workload_clock():
    engine = SlowEngine(token_s=0.05)   # each request: 3 tokens, 0.15 s
    arrivals = (0.0, 0.05, HOUR, 2 * HOUR)
    w = Workload(tuple(TraceRequest(t, "m", 4, 3) for t in arrivals))
    records = bounded(run(CallableTarget(engine), w, idle_skip_s=0.3))   # not the hours the workload spans
    assert [r.arrival for r in records] == list(arrivals)
    for r in records:   # latencies are what they were: measured while the request was in flight, not the hour skipped
        assert r.ok and engine.token_s - 1e-3 <= r.ttft < RUN_BOUND_S
        assert 3 * engine.token_s - 1e-3 <= r.token_times[-1] - r.arrival < RUN_BOUND_S
    # the second request arrived while the first was in flight: nothing was skipped before it
    sends = sorted(engine.sent.values())
    assert sends[1] - sends[0] >= 0.05 - 1e-3
    with pytest.raises(ValueError, match="idle_skip_s"):
        asyncio.run(run(CallableTarget(engine), w, idle_skip_s=0.0))


def test_a_refused_request_is_sent_again_after_retry_after_and_counted_apart():
    """Against the real HTTP edge (a fake engine behind it) whose admission lets one request of
    the model wait at a time: sent at once, the others are refused with a 429; honoured as the
    openai SDK does, the retries bring every one in; without retries they end refused, not failed."""
    from deploy.openai_api.admission import AdmissionConfig
    from deploy.openai_api.config import IngressConfig
    from edge_helpers import MAX_TOKENS_CAP, MODEL, make_engine, running_server

    engine = make_engine(tokens_per_frame=1, frame_interval_s=0.3)
    config = IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16,
                           admission=AdmissionConfig(max_waiting=1, ttft_slo_multiple=0))
    burst = Workload(tuple(TraceRequest(0.0, MODEL, 4, 2) for _ in range(3)))

    async def drive(base_url, max_retries):
        async with OpenAIHTTPTarget(base_url) as target:
            return await run(target, burst, max_retries=max_retries)

    with running_server(engine, config) as base_url:
        retried = asyncio.run(drive(base_url, max_retries=4))
        once = asyncio.run(drive(base_url, max_retries=0))
    assert all(r.ok and r.num_output_tokens == 2 and not r.refused for r in retried)
    assert sorted(r.num_retries for r in retried)[0] == 0 and sum(r.num_retries for r in retried) >= 2
    refused = [r for r in once if not r.ok]
    assert len(refused) == 2 and all(r.refused and r.num_retries == 0 for r in refused)
    assert all(r.error.startswith("Refused: HTTP 429") for r in refused)
