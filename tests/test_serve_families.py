"""The OpenAI edge serving Qwen3, Gemma 3 and Phi-3 side by side (the real Serve app on the
session Ray, checkpoints written by transformers at test time): greedy completions over HTTP
equal transformers' generate() on the same prompt ids, decoded."""
from __future__ import annotations

import httpx
import pytest

from tests.greedy_reference import hf_greedy
from tests.net import free_port

APP = "tokenmux-families"
MiB = 1 << 20
ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2, "max_tokens_cap": 2000}
PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps running far away", "Hello", "A model"]
MAX_TOKENS = 24   # with the longer prompt, Phi-3 passes its pretraining length (32); Gemma its window (8)


@pytest.fixture(scope="module")
def served(ray_session, tmp_path_factory):
    from family_checkpoints import FAMILIES

    from deploy.local import run_local

    paths = {name: str(build(tmp_path_factory.mktemp(name))) for name, build in FAMILIES.items()}
    with run_local(paths, port=free_port(), app_name=APP, **ARGS) as base:
        yield base, paths


def test_completions_of_the_new_families_equal_hf_generate(served):
    from transformers import AutoTokenizer

    url, paths = served
    for name, path in paths.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        for prompt in PROMPTS:
            resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert resp.status_code == 200, resp.text
            out = hf_greedy(path, tokenizer(prompt)["input_ids"], MAX_TOKENS)
            choice = resp.json()["choices"][0]
            assert choice["text"] == tokenizer.decode(out, skip_special_tokens=True), (name, prompt)
            assert resp.json()["usage"]["completion_tokens"] == len(out), (name, prompt)


def test_zz_undeploy(served):
    from ray import serve

    from deploy.local import undeploy

    undeploy(APP)
    assert APP not in serve.status().applications
