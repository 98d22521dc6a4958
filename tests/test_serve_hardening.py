"""The real Serve app under an adversarial client (session Ray, 2 virtual devices, an API
key): poisoned requests (NaN, inf, denormal, huge numbers) among innocent streams change
nothing for the innocents (poison_collateral = 0), a bounded schemathesis run over the
served spec finds no 5xx (fuzz_5xx = 0), keys guard every route but /health, a 10 MB body
is a 413, and the text of a request cut mid-character equals tokenizer.decode of its ids,
through the openai SDK.

One app for the module; the last test shuts it down.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from load_tests.edge_fuzz import BAD_NUMBERS, NUMERIC_FIELDS, fuzz_5xx, poison_collateral
from tests.net import free_port

APP = "tokenmux-hardening"
KEY = "sk-hardening-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = {"llama-a": "zoo:llama-tiny-a", "qwen-b": "zoo:qwen2-tiny-b"}
MiB = 1 << 20
ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2, "max_tokens_cap": 64, "default_max_tokens": 16,
        "api_keys": [KEY]}


@pytest.fixture(scope="module")
def url(ray_session):
    from ray import serve

    from deploy.local import run_local

    with run_local(MODELS, port=free_port(), app_name=APP, **ARGS) as base:   # joins the session Ray
        yield base
    assert APP not in serve.status().applications


def test_poisoned_requests_leave_innocent_streams_unchanged(url):
    result = asyncio.run(poison_collateral(url, "llama-a", AUTH, num_innocent=8, max_tokens=24, seed=0))
    assert result["innocent_undisturbed_ok"]
    assert result["poison_requests"] >= 100 and result["poison_5xx"] == 0
    assert result["poison_collateral"] == 0, result


_POISON = st.builds(lambda field, bad, model: '{"model": "%s", "prompt": "p", "%s": %s}' % (model, field, bad),
                    st.sampled_from(NUMERIC_FIELDS),
                    st.sampled_from(BAD_NUMBERS) | st.floats(allow_nan=True, allow_infinity=True).map(repr)
                    .map(lambda r: {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}.get(r, r)),
                    st.sampled_from(sorted(MODELS)))


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(poisons=st.lists(_POISON, min_size=8, max_size=24))
def test_hypothesis_poison_has_no_collateral(url, poisons):
    result = asyncio.run(poison_collateral(url, "qwen-b", AUTH, num_innocent=4, max_tokens=12, poisons=poisons))
    assert result["poison_5xx"] == 0 and result["poison_collateral"] == 0, (result, poisons)


def test_schemathesis_on_the_served_spec_finds_no_5xx(url):
    result = fuzz_5xx(url, AUTH, max_examples=15, seed=2)
    assert result["fuzz_cases"] >= 50
    assert result["fuzz_5xx"] == 0, result["fuzz_5xx_examples"]


def test_the_key_guards_every_route_but_health(url):
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/docs"),
                         ("GET", "/openapi.json")]:
        assert httpx.request(method, f"{url}{path}", timeout=30).status_code == 401
        assert httpx.request(method, f"{url}{path}", timeout=30, headers={"Authorization": "Bearer x"}
                             ).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_a_ten_megabyte_prompt_is_a_413(url):
    resp = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "llama-a", "prompt": "x" * (10 * MiB)})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_text_cut_mid_character_equals_decode_through_the_openai_sdk(url):
    import openai
    from transformers import AutoTokenizer

    from actors.zoo.zoo import ensure_model

    tok = AutoTokenizer.from_pretrained(ensure_model("llama-tiny-a"))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    cut = None
    for prompt in ("The quick brown fox", "Unicode: é 日本 🙂", "A cache is small", "def f(x):"):
        full = client.completions.create(model="llama-a", prompt=prompt, max_tokens=64, temperature=0,
                                         extra_body={"ignore_eos": True})
        ids = full.model_extra["tokenmux"]["token_ids"]
        ends = [k for k in range(1, len(ids)) if tok.decode(ids[:k], skip_special_tokens=True).endswith("\ufffd")]
        if ends:
            cut = prompt, ids[:ends[0]]
            break
    assert cut is not None, "no greedy output of the random model ends mid-character: pick other prompts"
    prompt, ids = cut
    expected = tok.decode(ids, skip_special_tokens=True)
    whole = client.completions.create(model="llama-a", prompt=prompt, max_tokens=len(ids), temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.model_extra["tokenmux"]["token_ids"] == ids and whole.choices[0].text == expected
    stream = client.completions.create(model="llama-a", prompt=prompt, max_tokens=len(ids), temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_zz_shutdown(url):
    from ray import serve

    from deploy.local import undeploy

    assert f"serve app {APP}" in undeploy(APP)
    assert APP not in serve.status().applications
