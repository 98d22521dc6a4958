"""Fuzz the HTTP edge of a live tokenmux server (loopback), as an adversarial client would.

    fuzz_5xx(url)               -> {"fuzz_cases", "fuzz_5xx", "fuzz_5xx_examples"}
    poison_collateral(url, m)   -> {"poison_requests", "poison_accepted", "poison_5xx", "poison_collateral", ...}

`fuzz_5xx` is a bounded schemathesis run over the server's own OpenAPI spec: requests that
fit the spec and requests that break it, for every operation; any 5xx is a bug (bad input
must get a 4xx naming the problem). `poison_collateral` sends requests carrying NaN, inf,
denormal and huge numbers in every numeric field while innocent greedy streams run on the
same workers, and counts the innocents whose output differs from an undisturbed run or
that fail: one bad request must fail only itself. Both are deterministic for a seed.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import time

NUMERIC_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "presence_penalty",
                  "frequency_penalty", "ttft_slo_s", "tbt_slo_s")
# JSON literals: NaN / Infinity are what Python's json and many clients emit for non-finite floats.
BAD_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e-40", "5e-324", "1e30",
               str(2**63), str(-(2**63) - 1), str(10**40), "0", "-1")


def fuzz_5xx(url: str, headers: dict[str, str] | None = None, max_examples: int = 25, seed: int = 0,
             timeout_s: float = 60.0) -> dict:
    """A bounded schemathesis run over `url`/openapi.json: cases that fit the spec and
    cases that break it, `max_examples` of each per operation; returns how many got a 5xx.
    Half the bodies that name a model are pointed at a served one, so the fuzz reaches
    tokenisation, limits and the engine rather than stopping at the unknown-model 404.
    (Cases are sent with httpx: schemathesis' own requests transport is not used.)"""
    import httpx
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable

    headers = dict(headers or {})
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers, timeout=timeout_s)
    cases, failures = [0], []
    with httpx.Client(timeout=timeout_s) as client:
        served = [m["id"] for m in client.get(f"{url}/v1/models", headers=headers).json()["data"]]
        rng = random.Random(seed)
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

                @hypothesis_seed(seed)
                @settings(max_examples=max_examples, deadline=None, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case) -> None:
                    kwargs = case.as_transport_kwargs(base_url=url, headers=headers)
                    body = kwargs.get("json")
                    if isinstance(body, dict) and "model" in body and served and rng.random() < 0.5:
                        body["model"] = rng.choice(served)
                    response = client.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                              params=kwargs.get("params"), json=body,
                                              content=kwargs.get("data"))
                    cases[0] += 1
                    if response.status_code >= 500:
                        failures.append({"operation": operation.label, "status": response.status_code,
                                         "body": body if body is not None else kwargs.get("data"),
                                         "response": response.text[:300]})

                try:
                    run()
                except Unsatisfiable:   # nothing breaks the spec of an operation without parameters
                    continue
    return {"fuzz_cases": cases[0], "fuzz_5xx": len(failures), "fuzz_5xx_examples": failures[:5]}


def poison_bodies(model: str, seed: int = 0, limit: int | None = None) -> list[str]:
    """Raw JSON bodies, each with one bad number in one field (or a few at once)."""
    bodies = []
    for field, bad in itertools.product(NUMERIC_FIELDS, BAD_NUMBERS):
        bodies.append('{"model": %s, "prompt": "poison", "max_tokens": 4, "%s": %s}'
                      % (json.dumps(model), field, bad))
    rng = random.Random(seed)
    for _ in range(len(NUMERIC_FIELDS)):
        fields = rng.sample(NUMERIC_FIELDS, 3)
        parts = ", ".join(f'"{f}": {rng.choice(BAD_NUMBERS)}' for f in fields)
        bodies.append('{"model": %s, "prompt": "poison", %s}' % (json.dumps(model), parts))
    rng.shuffle(bodies)
    return bodies[:limit]


async def poison_collateral(url: str, model: str, headers: dict[str, str] | None = None, num_innocent: int = 8,
                            max_tokens: int = 24, poisons: list[str] | None = None, seed: int = 0,
                            timeout_s: float = 120.0) -> dict:
    """Innocent greedy streams alone, then again with `poisons` (raw JSON bodies) sent among them.
    A 429 is sent again after its Retry-After, as the openai SDK does: sent all at once, the
    poisons can outnumber what a server sized for its host takes at a time, and a refusal for
    that is the server's concurrency limit, not the poison (`poison_retried_429` says how many)."""
    import httpx

    headers = {"content-type": "application/json", **(headers or {})}
    poisons = poison_bodies(model, seed) if poisons is None else poisons
    innocents = [{"model": model, "prompt": f"Innocent request number {i}.", "max_tokens": max_tokens,
                  "temperature": 0, "ignore_eos": True, "stream": True} for i in range(num_innocent)]

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s) as client:
        def stream(body):
            return resend_429(lambda: _stream_ids(client, body), timeout_s)

        def post(body):
            return resend_429(lambda: _post_raw(client, body), timeout_s)

        alone = await asyncio.gather(*map(stream, innocents))
        results = await asyncio.gather(*map(stream, innocents), *map(post, poisons))
    undisturbed = [ids for _, ids, _ in alone]
    disturbed = [ids for _, ids, _ in results[:num_innocent]]
    statuses = [status for status, _, _ in results[num_innocent:]]
    collateral = sum(d != u or d is None for d, u in zip(disturbed, undisturbed))
    return {"poison_requests": len(poisons),
            "poison_accepted": sum(s == 200 for s in statuses),
            "poison_5xx": sum(s >= 500 for s in statuses),
            "poison_collateral": collateral,
            "poison_retried_429": sum(n for _, _, n in alone + results),
            "innocent_requests": num_innocent,
            "innocent_undisturbed_ok": all(u is not None and len(u) == max_tokens for u in undisturbed)}


async def resend_429(attempt, within_s: float):
    """Await `attempt()` -> (status, result, Retry-After s or None) and, while it answers 429
    with a Retry-After whose wait ends within `within_s` of the first try, wait that long and
    try again, as the openai SDK does. Returns (status, result, number of resends)."""
    deadline = time.monotonic() + within_s
    resends = 0
    while True:
        status, result, retry_after = await attempt()
        if status != 429 or retry_after is None or time.monotonic() + retry_after > deadline:
            return status, result, resends
        resends += 1
        await asyncio.sleep(retry_after)


def retry_after_s(resp) -> float:
    """A response's Retry-After in seconds (1 when absent or not a number)."""
    try:
        return max(0.0, float(resp.headers.get("retry-after", 1)))
    except ValueError:
        return 1.0


async def _stream_ids(client, body: dict) -> tuple[int, list[int] | None, float]:
    """(status, token ids of one streamed completion or None when it failed, Retry-After)."""
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, None, retry_after_s(resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return resp.status_code, None, 0.0
            ids += chunk.get("tokenmux", {}).get("token_ids", [])
    return resp.status_code, ids, 0.0


async def _post_raw(client, body: str) -> tuple[int, None, float]:
    resp = await client.post("/v1/completions", content=body.encode())
    return resp.status_code, None, retry_after_s(resp)

