"""The tokenmux Python client: completions and chat, whole or streamed, with exact timings.

    client = TokenmuxClient("http://127.0.0.1:8000")          # outside the cluster (HTTP)
    client = TokenmuxClient.from_serve_app("tokenmux")         # inside it (Serve handle)
    out = client.complete("llama-tiny-a", "Hello", max_tokens=8, temperature=0)
    out.text, out.token_ids, out.finish_reason, out.usage, out.ttft_s, out.token_times
    for chunk in client.stream("llama-tiny-a", "Hello", max_tokens=8): chunk.text

`AsyncTokenmuxClient` has the same methods as coroutines / async iterators. Keyword
parameters are OpenAI request fields plus tokenmux's (`ignore_eos`, `top_k`, `seed`,
`stop`, `stop_token_ids`, `ttft_slo_s`, `tbt_slo_s`). Requests always stream under the
hood, so `ttft_s` is what this client observed; `token_times` are the workers' wall-clock
times of each token. Server errors raise `TokenmuxError` (status, message, param).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

from deploy.client.transports import (AsyncHTTPBackend, AsyncServeHandleBackend, HTTPBackend, ServeHandleBackend,
                                    TokenmuxError)

__all__ = ["AsyncTokenmuxClient", "Completion", "StreamChunk", "TokenmuxClient", "TokenmuxError", "Usage"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class StreamChunk:
    text: str  # detokenized delta
    token_ids: list[int]
    token_times: list[float]  # worker wall-clock time of each token
    finish_reason: str | None
    elapsed_s: float  # since the request was sent, when this chunk arrived
    usage: Usage | None = None  # only on the last chunk


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    ttft_s: float | None  # request sent -> first token received (None if no token came)
    token_times: list[float] = field(default_factory=list)


def _body(model: str, key: str, value: Any, params: dict) -> dict:
    if not model:
        raise ValueError("model must be non-empty")
    if "stream" in params or "stream_options" in params:
        raise ValueError("pass stream via the method (complete/stream), not as a parameter")
    return {"model": model, key: value, **params, "stream": True, "stream_options": {"include_usage": True}}


def _to_chunk(raw: dict, started: float) -> tuple[str, StreamChunk]:
    elapsed = time.perf_counter() - started
    usage = Usage(**raw["usage"]) if raw.get("usage") else None
    ext = raw.get("tokenmux") or {}
    choice = raw["choices"][0] if raw.get("choices") else {}
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content") or ""
    chunk = StreamChunk(text=text, token_ids=list(ext.get("token_ids", [])),
                        token_times=list(ext.get("token_times", [])), finish_reason=choice.get("finish_reason"),
                        elapsed_s=elapsed, usage=usage)
    return raw.get("id", ""), chunk


class _Collector:
    """Folds stream chunks into one Completion."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = ""
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.ttft_s: float | None = None

    def add(self, request_id: str, chunk: StreamChunk) -> None:
        self.id = self.id or request_id
        if self.ttft_s is None and (chunk.token_ids or chunk.text):
            self.ttft_s = chunk.elapsed_s
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.token_times.extend(chunk.token_times)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage

    def result(self) -> Completion:
        if self.usage is None:
            raise TokenmuxError(500, "the stream ended without a usage chunk (was it cut short?)")
        return Completion(id=self.id, model=self.model, text="".join(self.text), token_ids=self.token_ids,
                          finish_reason=self.finish_reason, usage=self.usage, ttft_s=self.ttft_s,
                          token_times=self.token_times)


class TokenmuxClient:
    def __init__(self, base_url: str | None = None, *, handle: Any = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        if (base_url is None) == (handle is None):
            raise ValueError("give exactly one of base_url (HTTP) or handle (Serve DeploymentHandle)")
        self._backend = HTTPBackend(base_url, api_key, timeout) if base_url else ServeHandleBackend(handle)

    @classmethod
    def from_serve_app(cls, app_name: str = "tokenmux") -> "TokenmuxClient":
        from ray import serve

        return cls(handle=serve.get_app_handle(app_name))

    def models(self) -> list[str]:
        return [m["id"] for m in self._backend.models()]

    def _stream(self, endpoint: str, body: dict) -> Iterator[tuple[str, StreamChunk]]:
        started = time.perf_counter()
        for raw in self._backend.stream(endpoint, body):
            yield _to_chunk(raw, started)

    def stream(self, model: str, prompt: str | list[int], **params: Any) -> Iterator[StreamChunk]:
        for _, chunk in self._stream("completions", _body(model, "prompt", prompt, params)):
            yield chunk

    def stream_chat(self, model: str, messages: list[dict], **params: Any) -> Iterator[StreamChunk]:
        for _, chunk in self._stream("chat.completions", _body(model, "messages", messages, params)):
            yield chunk

    def complete(self, model: str, prompt: str | list[int], **params: Any) -> Completion:
        collector = _Collector(model)
        for request_id, chunk in self._stream("completions", _body(model, "prompt", prompt, params)):
            collector.add(request_id, chunk)
        return collector.result()

    def chat(self, model: str, messages: list[dict], **params: Any) -> Completion:
        collector = _Collector(model)
        for request_id, chunk in self._stream("chat.completions", _body(model, "messages", messages, params)):
            collector.add(request_id, chunk)
        return collector.result()

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> "TokenmuxClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTokenmuxClient:
    def __init__(self, base_url: str | None = None, *, handle: Any = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        if (base_url is None) == (handle is None):
            raise ValueError("give exactly one of base_url (HTTP) or handle (Serve DeploymentHandle)")
        self._backend = AsyncHTTPBackend(base_url, api_key, timeout) if base_url else AsyncServeHandleBackend(handle)

    @classmethod
    def from_serve_app(cls, app_name: str = "tokenmux") -> "AsyncTokenmuxClient":
        from ray import serve

        return cls(handle=serve.get_app_handle(app_name))

    async def models(self) -> list[str]:
        return [m["id"] for m in await self._backend.models()]

    async def _stream(self, endpoint: str, body: dict) -> AsyncIterator[tuple[str, StreamChunk]]:
        started = time.perf_counter()
        async for raw in self._backend.stream(endpoint, body):
            yield _to_chunk(raw, started)

    async def stream(self, model: str, prompt: str | list[int], **params: Any) -> AsyncIterator[StreamChunk]:
        async for _, chunk in self._stream("completions", _body(model, "prompt", prompt, params)):
            yield chunk

    async def stream_chat(self, model: str, messages: list[dict], **params: Any) -> AsyncIterator[StreamChunk]:
        async for _, chunk in self._stream("chat.completions", _body(model, "messages", messages, params)):
            yield chunk

    async def complete(self, model: str, prompt: str | list[int], **params: Any) -> Completion:
        collector = _Collector(model)
        async for request_id, chunk in self._stream("completions", _body(model, "prompt", prompt, params)):
            collector.add(request_id, chunk)
        return collector.result()

    async def chat(self, model: str, messages: list[dict], **params: Any) -> Completion:
        collector = _Collector(model)
        async for request_id, chunk in self._stream("chat.completions", _body(model, "messages", messages, params)):
            collector.add(request_id, chunk)
        return collector.result()

    async def close(self) -> None:
        await self._backend.close()

    async def __aenter__(self) -> "AsyncTokenmuxClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
