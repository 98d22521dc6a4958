"""An open-loop HTTP load from its own process: requests sent at a fixed rate, whatever comes back.

The chaos bench's overload runs at 10x the server's capacity, ~100+ req/s. Sent with httpx
from the bench's own process (the Ray driver), the client fell behind its schedule on a
2-core host: an 8 s schedule took 33 s to send, its event loop lagged up to 3.6 s, and that
lag counted in every measured TTFT. Here a child process sends with aiohttp (which Ray Serve
already depends on; in the bench it kept to its schedule, 3 ms late at p99), and the result
says how far it lagged (`send_late_p99_s`, `loop_lag_p99_s`), so a reader can tell the
server's time from the client's. `Outcome` is one request as a client saw it, for this load
and the chaos bench's closed-loop bursts alike.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

LAG_PROBE_S = 0.01   # the client's event-loop lag is sampled this often


def run_open_loop(url: str, bodies: list[dict], rate: float,
                  at: list[float] | None = None) -> tuple[list[Outcome], dict]:
    """Send `bodies` to url's /v1/completions at `rate` per second (or each at its offset `at[i]`
    in seconds from the start: a bursty schedule) from a child process; each request's Outcome
    and the client's own lag."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if at is not None and len(at) != len(bodies):
        raise ValueError(f"at has {len(at)} offsets for {len(bodies)} bodies")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(open_loop, url, bodies, rate, at).result()


def open_loop(url: str, bodies: list[dict], rate: float, at: list[float] | None = None) -> tuple[list[Outcome], dict]:
    return asyncio.run(_open_loop(url, bodies, rate, at))


async def _open_loop(url: str, bodies: list[dict], rate: float,
                     at: list[float] | None = None) -> tuple[list[Outcome], dict]:
    import aiohttp

    lags: list[float] = []

    async def probe() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(time.monotonic() - t - LAG_PROBE_S)

    late: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        prober = asyncio.ensure_future(probe())
        t0 = time.monotonic()
        tasks = []
        for i, body in enumerate(bodies):
            wait = (i / rate if at is None else at[i]) - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            late.append(max(0.0, -wait))
            tasks.append(asyncio.ensure_future(_send(session, body)))
        sent_s = time.monotonic() - t0
        outcomes = await asyncio.gather(*tasks)
        prober.cancel()
    scheduled_s = ((len(bodies) - 1) / rate if at is None else max(at)) if bodies else 0.0
    return outcomes, {"send_s": sent_s, "scheduled_s": scheduled_s,
                      "send_late_p99_s": quantile(late, 0.99), "loop_lag_p99_s": quantile(lags, 0.99),
                      "loop_lag_max_s": max(lags, default=None)}


class Outcome:
    """One request as the client saw it."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.error: str | None = None
        self.status = 0
        self.finish_reason: str | None = None
        self.sent_at = time.monotonic()
        self.first_token_at: float | None = None     # when the client read it (monotonic)
        self.sent_wall = time.time()                  # wall clock when sent
        self.first_token_made: float | None = None   # when the worker made it (its token_times, wall clock)
        self.answered_at: float | None = None   # when the status line came
        self.num_429 = 0
        self.fingerprint: str | None = None       # the model version that served it (system_fingerprint)
        self.error_frame = False                  # the server ended the stream with an error chunk
        self.finished_at: float | None = None     # when the last byte came (monotonic)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None

    def read_chunk(self, chunk: dict) -> bool:
        """One SSE chunk of the stream taken in; True when it brought the first token."""
        if "error" in chunk:
            self.error, self.error_frame = chunk["error"]["message"], True
            return False
        self.fingerprint = chunk.get("system_fingerprint") or self.fingerprint
        ext = chunk.get("tokenmux", {})
        ids = ext.get("token_ids", [])
        first = bool(ids) and self.first_token_at is None
        if first:
            self.first_token_at, self.first_token_made = time.monotonic(), ext["token_times"][0]
        self.token_ids += ids
        for choice in chunk.get("choices", []):
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return first


async def _send(session, body: dict) -> Outcome:
    """One completion with aiohttp."""
    out = Outcome()
    try:
        async with session.post("/v1/completions", json=body) as resp:
            out.status, out.answered_at = resp.status, time.monotonic()
            if resp.status != 200:
                out.error = (await resp.text())[:200]
            elif not body.get("stream"):
                data = await resp.json()
                out.token_ids = data["tokenmux"]["token_ids"]
                out.finish_reason = data["choices"][0]["finish_reason"]
                out.fingerprint = data.get("system_fingerprint")
            else:
                done = False
                async for raw in resp.content:
                    line = raw.decode().rstrip("\r\n")
                    done = done or line == "data: [DONE]"
                    if line.startswith("data: {"):
                        out.read_chunk(json.loads(line[len("data: "):]))
                if not done:
                    out.error = out.error or "the stream ended without [DONE]"
    except Exception as exc:   # a cut connection, a timeout: the client saw a failure
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.finished_at = time.monotonic()
    return out


def quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile of xs (nearest rank), None when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
