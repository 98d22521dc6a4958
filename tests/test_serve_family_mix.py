"""The issue-40 mix over HTTP: Qwen3, Qwen3-MoE, Gemma 3 and Llama on ONE device worker (two
weight slots, token-level policy) of the real Serve app, hit by a burst of streamed greedy
completions. Every text equals transformers' generate(), and the worker's step timeline shows
the models switched out while their requests were still streaming, and back in."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.greedy_reference import hf_greedy
from tests.net import free_port

APP = "tokenmux-family-mix"
MiB = 1 << 20
ARGS = {"devices_per_node": 1, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2, "policy": "token", "max_tokens_cap": 2000,
        "slo": {"ttft_s": 0.5, "tbt_s": 0.05}}   # tight: tiny models would finish a burst before a switch is due
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello", "A model", "Once upon a time there was"]
MAX_TOKENS = 128   # long enough that the models are busy together: the burst reaches the worker over ~0.5 s


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory, zoo_model):
    from family_checkpoints import gemma3, qwen3, qwen3_moe

    from deploy.local import run_local

    paths = {"qwen3": str(qwen3(tmp_path_factory.mktemp("qwen3"))),
             "qwen3-moe": str(qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"))),
             "gemma3": str(gemma3(tmp_path_factory.mktemp("gemma3"))),
             "llama": str(zoo_model("llama-tiny-a"))}
    with run_local(paths, port=free_port(), app_name=APP, **ARGS) as base:
        yield base, paths


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, times = "", []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                text += chunk["choices"][0]["text"]
                times.append(time.time())
    return {"model": model, "prompt": prompt, "text": text, "first": times[0], "last": times[-1]}


@pytest.mark.slow
def test_a_burst_over_four_families_on_one_worker_is_exact_and_switched_token_by_token(served):
    import ray
    from transformers import AutoTokenizer

    from deploy.app_handles import cluster_handle
    from load_tests.contenders import turns_from_timelines

    url, paths = served
    burst = [(model, prompt) for prompt in PROMPTS for model in paths]   # 16 requests at once

    async def send():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(_stream(client, url, m, p) for m, p in burst))

    since = time.time()
    results = asyncio.run(send())
    for r in results:
        tokenizer = AutoTokenizer.from_pretrained(paths[r["model"]])
        want = hf_greedy(paths[r["model"]], tokenizer(r["prompt"])["input_ids"], MAX_TOKENS)
        assert r["text"] == tokenizer.decode(want, skip_special_tokens=True), (r["model"], r["prompt"])

    workers = cluster_handle(APP).worker_handles.remote().result()
    assert len(workers) == 1
    (handle,) = workers.values()
    turns = turns_from_timelines({"w": ray.get(handle.timeline.remote())}, since)

    def switched_out_and_back(model: str) -> bool:   # another model's turn between two of its own, mid-stream
        last = max(r["last"] for r in results if r["model"] == model) - since
        mine = [i for i, t in enumerate(turns) if t.model == model and t.end <= last]
        return bool(mine) and any(t.model != model for t in turns[mine[0]:mine[-1]])

    # The burst reaches the worker over a fraction of a second: the first model may run alone
    # until the TTFT slack of the others calls a switch, and finish; every other model shares.
    switched = [m for m in paths if switched_out_and_back(m)]
    assert len(switched) >= len(paths) - 1, \
        f"only {switched} were switched out mid-stream: {[(t.model, round(t.end, 2)) for t in turns]}"


def test_zz_undeploy(served):
    from ray import serve

    from deploy.local import undeploy

    undeploy(APP)
    assert APP not in serve.status().applications
