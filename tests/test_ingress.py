"""The OpenAI-compatible ingress over a fake engine, through a real uvicorn server."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from fakes import FakeEngineClient
from deploy.openai_api.ingress import OpenAIIngress
from deploy.openai_api.config import IngressConfig
from edge_helpers import (MAX_CONTEXT, MAX_TOKENS_CAP, MODEL, OTHER_MODEL, expected_output, make_engine,
                          running_server, wait_until, zoo_models)
from scheduler.messages import OutputFrame
from deploy.openai_api.protocol import IngressRequest


@pytest.fixture(scope="module")
def engine():
    return make_engine(tokens_per_frame=3)


@pytest.fixture(scope="module")
def http(engine):
    with running_server(engine) as base_url, httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer(MODEL)


def sse_payloads(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def stream_post(http, path, body) -> tuple[list[dict], str]:
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(resp)
    return [json.loads(p) for p in payloads[:-1]], payloads[-1]


def test_health_and_models(http):
    assert http.get("/health").json()["status"] == "ok"
    cards = http.get("/v1/models").json()
    assert cards["object"] == "list"
    assert {c["id"] for c in cards["data"]} == {MODEL, OTHER_MODEL}
    assert all(c["max_model_len"] == MAX_CONTEXT and c["object"] == "model" for c in cards["data"])


def test_completion_text_usage_and_token_times(http, tok):
    prompt = "The ingress turns text into tokens."
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 7})
    assert resp.status_code == 200
    body = resp.json()
    prompt_ids = tok.encode(prompt)
    ids, text = expected_output(tok, prompt_ids, 7)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 7,
                             "total_tokens": len(prompt_ids) + 7}
    times = body["tokenmux"]["token_times"]
    assert body["tokenmux"]["token_ids"] == ids and len(times) == 7 and times == sorted(times)


def test_token_id_prompt_equals_text_prompt(http, tok, engine):
    prompt_ids = tok.encode("same prompt, two spellings")
    by_text = http.post("/v1/completions", json={"model": MODEL, "prompt": "same prompt, two spellings",
                                                 "max_tokens": 5}).json()
    for prompt in (prompt_ids, [prompt_ids]):
        by_ids = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5}).json()
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
        assert list(engine.seen[-1].prompt_token_ids) == prompt_ids


def test_streamed_completion_matches_whole_response(http):
    body = {"model": MODEL, "prompt": "Streaming sends several tokens per chunk.", "max_tokens": 10}
    whole = http.post("/v1/completions", json=body).json()
    chunks, last = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert last == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None for c in chunks)  # no usage unless asked for
    ids = [t for c in chunks for t in c["tokenmux"]["token_ids"]]
    assert ids == whole["tokenmux"]["token_ids"]
    assert sum(len(c["tokenmux"]["token_times"]) for c in chunks) == 10
    assert len(chunks) < 10  # several tokens per chunk, not one event per token


def test_stream_include_usage_adds_a_final_usage_chunk(http):
    body = {"model": OTHER_MODEL, "prompt": "count me", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, last = stream_post(http, "/v1/completions", body)
    assert last == "[DONE]"
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4


def test_chat_uses_the_chat_template(http, tok, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6})
    assert resp.status_code == 200
    body = resp.json()
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(engine.seen[-1].prompt_token_ids) == list(prompt_ids)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": expected_output(tok, list(prompt_ids), 6)[1]}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_streamed_chat(http):
    messages = [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "join"}]}]
    whole = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}).json()
    chunks, last = stream_post(http, "/v1/chat/completions",
                               {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True})
    assert last == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_stop_string_cuts_the_text(http, tok):
    prompt = "red green blue red green blue"
    full = expected_output(tok, tok.encode(prompt), 30)[1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "stop": ["blue", "never"]}
    whole = http.post("/v1/completions", json=body).json()
    assert whole["choices"][0] == {"index": 0, "text": full[: full.index("blue")], "logprobs": None,
                                   "finish_reason": "stop"}
    chunks, _ = stream_post(http, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[: full.index("blue")]


def test_tokenmux_extensions_reach_the_engine(http, engine):
    body = {"model": MODEL, "prompt": "extensions", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
            "top_k": 5, "seed": 7, "ignore_eos": True, "stop": "zz", "stop_token_ids": [1],
            "ttft_slo_s": 2.5, "tbt_slo_s": 0.25}
    assert http.post("/v1/completions", json=body).status_code == 200
    req = engine.seen[-1]
    sp = req.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.ignore_eos) == (3, 0.5, 0.9, 5, 7, True)
    assert sp.stop == ("zz",) and sp.stop_token_ids == (1,)
    assert (req.slo.ttft_s, req.slo.tbt_s) == (2.5, 0.25)


def test_defaults_follow_openai(http, engine):
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "defaults"}).status_code == 200
    sp = engine.seen[-1].sampling_params
    assert sp.temperature == 1.0 and sp.max_tokens == 16  # IngressConfig.default_max_tokens in the helper


BAD_REQUESTS = [
    # (body, status, param, words in the message)
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", ["max_tokens"]),
    ({"model": MODEL, "prompt": "x", "temperature": -1.0}, 400, "temperature",
     ["temperature", "greater than or equal to 0"]),
    ({"model": MODEL, "prompt": "x", "temperature": 1e-40}, 400, "temperature", ["temperature", "denormal"]),
    ({"model": MODEL, "prompt": "x", "seed": 10**30}, 400, "seed", ["seed", "less than or equal to"]),
    ({"model": MODEL, "prompt": "x", "tbt_slo_s": 1e30}, 400, "tbt_slo_s", ["tbt_slo_s"]),
    ({"model": MODEL, "prompt": "x", "top_p": 0.0}, 400, "top_p", ["top_p"]),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n", ["'n'", "not supported"]),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of", ["best_of", "not supported"]),
    ({"model": MODEL, "prompt": "x", "logprobs": 1}, 400, "logprobs", ["logprobs", "not supported"]),
    ({"model": MODEL, "prompt": "x", "echo": True}, 400, "echo", ["echo", "not supported"]),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", ["Unrecognized", "frobnicate"]),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_TOKENS_CAP + 1}, 400, "max_tokens",
     [str(MAX_TOKENS_CAP)]),
    ({"model": MODEL, "prompt": "word " * MAX_CONTEXT}, 400, "prompt", ["maximum context length"]),
    ({"model": MODEL, "prompt": "word " * (MAX_CONTEXT - MAX_TOKENS_CAP // 2), "max_tokens": MAX_TOKENS_CAP},
     400, "max_tokens",
     ["maximum context length"]),
    ({"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", ["vocabulary"]),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", ["batch"]),
    ({"model": MODEL, "prompt": 5}, 400, "prompt", ["prompt"]),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", ["empty"]),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", ["at most 4"]),
    ({"model": MODEL, "prompt": "x", "tbt_slo_s": 0}, 400, None, ["tbt_slo_s"]),
    ({"model": MODEL}, 400, "prompt", ["Missing", "prompt"]),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model", ["no-such-model", MODEL, OTHER_MODEL]),
]


@pytest.mark.parametrize("body,status,param,words", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_completion_requests_get_openai_errors(http, body, status, param, words):
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    for word in words:
        assert word in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
     "max_completion_tokens"),
])
def test_bad_chat_requests_name_the_field(http, body, param):
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "ttft_slo_s", "tbt_slo_s"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_400s_naming_the_field(http, field, literal):
    body = '{"model": "%s", "prompt": "x", "%s": %s}' % (MODEL, field, literal)
    resp = http.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field and "finite" in resp.json()["error"]["message"]


def test_malformed_json_is_a_400(http):
    resp = http.post("/v1/completions", content=b'{"model": "llama-tiny-a", "prompt": ',
                     headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "not valid JSON" in resp.json()["error"]["message"]


@pytest.mark.parametrize("by_raising", [False, True])
def test_engine_failure_mid_stream_is_an_sse_error_then_done(by_raising):
    engine = make_engine(tokens_per_frame=2, fail_after_tokens=4, fail_by_raising=by_raising)
    with running_server(engine) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "fail part way", "max_tokens": 20}
        chunks, last = stream_post(http, "/v1/completions", {**body, "stream": True})
        assert last == "[DONE]"
        assert sum(len(c["tokenmux"]["token_ids"]) for c in chunks[:-1]) == 4  # tokens before the failure
        assert chunks[-1]["error"]["type"] == "server_error"
        assert "fake engine failure" in chunks[-1]["error"]["message"]
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 500 and "fake engine failure" in whole.json()["error"]["message"]


def _raw_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(stream):
    engine = make_engine(tokens_per_frame=1, frame_interval_s=0.02)  # ~200 tokens take 4 s
    max_tokens = 120
    with running_server(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        sock = _raw_request(port, {"model": MODEL, "prompt": "a long answer", "max_tokens": max_tokens,
                                   "stream": stream})
        if stream:
            received = b""
            while b"data: " not in received:  # read at least one chunk
                received += sock.recv(4096)
        else:
            wait_until(lambda: any(n >= 2 for n in engine.num_generated.values()), what="generation to start")
        request_id = engine.seen[-1].request_id
        sock.close()
        wait_until(lambda: request_id in engine.aborted, what="the ingress to abort the request")
        wait_until(lambda: request_id not in engine.active, what="the engine generator to end")
        generated = engine.num_generated[request_id]
        time.sleep(0.1)
        assert generated < max_tokens
        assert engine.num_generated[request_id] == generated  # it stopped: nothing after the abort


def test_unknown_route_is_an_openai_error(http):
    resp = http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_generate_frames_is_the_stream_for_in_cluster_callers(engine, tok):
    ingress = OpenAIIngress(engine, IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16))

    async def collect(request: IngressRequest) -> list[dict]:
        return [chunk async for chunk in ingress.generate_frames(request)]

    prompt = "through a handle"
    chunks = asyncio.run(collect(IngressRequest("completions", {"model": MODEL, "prompt": prompt, "max_tokens": 5})))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_output(tok, tok.encode(prompt), 5)[1]
    assert chunks[-1]["usage"]["completion_tokens"] == 5  # always ends with usage
    chat = asyncio.run(collect(IngressRequest("chat.completions",
                                              {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2, "stream": False})))
    assert chat[0]["object"] == "chat.completion.chunk" and chat[-1]["usage"]["completion_tokens"] == 2
    for body, status in [({"model": "nope", "prompt": "x"}, 404), ({"model": MODEL, "prompt": "x", "n": 2}, 400)]:
        [error] = asyncio.run(collect(IngressRequest("completions", body)))
        assert error["status"] == status and error["error"]["message"]
    with pytest.raises(ValueError, match="endpoint must be one of"):   # refused where it is made
        IngressRequest("embeddings", {})


class _TruncatingEngine(FakeEngineClient):
    """An engine whose stream ends without a finished frame (a bug the ingress must report)."""

    async def frames(self, req):
        yield OutputFrame(req.request_id, token_ids=[5], text="x", token_times=[time.time()])


def test_stream_that_ends_unfinished_is_reported_as_an_error():
    with running_server(_TruncatingEngine(zoo_models())) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "cut short", "max_tokens": 5}
        chunks, last = stream_post(http, "/v1/completions", {**body, "stream": True})
        assert last == "[DONE]" and "without a finish reason" in chunks[-1]["error"]["message"]
        assert http.post("/v1/completions", json=body).status_code == 500
