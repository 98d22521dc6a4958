"""Open-loop load driver: send each request at its arrival time, record when tokens come back.

Open loop means arrivals never wait for completions: request i is sent at t0 + arrival_s
whether or not earlier requests have finished, so an overloaded system sees its queue grow
(as in production) instead of the driver slowing down to match it. A request's `arrival`
in its record is its scheduled time, so any lag in sending it counts against the system.

Idle stretches can be skipped (`idle_skip_s`): when nothing is in flight and the next
arrival is further away than idle_skip_s, the driver waits idle_skip_s of real idle time and
then moves its clock forward to that arrival. The system is empty then (every earlier
request has finished or timed out), so nothing a request sees changes; a bursty trace's long
silences simply stop costing wall time. Record times are on this run clock.

The system under test is a `Target`: one method that streams the new tokens of one
request. Chunks are lists of token ids or `OutputFrame`s. Every token is timestamped by the
driver when its chunk arrives (the client-observed time the SLO judges: a token the server
made but has not delivered is not served yet); an OutputFrame's own `token_times` (the
worker's wall clock) are kept beside them as `server_token_times`, a diagnostic of how much
the transport adds. An error is recorded on the request, never raised out of the run.

A refusal (HTTP 429, the target raises `Refused`) is sent again after its Retry-After, at most
`max_retries` times, as the openai SDK does (it retries twice); the record counts the retries
(`num_retries`), says whether the server still refused it at the end (`refused`), and its TTFT
counts from its first send.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import AsyncIterator, Awaitable, Callable, Iterator, Protocol, Sequence

from actors.heap import freeze_heap
from cluster.planner.metrics import RequestRecord
from cluster.planner.workloads import TraceRequest, Workload
from scheduler.messages import OutputFrame

logger = logging.getLogger(__name__)

Chunk = list[int] | OutputFrame
Prompt = str | list[int]


class Target(Protocol):
    def stream(self, model: str, prompt: Prompt, max_tokens: int,
               request_id: str) -> AsyncIterator[Chunk]: ...


class TargetError(RuntimeError):
    """The target answered, but with an error (HTTP status, error event)."""


class Refused(TargetError):
    """The target refused the request for now (HTTP 429); try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CallableTarget:
    """Any async generator function fn(model, prompt, max_tokens, request_id) as a Target."""

    def __init__(self, fn: Callable[[str, Prompt, int, str], AsyncIterator[Chunk]]):
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        self.fn = fn

    def stream(self, model: str, prompt: Prompt, max_tokens: int,
               request_id: str) -> AsyncIterator[Chunk]:
        return self.fn(model, prompt, max_tokens, request_id)


