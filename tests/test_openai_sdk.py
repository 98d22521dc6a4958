"""The official openai SDK works unchanged against the tokenmux ingress (fake engine, zoo tokenizer)."""
from __future__ import annotations

import openai
import pytest

from edge_helpers import MODEL, OTHER_MODEL, expected_output, make_engine, running_server


@pytest.fixture(scope="module")
def engine():
    return make_engine(tokens_per_frame=2)


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine) as base_url:
        sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        yield sdk
        sdk.close()


def test_models_list(client):
    assert sorted(m.id for m in client.models.list()) == sorted([MODEL, OTHER_MODEL])


def test_completions_create(client, engine):
    tok = engine.tokenizer(MODEL)
    prompt = "An OpenAI client, unchanged."
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"top_k": 1})
    assert out.choices[0].text == expected_output(tok, tok.encode(prompt), 6)[1]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert engine.seen[-1].sampling_params.top_k == 1  # an extension passed through extra_body


def test_streamed_chat_completion(client, engine):
    tok = engine.tokenizer(OTHER_MODEL)
    messages = [{"role": "user", "content": "Stream this back to me"}]
    stream = client.chat.completions.create(model=OTHER_MODEL, messages=messages, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_output(tok, list(prompt_ids), 9)[1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9
    # The tokenmux extension survives the SDK's parsing.
    times = [t for c in chunks if c.choices for t in c.model_extra["tokenmux"]["token_times"]]
    assert len(times) == 9


def test_sdk_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="x")
    assert MODEL in str(not_found.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", n=3)
    assert bad.value.body["param"] == "n"
