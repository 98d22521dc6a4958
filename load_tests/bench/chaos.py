"""`tokenmux bench chaos`: a live local server under failures and abuse, as a client sees it.

The bench starts its own server (Ray with 2 virtual devices, loopback only, two tiny zoo
models) and runs, in this order, each bounded in requests and time:

    fuzz_5xx, poison_collateral  the HTTP edge fuzzed (load_tests/edge_fuzz.py)
    worker_kill_*                a burst of N mixed greedy requests (two models, streamed and
                                 not, 8-40 tokens) run undisturbed, then again with a DeviceWorker
                                 killed once a third of them have their first token:
                                 worker_kill_lost (failed or cut), worker_kill_exact (every one
                                 equals its undisturbed run), worker_replaced_s (kill -> a
                                 replacement on the device takes requests)
    router_kill_recovery_s       the GlobalRouter killed for good -> the first completion that
                                 succeeds again (one tried every 0.1 s)
    disconnect_*                 3 rounds of N streams abandoned after their first chunk;
                                 disconnect_hung_workers: workers still holding requests, and
                                 disconnect_inflight_after: requests still counted anywhere
                                 (router and engines), once the rounds end and settle
    overload_*                   an open-loop load at 10x the measured capacity for a few
                                 seconds, sent from a child process (load_tests/open_loop.py,
                                 its lag reported): 429s, the accepted that complete, their TTFT p99 against
                                 the TTFT SLO (send -> the worker made the first token; the
                                 client-read figure beside it adds this one client's lag), the RSS
                                 of the workers and the ingress before/after

Capacity is measured, not assumed: the undisturbed burst's requests per second.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import sys
import time

from load_tests.edge_fuzz import resend_429, retry_after_s
from load_tests.open_loop import Outcome, quantile, run_open_loop

logger = logging.getLogger(__name__)

APP = "tokenmux-chaos"
MODELS = {"llama-a": "zoo:llama-tiny-a", "qwen-b": "zoo:qwen2-tiny-b"}
MiB = 1 << 20
TTFT_SLO_S = 2.0
# Serve's bounds on the ingress sized to this host: on 2 cores its HTTP path processes ~100
# requests per second. What Serve's proxy holds past max_ongoing_requests waits before admission
# can see it (no deadline there): with 256 + 64 queued, accepted requests waited ~2-16 s for
# admission at 10x overload; with 96 + 8 queued, the 8 queued still waited up to 3.6 s (Serve's
# router probes a full replica with backoff) and were then accepted by an edge that saw no
# queue, so the proxy now holds one (the app's default) and refuses the rest at once.
SERVER_ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
               "host_kv_gb": 0.01, "num_slots": 2, "max_tokens_cap": 64, "default_max_tokens": 16,
               "max_ongoing_requests": 96, "max_queued_requests": 1,
               "slo": {"ttft_s": TTFT_SLO_S, "tbt_s": 0.5}}
FLOORS = {"worker_kill_lost": ("==", 0), "worker_kill_exact": ("==", True), "router_kill_recovery_s": ("<=", 10.0),
          "worker_replaced_s": ("<=", 30.0), "disconnect_hung_workers": ("==", 0),
          "overload_rejected_429": (">", 0), "accepted_completed_frac": ("==", 1.0),
          "accepted_ttft_p99_vs_slo": ("<=", 2.0), "overload_rss_growth_frac": ("<=", 0.25),
          "fuzz_5xx": ("==", 0), "poison_collateral": ("==", 0)}
OVERLOAD_FACTOR = 10.0
RETRY_429_S = 120.0   # a burst request refused by admission is sent again for this long, after Retry-After


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--requests", type=int, default=200, help="requests per burst and per disconnect round "
                                                                  "(default 200)")
    parser.add_argument("--overload-s", type=float, default=8.0, help="seconds of 10x overload (default 8)")
    parser.add_argument("--fuzz-examples", type=int, default=10, help="schemathesis examples per operation "
                                                                     "and mode (default 10)")
    parser.add_argument("--seed", type=int, default=0)


def bodies(n: int, seed: int = 0) -> list[dict]:
    """N mixed greedy requests: both models, streamed and not, 8-40 tokens."""
    rng = random.Random(seed)
    names = sorted(MODELS)
    return [{"model": names[i % len(names)], "prompt": f"Request {i}: {rng.choice(PROMPTS)}",
             "max_tokens": rng.randint(8, 40), "temperature": 0, "ignore_eos": True, "stream": i % 4 != 3}
            for i in range(n)]


PROMPTS = ("The quick brown fox", "Once upon a time", "In the beginning the model", "A list of numbers:",
           "Tokens move between devices when", "The weather today is")


async def send(client, body: dict, retry_429_s: float = 0.0, on_first_token=None) -> Outcome:
    """One completion; a 429 is sent again after its Retry-After while `retry_429_s` lasts."""
    async def attempt():
        out = Outcome()
        try:
            retry_after = await (_stream if body.get("stream") else _post)(client, body, out, on_first_token)
        except Exception as exc:   # a cut connection, a timeout: the client saw a failure
            out.error = out.error or f"{type(exc).__name__}: {exc}"
            retry_after = None
        return out.status, out, retry_after

    _, out, resends = await resend_429(attempt, retry_429_s)
    out.num_429 = resends
    return out


async def _post(client, body: dict, out: Outcome, on_first_token) -> float | None:
    resp = await client.post("/v1/completions", json=body)
    out.status, out.answered_at = resp.status_code, time.monotonic()
    if resp.status_code != 200:   # Serve's proxy answers its own 429 in plain text
        out.error = resp.text[:200]
        return retry_after_s(resp)
    data = resp.json()
    out.token_ids = data["tokenmux"]["token_ids"]
    out.finish_reason = data["choices"][0]["finish_reason"]
    return None   # a whole response has no first-token time of its own: TTFT is scored on streams


async def _stream(client, body: dict, out: Outcome, on_first_token) -> float | None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        out.status, out.answered_at = resp.status_code, time.monotonic()
        if resp.status_code != 200:
            out.error = (await resp.aread()).decode()[:200]
            return retry_after_s(resp)
        done = False
        async for line in resp.aiter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {") and out.read_chunk(json.loads(line[len("data: "):])) \
                    and on_first_token is not None:
                on_first_token()
        if not done:
            out.error = out.error or "the stream ended without [DONE]"
    return None


async def burst(url: str, batch: list[dict], during=None) -> tuple[list[Outcome], float]:
    """All of `batch` at once (429s sent again); `during(first_tokens)` runs beside it."""
    import httpx

    first_tokens = asyncio.Event()
    count = [0]

    def seen() -> None:
        count[0] += 1
        if count[0] >= len(batch) // 3:
            first_tokens.set()

    async def one(body):
        return await send(client, body, RETRY_429_S, seen)

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        side = asyncio.ensure_future(during(first_tokens)) if during else None
        outcomes = await asyncio.gather(*(one(b) for b in batch))
        if side is not None:
            await side
    return outcomes, time.monotonic() - t0


# ---- scenarios ----------------------------------------------------------------------


def worker_kill(url: str, n: int, seed: int) -> dict:
    import ray

    from deploy.app_handles import cluster_handle, cluster_status

    batch = bodies(n, seed)
    calm, calm_s = asyncio.run(burst(url, batch))
    killed: dict = {}

    async def kill(first_tokens: asyncio.Event) -> None:
        await first_tokens.wait()
        workers = await cluster_handle(APP).worker_handles.remote()
        victim = sorted(workers)[0]
        killed.update(id=victim, at=time.monotonic())
        ray.kill(workers[victim])
        killed["replaced_s"] = await asyncio.to_thread(_wait_replaced, victim, killed["at"], cluster_status)

    storm, _ = asyncio.run(burst(url, batch, kill))
    replaced_s = killed["replaced_s"]
    lost = [o for o in storm if not o.ok]
    return {"worker_kill_requests": n, "worker_kill_victim": killed["id"],
            "worker_kill_calm_ok": sum(o.ok for o in calm),
            "worker_kill_lost": len(lost), "worker_kill_lost_examples": [o.error for o in lost[:3]],
            "worker_kill_exact": all(s.ok and c.ok and s.token_ids == c.token_ids for s, c in zip(storm, calm)),
            "worker_kill_differ": sum(s.token_ids != c.token_ids for s, c in zip(storm, calm)),
            "worker_kill_429_retries": sum(o.num_429 for o in storm),
            "worker_replaced_s": replaced_s,
            "capacity_rps": sum(o.ok for o in calm) / calm_s}


def _wait_replaced(victim: str, killed_at: float, status_of, timeout_s: float = 120.0) -> float | None:
    """Seconds from the kill until a replacement of `victim` is live in the router, or None."""
    while time.monotonic() - killed_at < timeout_s:
        status = status_of(APP)
        new = next((r.replacement_id for r in status.replacements if r.worker_id == victim and r.replacement_id),
                   None)
        view = status.router.workers.get(new) if new else None
        if view is not None and view.alive:
            return time.monotonic() - killed_at
        time.sleep(0.1)
    return None


def router_kill(url: str) -> dict:
    import httpx
    import ray

    from deploy.app_handles import cluster_handle

    router = cluster_handle(APP).router.remote().result(timeout_s=30)
    body = {"model": sorted(MODELS)[0], "prompt": "After the router", "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    ray.kill(router)   # for good: no restart by Ray; the supervisor makes a new one
    failures = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() - t0 < 120:
            resp = client.post("/v1/completions", json=body)
            if resp.status_code == 200:
                return {"router_kill_recovery_s": time.monotonic() - t0, "router_kill_failed_meanwhile": failures}
            failures += 1
            time.sleep(0.1)
    return {"router_kill_recovery_s": None, "router_kill_failed_meanwhile": failures}


def disconnects(url: str, n: int, rounds: int = 3, settle_s: float = 30.0) -> dict:
    import httpx

    from deploy.app_handles import cluster_status

    async def abandon(client, body) -> None:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                async for _ in resp.aiter_raw():
                    break   # the first chunk, then the client is gone
        except Exception:
            pass

    async def one_round(seed: int) -> None:
        batch = [{**b, "stream": True, "max_tokens": 64} for b in bodies(n, seed)]
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=None)) as client:
            await asyncio.gather(*(abandon(client, b) for b in batch))

    before = dict(cluster_status(APP).router.pending)
    for r in range(rounds):
        asyncio.run(one_round(1000 + r))
    t0 = time.monotonic()
    while True:
        status = cluster_status(APP)
        inflight, hung = inflight_now(status)
        if (inflight == 0 and not hung) or time.monotonic() - t0 > settle_s:
            break
        time.sleep(0.2)
    leftover = {}
    if inflight:   # which requests the router still counts (picked by id, never released)
        import ray

        from deploy.app_handles import cluster_handle
        router = cluster_handle(APP).router.remote().result(timeout_s=60)
        leftover = ray.get(router.inflight_requests.remote())
    return {"disconnect_leftover_requests": leftover,
            "disconnect_rounds": rounds, "disconnect_streams": rounds * n, "disconnect_hung_workers": len(hung),
            "disconnect_inflight_after": inflight, "disconnect_router_pending": dict(status.router.pending),
            "disconnect_router_pending_before": before,
            "disconnect_settle_s": time.monotonic() - t0}


def inflight_now(status) -> tuple[int, list[str]]:
    """Requests still counted (router pending + engines' queued and running), and the workers holding any."""
    hung = [w for w, s in status.alive().items() if sum(s.engine.running.values()) + sum(s.engine.queue_depth.values())]
    engines = sum(sum(s.engine.running.values()) + sum(s.engine.queue_depth.values()) for s in status.alive().values())
    return engines + sum(status.router.pending.values()), hung


def overload(url: str, capacity_rps: float, duration_s: float, seed: int) -> dict:
    rate = OVERLOAD_FACTOR * capacity_rps
    batch = bodies(max(1, int(rate * duration_s)), seed + 7)
    rss_before = rss_mb()
    outcomes, client = run_open_loop(url, batch, rate)   # its own process: the client keeps to the schedule
    rss_after = rss_mb()
    accepted = [o for o in outcomes if o.status != 429]
    done = [o for o in accepted if o.ok]
    # TTFT of the accepted streams: send -> the worker made the first token (same clock, this host), and
    # send -> this client read it (adds the client's own lag)
    ttfts = sorted(o.first_token_made - o.sent_wall for o in done if o.first_token_made is not None)
    client_ttfts = sorted(o.first_token_at - o.sent_at for o in done if o.first_token_at is not None)
    refusals = sorted(o.answered_at - o.sent_at for o in outcomes if o.status == 429)
    p99 = quantile(ttfts, 0.99)
    growth = (sum(rss_after.values()) - sum(rss_before.values())) / max(1e-9, sum(rss_before.values()))
    return {"overload_rate_rps": rate, "overload_requests": len(outcomes),
            "overload_rejected_429": len(refusals),
            # Serve's proxy refuses in plain text once the ingress holds max_ongoing + max_queued
            "overload_rejected_by_proxy": sum("rate_limit_exceeded" not in (o.error or "")
                                              for o in outcomes if o.status == 429),
            "overload_accepted": len(accepted), "overload_client": client,
            "accepted_completed_frac": len(done) / len(accepted) if accepted else None,
            "accepted_failed_examples": [o.error for o in accepted if not o.ok][:3],
            "accepted_ttft_p50_s": quantile(ttfts, 0.5), "accepted_ttft_p99_s": p99, "ttft_slo_s": TTFT_SLO_S,
            "accepted_client_ttft_p50_s": quantile(client_ttfts, 0.5),
            "accepted_client_ttft_p99_s": quantile(client_ttfts, 0.99),
            # how long the edge took to say 429: time spent before admission (HTTP proxy, event loop)
            "rejected_429_latency_p50_s": quantile(refusals, 0.5),
            "rejected_429_latency_p99_s": quantile(refusals, 0.99),
            "accepted_ttft_p99_vs_slo": p99 / TTFT_SLO_S if p99 is not None else None,
            "overload_rss_mb_before": rss_before, "overload_rss_mb_after": rss_after,
            "overload_rss_growth_frac": growth}


def rss_mb(app: str = APP) -> dict[str, float]:
    """RSS of each DeviceWorker and the ingress replicas of the app, in MiB (from /proc)."""
    from deploy.app_handles import cluster_status

    pids = {w: s.pid for w, s in cluster_status(app).alive().items()}
    for entry in os.listdir("/proc"):   # the ingress replicas: Ray titles them ServeReplica:<app>:<deployment>
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f"ServeReplica:{app}:TokenmuxIngress".encode() in f.read():
                    pids[f"ingress-{entry}"] = int(entry)
        except (OSError, ValueError):
            continue
    rss = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            rss[name] = kb / 1024
        except (OSError, StopIteration):
            continue
    return rss


def edges(url: str, fuzz_examples: int, seed: int) -> dict:
    from load_tests.edge_fuzz import fuzz_5xx, poison_collateral

    fuzz = fuzz_5xx(url, max_examples=fuzz_examples, seed=seed)
    poison = asyncio.run(poison_collateral(url, sorted(MODELS)[0], num_innocent=8, max_tokens=24, seed=seed))
    return {**fuzz, **poison}


def floors(results: dict, table: dict | None = None) -> dict:
    """Each floor of `table` (default FLOORS) that `results` has: its bound and whether it is met."""
    checks = {"==": lambda a, b: a == b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b}
    return {k: {"floor": f"{op} {bound}", "met": results.get(k) is not None and checks[op](results[k], bound)}
            for k, (op, bound) in (table or FLOORS).items() if k in results}


def run_scenarios(url: str, n: int, overload_s: float, fuzz_examples: int, seed: int = 0,
                  with_edges: bool = True) -> dict:
    """Every scenario against the server at `url` (the app APP); the results with their floors
    (with_edges=False leaves out fuzz_5xx and poison_collateral)."""
    results: dict = {"requests": n, "seed": seed}
    if with_edges:
        results.update(edges(url, fuzz_examples, seed))
    results.update(worker_kill(url, n, seed))
    results.update(router_kill(url))
    results.update(disconnects(url, n))
    results.update(overload(url, results["capacity_rps"], overload_s, seed))
    results["floors"] = floors(results)
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    if args.requests < 3 or args.overload_s <= 0 or args.fuzz_examples < 1:
        raise ValueError("--requests must be >= 3, --overload-s > 0, --fuzz-examples >= 1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from deploy.local import run_local

    t0 = time.monotonic()
    with run_local(MODELS, port=free_port(), host="127.0.0.1", app_name=APP, **SERVER_ARGS) as url:
        results = run_scenarios(url, args.requests, args.overload_s, args.fuzz_examples, args.seed)
    results["wall_s"] = time.monotonic() - t0
    for key, verdict in results["floors"].items():
        print(f"{key:<28} {results.get(key)!s:<24} floor {verdict['floor']:<8} "
              f"{'met' if verdict['met'] else 'NOT MET'}", file=sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0