class OpenAIHTTPTarget:
    """POST {base_url}/v1/completions with stream=true and read the server-sent events.

    An event's tokens are its `tokenmux.token_ids` (tokenmux's extension: one delta may
    carry a frame of several tokens), else choices' `token_ids` when the server sends them,
    else one token per non-empty `text` delta (vLLM and most servers stream one token per
    event). `ignore_eos` (a vLLM/tokenmux extension)
    makes output lengths follow the trace.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, ignore_eos: bool = True,
                 extra_body: dict | None = None, connect_timeout_s: float = 10.0,
                 transport=None):
        import httpx

        if not base_url:
            raise ValueError("base_url must be non-empty")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ignore_eos = ignore_eos
        self.extra_body = dict(extra_body or {})
        # No read timeout here: the driver bounds each request with its own timeout.
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, transport=transport,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> "OpenAIHTTPTarget":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def stream(self, model: str, prompt: Prompt, max_tokens: int,
                     request_id: str) -> AsyncIterator[Chunk]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos,
                **self.extra_body}
        headers = {"X-Request-Id": request_id}
        async with self._client.stream("POST", "/v1/completions", json=body,
                                       headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                if resp.status_code == 429:
                    raise Refused(f"HTTP 429: {detail}", _retry_after_s(resp.headers.get("retry-after")))
                raise TargetError(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if event.get("error"):
                    raise TargetError(f"server error: {event['error']}")
                ext_ids = (event.get("tokenmux") or {}).get("token_ids")
                if ext_ids:   # tokenmux's extension: a frame may carry several tokens in one delta
                    yield [int(i) for i in ext_ids]
                for choice in [] if ext_ids else event.get("choices") or []:
                    ids = choice.get("token_ids")
                    if ids:
                        yield [int(i) for i in ids]
                    elif choice.get("text"):
                        yield [-1]  # id unknown; one streamed delta = one token
                usage = event.get("usage")
                if usage and usage.get("prompt_tokens"):
                    yield OutputFrame(request_id, num_prompt_tokens=int(usage["prompt_tokens"]))


async def _wait_unless(stop: asyncio.Event | None, aw) -> None:
    """Await `aw`, or stop waiting as soon as `stop` is set (then `aw` is cancelled)."""
    work = asyncio.ensure_future(aw)
    if stop is None:
        await work
        return
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (work, stopped):
            f.cancel()
        await asyncio.gather(work, stopped, return_exceptions=True)


async def _sleep_unless(stop: asyncio.Event | None, delay: float) -> None:
    await _wait_unless(stop, asyncio.sleep(delay))


class StopSignal:
    """Ctrl-C for a measurement: `installed()` routes SIGINT here; once set, every run driven
    with `event(loop)` stops sending, cancels its in-flight requests and returns its records
    (driver.run's `stop`). One signal serves runs on several event loops, one after another."""

    def __init__(self) -> None:
        self._set = False
        self._events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for loop, event in self._events:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def event(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """An Event for runs on `loop`, set when this signal is (already set if it was)."""
        event = asyncio.Event()
        if self._set:
            event.set()
        self._events = [(lp, ev) for lp, ev in self._events if not lp.is_closed()] + [(loop, event)]
        return event

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignal"]:
        """SIGINT sets this signal while inside (a second one interrupts as usual)."""
        import signal

        def handler(signum, frame) -> None:
            if self._set:
                raise KeyboardInterrupt
            logger.warning("interrupted: stopping the run, keeping what was measured")
            self.set()

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _retry_after_s(header: str | None) -> float:
    """Seconds a Retry-After header asks for (1 when absent or not a number of seconds)."""
    try:
        return max(0.0, float(header)) if header is not None else 1.0
    except ValueError:
        return 1.0


_WORDS = ("the of and to in is for on that with as it at by from this be are or an was "
          "have not but all can one more will time new some about out up other into "
          "only over after also most first work like just year any people way two").split()


def make_prompt(num_tokens: int, seed: int, *, vocab_size: int | None = None,
                low: int = 0) -> Prompt:
    """A deterministic prompt: token ids in [low, vocab_size) when vocab_size is given,
    else text of num_tokens common words (about one token each with most tokenizers)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
    rng = random.Random(seed)
    if vocab_size is None:
        return " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
    if not 0 <= low < vocab_size:
        raise ValueError(f"need 0 <= low < vocab_size, got low={low} vocab_size={vocab_size}")
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]


class _Clock:
    """Seconds since the start of the run, plus the idle time skipped so far."""

    def __init__(self) -> None:
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self.skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.skipped

    def from_wall(self, t: float) -> float:
        """A time.time() stamp taken while a request was in flight, on the run clock."""
        return t - self.wall0 + self.skipped


async def _send_one(target: Target, req: TraceRequest, rec: RequestRecord, prompt: Prompt,
                    timeout_s: float, clock: _Clock, max_retries: int = 0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await _receive(target, req, rec, prompt, clock)
                    break
                except Refused as refusal:
                    if rec.num_retries >= max_retries:
                        rec.refused = True
                        raise
                    rec.num_retries += 1
                    await asyncio.sleep(refusal.retry_after_s)
    except TimeoutError:
        rec.error = f"timeout after {timeout_s:g} s"
    except asyncio.CancelledError:
        rec.error = "cancelled"
        raise
    except Exception as e:  # the target's failure is a measurement, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = clock.now()
        rec.num_output_tokens = len(rec.token_times)
        rec.first_token_time = rec.token_times[0] if rec.token_times else None


async def _receive(target: Target, req: TraceRequest, rec: RequestRecord, prompt: Prompt, clock: _Clock) -> None:
    """One send of the request: its tokens stamped into `rec` as they arrive."""
    agen = target.stream(req.model, prompt, req.output_len, rec.request_id)
    try:
        async for chunk in agen:
            now = clock.now()
            if isinstance(chunk, OutputFrame):
                if chunk.num_prompt_tokens:
                    rec.num_prompt_tokens = chunk.num_prompt_tokens
                rec.worker_id = chunk.worker_id or rec.worker_id
                ids = chunk.token_ids
                rec.token_times.extend([now] * len(ids))
                if len(chunk.token_times) == len(ids):
                    rec.server_token_times.extend(clock.from_wall(t) for t in chunk.token_times)
                if chunk.error:
                    rec.error = chunk.error
                    break
            else:
                rec.token_times.extend([now] * len(chunk))
    finally:
        aclose: Callable[[], Awaitable[None]] | None = getattr(agen, "aclose", None)
        if aclose is not None:
            try:
                await asyncio.wait_for(aclose(), 5.0)
            except BaseException:  # closing a broken or cancelled stream must not hang the run
                pass


async def run(target: Target, workload: Workload | Sequence[TraceRequest], *,
              duration_s: float | None = None, max_requests: int | None = None,
              request_timeout_s: float = 120.0, drain_timeout_s: float | None = None,
              vocab_size: int | None = None, seed: int = 0, progress: bool = False,
              idle_skip_s: float | None = None, max_retries: int = 0,
              stop: asyncio.Event | None = None, id_prefix: str = "req") -> list[RequestRecord]:
    """Replay `workload` against `target` open loop; one record per request sent.

    Requests arriving at or after duration_s, or beyond the first max_requests, are not
    sent. After the last arrival, in-flight requests get drain_timeout_s (default
    request_timeout_s + 1 s) to finish; the rest are cancelled and recorded as errors. Times in
    the records are seconds since the start of the run (idle stretches longer than
    idle_skip_s skipped, see the module docstring). Prompts are token ids when vocab_size is
    given, else text (see make_prompt), seeded per request from `seed`. A refused request is
    sent again up to `max_retries` times (see the module docstring).

    `stop` (an Event; a SIGINT handler sets it) ends the run early: nothing more is sent,
    in-flight requests are cancelled (their records say "cancelled") and the records of
    everything sent so far come back. Request ids are `{id_prefix}-{i:06d}` (the records'
    ids, sent to an HTTP server as X-Request-Id).
    """
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
    if idle_skip_s is not None and not idle_skip_s > 0:
        raise ValueError(f"idle_skip_s must be > 0 or None, got {idle_skip_s!r}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0, got {max_requests!r}")
    todo = [r for r in workload if duration_s is None or r.arrival_s < duration_s]
    todo = todo[:max_requests] if max_requests is not None else todo
    # default: long enough for every in-flight request to hit its own timeout first
    drain_s = request_timeout_s + 1.0 if drain_timeout_s is None else drain_timeout_s

    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc="requests", unit="req", disable=not progress)
    # the client stamps every token: a collector pass over the records of earlier runs (a
    # published run keeps ~16k) must not pause it mid-run (actors/heap.py); before the clock starts
    freeze_heap()
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    clock = _Clock()
    try:
        for i, req in enumerate(todo):
            delay = req.arrival_s - clock.now()
            if idle_skip_s is not None and delay > idle_skip_s:
                busy = [t for t in tasks if not t.done()]
                if busy:   # the in-flight requests may end well before this arrival
                    await asyncio.wait(busy, timeout=delay - idle_skip_s)
                if all(t.done() for t in tasks) and req.arrival_s - clock.now() > idle_skip_s:
                    await asyncio.sleep(idle_skip_s)   # real idle time first: the system settles
                    if all(t.done() for t in tasks):
                        clock.skipped += max(0.0, req.arrival_s - clock.now())
                delay = req.arrival_s - clock.now()
            if delay > 0:
                await _sleep_unless(stop, delay)
            if stop is not None and stop.is_set():
                break
            rec = RequestRecord(f"{id_prefix}-{i:06d}", req.model, arrival=req.arrival_s,
                                num_prompt_tokens=req.input_len)
            prompt = make_prompt(req.input_len, seed * 1_000_003 + i, vocab_size=vocab_size)
            task = asyncio.create_task(
                _send_one(target, req, rec, prompt, request_timeout_s, clock, max_retries))
            task.add_done_callback(lambda _: bar.update(1))
            records.append(rec)
            tasks.append(task)
        pending = [t for t in tasks if not t.done()]
        if pending and not (stop is not None and stop.is_set()):
            await _wait_unless(stop, asyncio.wait(pending, timeout=drain_s))
            pending = [t for t in tasks if not t.done()]
            if pending and not (stop is not None and stop.is_set()):
                logger.warning("%d requests still running %.1f s after the last arrival; "
                               "cancelling them", len(pending), drain_s)
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        for rec in records:
            if rec.end is None:  # cancelled before it started
                rec.error, rec.end = "cancelled", clock.now()
    errors = sum(r.error is not None for r in records)
    logger.info("sent %d requests in %.1f s (%.1f s idle skipped), %d errors", len(records),
                time.perf_counter() - clock.t0, clock.skipped, errors)
    return records
