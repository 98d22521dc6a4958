"""The HTTP edge's limits and keys, over the fake engine through a real uvicorn server:
a body above the limit is a 413 before anything is parsed, API keys guard every route but
/health (docs included), 405s name the allowed methods, the OpenAPI spec carries the
request schemas and error responses, and a schemathesis run over that spec finds no 5xx."""
from __future__ import annotations

import hashlib
import socket

import httpx
import pytest

from deploy.openai_api.auth import ENV_VAR, key_digest, keys_from_env
from deploy.openai_api.config import IngressConfig
from edge_helpers import MAX_TOKENS_CAP, MODEL, make_engine, running_server

KEYS = ("sk-first-key", "sk-second-key")
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def engine():
    return make_engine(tokens_per_frame=4)


@pytest.fixture(scope="module")
def open_url(engine):
    config = IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=8, max_body_bytes=LIMIT)
    with running_server(engine, config) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(engine):
    # one key given as itself, one as its digest: both open the door
    keys = (KEYS[0], "sha256:" + hashlib.sha256(KEYS[1].encode()).hexdigest())
    config = IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=8, api_keys=keys)
    with running_server(engine, config) as url:
        yield url


def test_a_body_above_the_limit_is_a_413_and_never_tokenised(open_url, engine):
    seen = len(engine.seen)
    body = {"model": MODEL, "prompt": "word " * LIMIT}
    resp = httpx.post(f"{open_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
    assert len(engine.seen) == seen


def test_a_chunked_body_without_length_is_cut_at_the_limit(open_url):
    def chunks():
        yield b'{"model": "%s", "prompt": "' % MODEL.encode()
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    resp = httpx.post(f"{open_url}/v1/completions", content=chunks(), timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "more than" in resp.json()["error"]["message"]


def test_a_long_prompt_under_the_body_limit_is_still_a_400(open_url):
    resp = httpx.post(f"{open_url}/v1/completions", json={"model": MODEL, "prompt": "word " * 2000}, timeout=30)
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]


def test_a_bad_content_length_is_a_400(open_url):
    port = int(open_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}")
        head = sock.recv(4096).split(b"\r\n", 1)[0]
    assert b" 400 " in head


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/no/such/route")]


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic " + KEYS[0], KEYS[0]])
def test_with_keys_set_every_route_but_health_needs_one(keyed_url, method, path, auth):
    headers = {"authorization": auth} if auth else {}
    resp = httpx.request(method, f"{keyed_url}{path}", headers=headers, json={"model": MODEL, "prompt": "x"},
                         timeout=30)
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == ("missing_api_key" if auth is None else "invalid_api_key")
    assert resp.headers["www-authenticate"] == "Bearer"
    assert KEYS[0] not in resp.text


@pytest.mark.parametrize("key", KEYS)
def test_each_key_opens_every_route(keyed_url, key):
    headers = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{keyed_url}/v1/models", headers=headers, timeout=30).status_code == 200
    assert httpx.get(f"{keyed_url}/openapi.json", headers=headers, timeout=30).status_code == 200
    resp = httpx.post(f"{keyed_url}/v1/completions", headers=headers, json={"model": MODEL, "prompt": "hi"},
                      timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8


def test_health_needs_no_key(keyed_url):
    assert httpx.get(f"{keyed_url}/health", timeout=30).json()["status"] == "ok"


def test_the_openai_sdk_passes_its_api_key(keyed_url):
    import openai

    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEYS[1], max_retries=0, timeout=30)
    assert good.completions.create(model=MODEL, prompt="hello", max_tokens=3).usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_keys_come_from_the_environment_and_bad_ones_are_refused():
    assert keys_from_env({ENV_VAR: " a, b ,,c"}) == ["a", "b", "c"]
    assert IngressConfig(api_keys=("a", key_digest("a"))).api_keys == (key_digest("a"),)
    for bad in ("", " padded", "sha256:abc"):
        with pytest.raises(ValueError):
            IngressConfig(api_keys=(bad,))


def test_405_carries_allow(open_url):
    resp = httpx.get(f"{open_url}/v1/completions", timeout=30)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_the_spec_has_request_schemas_and_error_responses(open_url):
    spec = httpx.get(f"{open_url}/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        post = spec["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and "model" in schemas[model]["required"]
        assert {"400", "401", "404", "413", "429", "500"} <= set(post["responses"])
        assert post["responses"]["413"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]["maximum"] == 2


def test_schemathesis_finds_no_server_error(open_url):
    from load_tests.edge_fuzz import fuzz_5xx

    result = fuzz_5xx(open_url, max_examples=40, seed=1)
    assert result["fuzz_cases"] >= 100
    assert result["fuzz_5xx"] == 0, result["fuzz_5xx_examples"]
