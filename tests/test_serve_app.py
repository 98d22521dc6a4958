"""The real Serve app (deploy.serve_app.app:build_app) on the session Ray: 2 tiny zoo models, 2 virtual
devices. HTTP (httpx), the official openai SDK, the tokenmux client over HTTP and over a
Serve handle, errors, client disconnect, `tokenmux status`, and shutdown leaving nothing.

One app for the whole module (Serve start-up is slow here); the last test shuts it down.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.net import free_port

APP = "tokenmux"
MODELS = {"llama-a": "zoo:llama-tiny-a", "qwen-b": "zoo:qwen2-tiny-b", "moe-c": "zoo:mixtral-tiny-a"}
MiB = 1 << 20
ARGS = {"models": MODELS, "devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB,
        "kv_fraction": 0.25, "host_kv_gb": 0.01, "num_slots": 2, "max_tokens_cap": 2000}


@pytest.fixture(scope="module")
def url(ray_session):
    from ray import serve

    from deploy.local import run_local

    rest = {k: v for k, v in ARGS.items() if k != "models"}
    with run_local(MODELS, port=free_port(), app_name=APP, **rest) as base:   # joins the session Ray
        yield base
    assert APP not in serve.status().applications


def _workers():
    from deploy.app_handles import cluster_handle

    return cluster_handle(APP).worker_handles.remote().result(timeout_s=30)


def _body(model="llama-a", **kw):
    return {"model": model, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, **kw}


def test_a_fresh_server_serves_an_ordinary_burst_without_a_429(url):
    """The first thing a user sends: 24 completions at once through the openai SDK with its
    default settings. Every one completes, and the server refuses none (not even one the SDK
    would have retried unseen). Runs first: the server is fresh."""
    import asyncio

    import openai

    refused = []

    async def count_429(response: httpx.Response) -> None:
        if response.status_code == 429:
            refused.append(response.headers.get("retry-after"))

    async def burst() -> list:
        async with httpx.AsyncClient(event_hooks={"response": [count_429]}, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http)
            return await asyncio.gather(*(
                client.completions.create(model=model, prompt=f"Request {i}: the quick brown fox", max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
                for model in sorted(MODELS) for i in range(12)))

    done = asyncio.run(burst())
    assert refused == []
    assert [c.usage.completion_tokens for c in done] == [8] * 12 * len(MODELS)
    assert all(c.choices[0].finish_reason == "length" and c.choices[0].text for c in done)


def test_models_and_a_completion_over_http(url):
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert sorted(m["id"] for m in models["data"]) == sorted(MODELS)
    resp = httpx.post(f"{url}/v1/completions", json=_body(), timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"]
    assert httpx.get(f"{url}/health", timeout=10).json()["num_models"] == len(MODELS)


def test_a_moe_model_over_http_writes_transformers_greedy_text(url):
    """The sparse MoE among the served models: its greedy completion is generate()'s."""
    from transformers import AutoTokenizer

    from actors.zoo.zoo import ensure_model
    from tests.greedy_reference import hf_greedy

    path = ensure_model("mixtral-tiny-a")
    resp = httpx.post(f"{url}/v1/completions", json=_body("moe-c", max_tokens=10), timeout=60)
    assert resp.status_code == 200, resp.text
    tokenizer = AutoTokenizer.from_pretrained(path)
    want = hf_greedy(path, tokenizer("The quick brown fox")["input_ids"], 10)
    assert resp.json()["choices"][0]["text"].startswith(tokenizer.decode(want, skip_special_tokens=True))


