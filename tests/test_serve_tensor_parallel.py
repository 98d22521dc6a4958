"""A tensor-parallel model through the product path (issue 44): the real Serve app on 2
virtual devices, `tensor_parallel: {big: 2}` in its args, beside two single-device zoo
models. The topology's placement service forms the group (both workers join one TPGroup,
the leader holding its member's handle) with nothing done by hand; a burst of streamed
greedy completions over the OpenAI API, mixing the three models, comes back exactly as
transformers' generate() makes them, and both devices ran the group's steps. Then the
group's member is killed mid-burst: no request is lost and every output stays exact."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.greedy_reference import hf_greedy
from tests.net import free_port

APP = "tokenmux-tp"
MiB = 1 << 20
MODELS = {"big": "llama-tiny-b", "llama": "llama-tiny-a", "qwen2": "qwen2-tiny-a"}
ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2, "policy": "token", "max_tokens_cap": 2000,
        "tensor_parallel": {"big": 2}}
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello", "A model", "Once upon a time there was"]
MAX_TOKENS = 24
MAX_TOKENS_LONG = 64   # the group's streams are still going when its member is killed


@pytest.fixture(scope="module")
def served(ray_session, zoo_model):
    from deploy.local import run_local

    paths = {name: str(zoo_model(zoo)) for name, zoo in MODELS.items()}
    with run_local(paths, port=free_port(), app_name=APP, **ARGS) as base:
        yield base, paths


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                  started: asyncio.Event | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = ""
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                data = json.loads(line[5:])
                assert "error" not in data, (model, prompt, text, data)
                text += data["choices"][0]["text"]
                if started is not None and text:
                    started.set()
    return {"model": model, "prompt": prompt, "text": text, "max_tokens": max_tokens}


def burst(url: str, requests: list[tuple[str, str]], max_tokens: int = MAX_TOKENS, during=None) -> list[dict]:
    """Every (model, prompt) streamed at once; `during()` is awaited once the first text came."""
    async def send():
        started = asyncio.Event()
        async with httpx.AsyncClient() as client:
            streams = asyncio.gather(*(_stream(client, url, m, p, max_tokens, started) for m, p in requests))
            if during is not None:
                await asyncio.wait_for(started.wait(), 120)
                await asyncio.to_thread(during)
            return await streams
    return asyncio.run(send())


def assert_exact(results: list[dict], paths: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    for r in results:
        tokenizer = AutoTokenizer.from_pretrained(paths[r["model"]])
        want = hf_greedy(paths[r["model"]], tokenizer(r["prompt"])["input_ids"], r["max_tokens"])
        assert r["text"] == tokenizer.decode(want, skip_special_tokens=True), (r["model"], r["prompt"])


@pytest.mark.timeout(300)
def test_a_tp2_model_beside_single_device_models_serves_a_burst_exactly(served):
    import ray

    from deploy.app_handles import cluster_handle

    url, paths = served
    status = cluster_handle(APP).status.remote().result(timeout_s=60)
    group = status.plan.group_of("big")
    assert len(group) == 2 and status.plan.workers_for("big") == group[:1], status.plan.to_dict()

    assert_exact(burst(url, [(m, p) for p in PROMPTS for m in MODELS]), paths)

    workers = cluster_handle(APP).worker_handles.remote().result()
    timelines = {w: ray.get(workers[w].timeline.remote()) for w in group}
    for w, timeline in timelines.items():   # the member's steps are the leader's, followed
        assert any(r.model == "big" for r in timeline), (w, {r.model for r in timeline})


@pytest.mark.timeout(400)
def test_a_member_killed_mid_burst_loses_no_request(served):
    """The group's member dies while a burst streams: the leader holds the group's requests
    with the output their clients have, the supervisor replaces the member on its device,
    placement forms the group again (the leader leaves the broken one), and every request
    goes on to the exact output; requests of the member's own models resume elsewhere."""
    import ray

    from deploy.app_handles import cluster_handle

    url, paths = served
    before = cluster_handle(APP).status.remote().result(timeout_s=60).plan.group_of("big")
    workers = cluster_handle(APP).worker_handles.remote().result()
    member = workers[before[1]]

    results = burst(url, [("big", p) for p in PROMPTS * 2] + [(m, p) for p in PROMPTS[:2] for m in MODELS if m != "big"],
                    max_tokens=MAX_TOKENS_LONG, during=lambda: ray.kill(member))
    assert_exact(results, paths)
    after = cluster_handle(APP).status.remote().result(timeout_s=60).plan.group_of("big")
    assert after[0] == before[0] and after[1] not in before, (before, after)


def test_zz_undeploy(served):
    from ray import serve

    from deploy.local import undeploy

    undeploy(APP)
    assert APP not in serve.status().applications
