"""`tokenmux bench first-use`: what a new user sends first, against fresh servers, scored against floors.

Each scenario starts its own server as `tokenmux serve` would (local Ray, 2 virtual devices,
loopback only, the app's default arguments), sends one burst at once, and stops it:

    bare_streams        bare `tokenmux serve` (the embedded default): 12 concurrent streams
                        of 200 tokens -> every one complete, no 429
    zoo_sdk             `tokenmux serve --models` with 6 tiny zoo models: 48 concurrent greedy
                        completions (8 per model) through the openai SDK with its default
                        settings -> 48 done, each equal to transformers' greedy output, and
                        the 429s the SDK may have retried unseen counted
    bare_many_streams   bare `tokenmux serve`: 300 concurrent streams of 64 tokens -> every
                        one complete (they may queue), peak RSS of the workers and the ingress

Prints one JSON object (also written to --json FILE); exits 1 when a floor is not met.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

APP = "tokenmux-first-use"
ZOO_MODELS = ("llama-tiny-a", "llama-tiny-b", "llama-tiny-c", "qwen2-tiny-a", "qwen2-tiny-b", "mistral-tiny-a")
FLOORS = {"bare_streams_completed_frac": ("==", 1.0), "bare_streams_429": ("==", 0),
          "zoo_sdk_completed_frac": ("==", 1.0), "zoo_sdk_equal_to_transformers_frac": ("==", 1.0),
          "bare_many_streams_completed_frac": ("==", 1.0)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--only", choices=("bare_streams", "zoo_sdk", "bare_many_streams"), action="append",
                        help="run only this scenario (repeat for several; default: all)")


async def _streams(url: str, models: list[str], n: int, max_tokens: int) -> dict:
    """`n` streams at once, spread over `models`, no retries: how many complete, and the 429s."""
    import httpx

    async def one(client, i: int) -> tuple[int, bool]:
        body = {"model": models[i % len(models)], "prompt": f"Stream {i}: tell me about the river.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return resp.status_code, False
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        except httpx.HTTPError:
            return 0, False
        usage = [json.loads(line[6:]).get("usage") for line in lines if line.startswith("data: {")]
        done = bool(lines) and lines[-1] == "data: [DONE]" and any(u and u["completion_tokens"] == max_tokens
                                                                   for u in usage)
        return 200, done

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(n)))
    return {"requests": n, "completed": sum(done for _, done in results),
            "completed_frac": sum(done for _, done in results) / n,
            "429": sum(status == 429 for status, _ in results),
            "other_failures": sum(status not in (200, 429) or (status == 200 and not done) for status, done in results),
            "wall_s": time.monotonic() - t0}


def _prompts(per_model: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(4, 24))] for _ in range(per_model)]


async def _sdk_burst(url: str, models: list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt to every model at once through openai.AsyncOpenAI with its default settings
    (its own retries of a 429 included); token ids per (model, prompt), or the error."""
    import httpx
    import openai

    seen_429 = []

    async def count(response: httpx.Response) -> None:
        if response.status_code == 429:
            seen_429.append(response.url.path)

    async def one(client, model: str, prompt: list[int]):
        try:
            done = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True})
            return done.model_extra["tokenmux"]["token_ids"]
        except openai.OpenAIError as exc:
            return f"{type(exc).__name__}: {exc}"

    async with httpx.AsyncClient(event_hooks={"response": [count]}, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http)
        pairs = [(m, p) for m in models for p in range(len(prompts))]
        outs = await asyncio.gather(*(one(client, m, prompts[p]) for m, p in pairs))
    return {"outputs": dict(zip(pairs, outs)), "429_seen_by_the_sdk": len(seen_429)}


def _transformers_greedy(paths: dict[str, str], prompts: list[list[int]], max_tokens: int) -> dict:
    """transformers' own greedy generate() of every prompt on every model: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for model, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        for p, prompt in enumerate(prompts):
            with torch.inference_mode():
                ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
            out[(model, p)] = ids[0, len(prompt):].tolist()
    return out


class PeakRSS:
    """Samples the app's workers' and ingress's RSS (chaos.rss_mb) every `interval_s` in a thread."""

    def __init__(self, app: str, interval_s: float = 0.5) -> None:
        self.app, self.interval_s = app, interval_s
        self.peak_mb, self.start_mb = 0.0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        from load_tests.bench.chaos import rss_mb

        while not self._stop.is_set():
            try:
                total = sum(rss_mb(self.app).values())
            except Exception:   # the status call failed once: the next sample counts
                total = 0.0
            self.start_mb = total if self.start_mb is None else self.start_mb
            self.peak_mb = max(self.peak_mb, total)
            self._stop.wait(self.interval_s)


def _serve(models):
    from deploy.local import run_local
    from load_tests.bench.chaos import free_port

    return run_local(models, port=free_port(), host="127.0.0.1", app_name=APP)


def bare_streams() -> dict:
    from deploy.local import DEFAULT_MODELS

    with _serve(dict(DEFAULT_MODELS)) as url:
        r = asyncio.run(_streams(url, sorted(DEFAULT_MODELS), 12, 200))
    return {f"bare_streams_{k}": v for k, v in r.items()}


def bare_many_streams() -> dict:
    from deploy.local import DEFAULT_MODELS

    with _serve(dict(DEFAULT_MODELS)) as url:
        with PeakRSS(APP) as rss:
            r = asyncio.run(_streams(url, sorted(DEFAULT_MODELS), 300, 64))
    return {**{f"bare_many_streams_{k}": v for k, v in r.items()},
            "bare_many_streams_rss_mb_at_start": rss.start_mb, "bare_many_streams_rss_mb_peak": rss.peak_mb}


def zoo_sdk(per_model: int = 8, max_tokens: int = 16) -> dict:
    from actors.zoo.zoo import ensure_model

    prompts = _prompts(per_model)
    with _serve(",".join(ZOO_MODELS)) as url:
        t0 = time.monotonic()
        burst = asyncio.run(_sdk_burst(url, list(ZOO_MODELS), prompts, max_tokens))
        wall_s = time.monotonic() - t0
    reference = _transformers_greedy({m: str(ensure_model(m)) for m in ZOO_MODELS}, prompts, max_tokens)
    outputs = burst["outputs"]
    done = [k for k, v in outputs.items() if isinstance(v, list)]
    equal = [k for k in done if outputs[k] == reference[k]]
    return {"zoo_sdk_requests": len(outputs), "zoo_sdk_completed": len(done),
            "zoo_sdk_completed_frac": len(done) / len(outputs),
            "zoo_sdk_equal_to_transformers_frac": len(equal) / len(outputs),
            "zoo_sdk_429_seen_by_the_sdk": burst["429_seen_by_the_sdk"],
            "zoo_sdk_errors": [v for v in outputs.values() if isinstance(v, str)][:3], "zoo_sdk_wall_s": wall_s}


SCENARIOS = {"bare_streams": bare_streams, "zoo_sdk": zoo_sdk, "bare_many_streams": bare_many_streams}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict = {}
    for name in args.only or SCENARIOS:
        results.update(SCENARIOS[name]())
    from load_tests.bench.chaos import floors

    results["floors"] = floors(results, FLOORS)
    text = json.dumps(results, indent=2, default=str)
    print(text, file=sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if all(v["met"] for v in results["floors"].values()) else 1