def test_streamed_chat_over_http(url):
    body = {"model": "qwen-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_sdk_against_the_real_cluster(url):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert sorted(m.id for m in client.models.list()) == sorted(MODELS)
    done = client.completions.create(model="qwen-b", prompt="Once upon", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4 and done.choices[0].text
    stream = client.chat.completions.create(model="llama-a", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_tokenmux_client_over_http_and_over_a_serve_handle(url):
    from deploy.client import TokenmuxClient

    with TokenmuxClient(url) as over_http:
        a = over_http.complete("llama-a", "Hello there", max_tokens=5, temperature=0, ignore_eos=True)
    with TokenmuxClient.from_serve_app(APP) as in_cluster:
        assert sorted(in_cluster.models()) == sorted(MODELS)
        b = in_cluster.complete("llama-a", "Hello there", max_tokens=5, temperature=0, ignore_eos=True)
        chunks = list(in_cluster.stream_chat("qwen-b", [{"role": "user", "content": "hi"}], max_tokens=3,
                                             temperature=0, ignore_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5   # greedy: same tokens either way
    assert b.usage.completion_tokens == 5 and len(b.token_times) == 5
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].usage.completion_tokens == 3


def test_unknown_model_is_a_404_listing_the_models(url):
    resp = httpx.post(f"{url}/v1/completions", json=_body(model="nope"), timeout=30)
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "nope" in message and all(m in message for m in MODELS)


def test_client_disconnect_mid_stream_aborts_and_frees_kv(url):
    import ray

    workers = _workers()
    # 1,900 tokens of a tiny model take under a second with multi-step decode: on a busy host the
    # first chunk can reach us after the request has finished, so up to 3 tries to look at it running
    for _ in range(3):
        body = _body(max_tokens=1900, stream=True)
        seen = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                seen.append(line[:300])
                chunk = json.loads(line[5:]) if line.startswith("data:") and "[DONE]" not in line else {}
                if chunk.get("tokenmux", {}).get("token_ids"):   # tokens flow: the request is on a worker
                    break
            busy = [s.engine for s in ray.get([w.stats.remote() for w in workers.values()])]
        if any(s.running for s in busy):
            break
    assert any(s.running for s in busy) and min(s.kv_free_frac for s in busy) < 1.0, (busy, seen[-3:])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = [s.engine for s in ray.get([w.stats.remote() for w in workers.values()])]
        if all(not s.running and not s.queue_depth and s.kv_free_frac == 1.0 for s in stats):
            break
        time.sleep(0.2)
    assert all(not s.running and not s.queue_depth for s in stats), stats
    assert all(s.kv_free_frac == 1.0 for s in stats)
    # and the cluster still serves
    assert httpx.post(f"{url}/v1/completions", json=_body(max_tokens=2), timeout=60).status_code == 200


def test_status_table_shows_workers_and_models(url):
    from deploy.app_handles import cluster_status
    from deploy.cli.commands import format_status

    status = cluster_status()
    assert len(status.workers) == 2 and status.alive() == status.workers
    registered = set().union(*(w.engine.registered for w in status.workers.values()))
    assert registered == set(MODELS)
    table = format_status(status)
    assert all(wid in table for wid in status.workers) and all(m in table for m in MODELS)


@pytest.mark.gpu
def test_on_a_gpu_host_the_workers_run_on_cuda(url):
    from deploy.app_handles import cluster_status

    devices = {w.device for w in cluster_status().workers.values()}
    assert devices and all(str(d).startswith("cuda") for d in devices), devices
    resp = httpx.post(f"{url}/v1/completions", json=_body(max_tokens=8), timeout=120)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8


def test_zz_shutdown_leaves_no_tokenmux_actor(url):
    import ray
    from ray import serve

    from cluster.router import ROUTER_NAME
    from deploy.app_handles import cluster_handle
    from deploy.local import undeploy

    workers = list(_workers().values())
    namespace = cluster_handle(APP).namespace.remote().result(timeout_s=30)
    assert ray.get_actor(ROUTER_NAME, namespace=namespace)
    removed = undeploy(APP)
    assert f"serve app {APP}" in removed
    assert APP not in serve.status().applications
    with pytest.raises(ValueError):
        ray.get_actor(ROUTER_NAME, namespace=namespace)
    deadline = time.monotonic() + 20
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [w for w in alive if _answers(ray, w)]
        time.sleep(0.2)
    assert not alive, "DeviceWorkers outlived the app"


def _answers(ray, handle) -> bool:
    try:
        ray.get(handle.stats.remote(), timeout=2)
        return True
    except Exception:
        return False


# ---- app args and the CLI's model list (no cluster needed) ----------------------------


@pytest.mark.parametrize("bad, field", [
    ({"models": {}}, "models"),
    ({"models": {"a": "zoo:no-such-model"}}, "no-such-model"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "budget_gb": 1, "budget_bytes": 1 << 30}, "budget_bytes or budget_gb"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "kv_fraction": 1.5}, "kv_fraction"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "policy": "fifo"}, "policy"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "num_replicas": 2}, "num_replicas"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "slo": {"ttft_s": 0}}, "ttft_s"),
    ({"models": {"a": "zoo:llama-tiny-a"}, "max_queued_requests": 0}, "max_queued_requests"),
])
def test_bad_app_args_name_the_field(bad, field):
    from deploy.serve_app.app_args import parse_app_args

    with pytest.raises(ValueError, match=field):
        parse_app_args(bad)


def test_engine_config_from_args_is_a_valid_engine_config():
    from actors.engine import EngineConfig
    from deploy.serve_app.app_args import parse_app_args

    args = parse_app_args({"models": {"a": "/ckpt/a"}, "budget_gb": 40, "kv_fraction": 0.3, "dtype": "bfloat16"})
    config = args.engine_config()
    assert isinstance(config, EngineConfig) and config.detokenize is False   # the ingress makes the text
    assert config.budget_bytes == 40 << 30 and config.dtype == "bfloat16"
    assert 0.29 * config.budget_bytes <= config.kv_bytes <= 0.3 * config.budget_bytes


def test_cli_models_list(tmp_path):
    from deploy.local import parse_models

    ckpt = tmp_path / "my-model"
    ckpt.mkdir()
    assert parse_models(f"llama-tiny-a, x=/ckpt/x,{ckpt}") == {
        "llama-tiny-a": "zoo:llama-tiny-a", "x": "/ckpt/x", "my-model": str(ckpt)}
    with pytest.raises(ValueError, match="twice"):
        parse_models("llama-tiny-a,llama-tiny-a")
    with pytest.raises(ValueError, match="empty"):
        parse_models(" , ")
