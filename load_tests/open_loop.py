"""An open-loop HTTP load from its own process: requests sent at a fixed rate, whatever comes back.

The chaos bench's overload runs at 10x the server's capacity, ~100+ req/s. Sent with httpx
from the bench's own process (the Ray driver), the client fell behind its schedule on a
2-core host: an 8 s schedule took 33 s to send, its event loop lagged up to 3.6 s, and that
lag counted in every measured TTFT. Here a child process sends with aiohttp (Ray Serve's own
HTTP client, ~5x less CPU per request than httpx), and the result says how far it lagged
(`send_late_p99_s`, `loop_lag_p99_s`), so a reader can tell the server's time from the client's.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

LAG_PROBE_S = 0.01   # the client's event-loop lag is sampled this often


def run_open_loop(url: str, bodies: list[dict], rate: float) -> tuple[list[dict], dict]:
    """Send `bodies` to url's /v1/completions at `rate` per second from a child process; each
    request's outcome (see `_send`) and the client's own lag."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(open_loop, url, bodies, rate).result()


def open_loop(url: str, bodies: list[dict], rate: float) -> tuple[list[dict], dict]:
    return asyncio.run(_open_loop(url, bodies, rate))


async def _open_loop(url: str, bodies: list[dict], rate: float) -> tuple[list[dict], dict]:
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
            wait = i / rate - (time.monotonic() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            late.append(max(0.0, -wait))
            tasks.append(asyncio.ensure_future(_send(session, body)))
        sent_s = time.monotonic() - t0
        outcomes = await asyncio.gather(*tasks)
        prober.cancel()
    return outcomes, {"send_s": sent_s, "scheduled_s": (len(bodies) - 1) / rate if bodies else 0.0,
                      "send_late_p99_s": _quantile(late, 0.99), "loop_lag_p99_s": _quantile(lags, 0.99),
                      "loop_lag_max_s": max(lags, default=None)}


async def _send(session, body: dict) -> dict:
    """One completion: status, when it was sent and answered (monotonic; sent also as wall clock),
    tokens, finish reason, error, and for a stream when its first token was read and made."""
    out = {"status": 0, "error": None, "finish_reason": None, "num_tokens": 0, "sent_at": time.monotonic(),
           "sent_wall": time.time(), "answered_at": None, "first_token_at": None, "first_token_made": None}
    try:
        async with session.post("/v1/completions", json=body) as resp:
            out["status"], out["answered_at"] = resp.status, time.monotonic()
            if resp.status != 200:
                out["error"] = (await resp.text())[:200]
            elif not body.get("stream"):
                data = await resp.json()
                out["num_tokens"] = len(data["tokenmux"]["token_ids"])
                out["finish_reason"] = data["choices"][0]["finish_reason"]
            else:
                done = False
                async for raw in resp.content:
                    line = raw.decode().rstrip("\r\n")
                    done = done or line == "data: [DONE]"
                    if line.startswith("data: {"):
                        _read_chunk(out, json.loads(line[len("data: "):]))
                if not done:
                    out["error"] = out["error"] or "the stream ended without [DONE]"
    except Exception as exc:   # a cut connection, a timeout: the client saw a failure
        out["error"] = out["error"] or f"{type(exc).__name__}: {exc}"
    return out


def _read_chunk(out: dict, chunk: dict) -> None:
    if "error" in chunk:
        out["error"] = chunk["error"]["message"]
        return
    ext = chunk.get("tokenmux", {})
    ids = ext.get("token_ids", [])
    if ids and out["first_token_at"] is None:
        out["first_token_at"], out["first_token_made"] = time.monotonic(), ext["token_times"][0]
    out["num_tokens"] += len(ids)
    for choice in chunk.get("choices", []):
        out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]


def ok(out: dict) -> bool:
    return out["status"] == 200 and out["error"] is None and out["finish_reason"] is not None


def _quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
