"""The tokenmux Python client's HTTP backend against a real server over the fake engine."""
from __future__ import annotations

import asyncio

import pytest

from deploy.client import AsyncTokenmuxClient, TokenmuxClient, TokenmuxError
from edge_helpers import MODEL, OTHER_MODEL, expected_output, make_engine, running_server, wait_until


@pytest.fixture(scope="module")
def engine():
    return make_engine(tokens_per_frame=2)


@pytest.fixture(scope="module")
def base_url(engine):
    with running_server(engine) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with TokenmuxClient(base_url, timeout=30) as c:
        yield c


def test_models(client):
    assert sorted(client.models()) == sorted([MODEL, OTHER_MODEL])


def test_complete_returns_text_ids_usage_and_timings(client, engine):
    tok = engine.tokenizer(MODEL)
    prompt = "The client reports exact timings."
    out = client.complete(MODEL, prompt, max_tokens=5, temperature=0)
    prompt_ids = tok.encode(prompt)
    ids, text = expected_output(tok, prompt_ids, 5)
    assert (out.text, out.token_ids, out.finish_reason) == (text, ids, "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 5)
    assert out.id.startswith("cmpl-") and out.model == MODEL
    assert out.ttft_s is not None and out.ttft_s > 0
    assert len(out.token_times) == 5 and out.token_times == sorted(out.token_times)


def test_stream_yields_deltas_that_add_up(client):
    whole = client.complete(MODEL, "add me up", max_tokens=7)
    chunks = list(client.stream(MODEL, "add me up", max_tokens=7))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].usage == whole.usage
    elapsed = [c.elapsed_s for c in chunks]
    assert elapsed == sorted(elapsed)


def test_chat_and_stream_chat(client, engine):
    tok = engine.tokenizer(OTHER_MODEL)
    messages = [{"role": "user", "content": "chat with the client"}]
    out = client.chat(OTHER_MODEL, messages, max_tokens=4, stop_token_ids=[])
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.text == expected_output(tok, list(prompt_ids), 4)[1]
    assert out.id.startswith("chatcmpl-")
    assert "".join(c.text for c in client.stream_chat(OTHER_MODEL, messages, max_tokens=4)) == out.text


def test_server_errors_raise_tokenmux_error(client):
    with pytest.raises(TokenmuxError) as unknown:
        client.complete("missing-model", "x")
    assert unknown.value.status == 404 and MODEL in unknown.value.message
    with pytest.raises(TokenmuxError) as bad:
        client.complete(MODEL, "x", temperature=-2.0)
    assert (bad.value.status, bad.value.param) == (400, "temperature")
    with pytest.raises(ValueError, match="stream"):
        client.complete(MODEL, "x", stream=False)


def test_mid_stream_failure_raises():
    engine = make_engine(fail_after_tokens=2)
    with running_server(engine) as url, TokenmuxClient(url) as c:
        received = []
        with pytest.raises(TokenmuxError, match="fake engine failure") as failed:
            for chunk in c.stream(MODEL, "fail soon", max_tokens=10):
                received.append(chunk)
        assert failed.value.status == 500
        assert sum(len(ch.token_ids) for ch in received) == 2


def test_leaving_a_stream_early_aborts_the_request():
    engine = make_engine(tokens_per_frame=1, frame_interval_s=0.02)
    with running_server(engine) as url, TokenmuxClient(url) as c:
        stream = c.stream(MODEL, "stop reading me", max_tokens=100)
        next(stream)
        stream.close()
        request_id = engine.seen[-1].request_id
        wait_until(lambda: request_id in engine.aborted and request_id not in engine.active,
                   what="the server to abort the abandoned request")
        assert engine.num_generated[request_id] < 100


def test_async_client(base_url, engine):
    tok = engine.tokenizer(MODEL)

    async def run():
        async with AsyncTokenmuxClient(base_url, timeout=30) as c:
            models = await c.models()
            outs = await asyncio.gather(*(c.complete(MODEL, f"request {i}", max_tokens=3) for i in range(3)))
            deltas = [ch.text async for ch in c.stream_chat(MODEL, [{"role": "user", "content": "hi"}],
                                                                max_tokens=3)]
            chat = await c.chat(MODEL, [{"role": "user", "content": "hi"}], max_tokens=3)
            with pytest.raises(TokenmuxError):
                await c.complete(MODEL, "x", n=2)
            return models, outs, deltas, chat

    models, outs, deltas, chat = asyncio.run(run())
    assert sorted(models) == sorted([MODEL, OTHER_MODEL])
    for i, out in enumerate(outs):
        assert out.text == expected_output(tok, tok.encode(f"request {i}"), 3)[1]
    assert "".join(deltas) == chat.text
