"""Transports of the tokenmux client: HTTP (outside the cluster) and a Serve handle (inside).

Both yield the same chunk dicts: the OpenAI stream chunks the ingress produces, with
the `tokenmux` extension. An error, before or during the stream, raises `TokenmuxError`.
The handle transport calls the ingress deployment's `generate_frames(IngressRequest(endpoint,
body))` (scheduler/messages.py; the body is the OpenAI JSON body) and `list_models()`; see
`deploy/openai_api/ingress.py` `OpenAIIngress`.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

import httpx

from deploy.openai_api.protocol import IngressRequest

_PATHS = {"completions": "/v1/completions", "chat.completions": "/v1/chat/completions"}


class TokenmuxError(Exception):
    """An error reported by the server, in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "server_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def from_body(cls, status: int, body: Any) -> "TokenmuxError":
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return cls(status, f"unexpected error response: {str(body)[:200]}")
        return cls(status, str(err.get("message", "")), str(err.get("type", "server_error")), err.get("param"),
                   err.get("code"))


def _check_chunk(chunk: dict, status: int = 500) -> dict:
    if "error" in chunk:
        raise TokenmuxError.from_body(int(chunk.get("status", status)), chunk)
    return chunk


def _sse_data(line: str) -> dict | None:
    """The JSON of one SSE `data:` line; None for blank lines, comments and [DONE]."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return None
    return _check_chunk(json.loads(data))


def _error_from_response(resp: httpx.Response) -> TokenmuxError:
    try:  # the body has been read by the caller
        body = resp.json()
    except ValueError:
        body = resp.text
    return TokenmuxError.from_body(resp.status_code, body)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class HTTPBackend:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout)

    def models(self) -> list[dict]:
        resp = self._http.get("/v1/models")
        if resp.status_code != 200:
            raise _error_from_response(resp)
        return resp.json()["data"]

    def stream(self, endpoint: str, body: dict) -> Iterator[dict]:
        # Leaving the loop early closes the connection: the server aborts the request.
        with self._http.stream("POST", _PATHS[endpoint], json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise _error_from_response(resp)
            for line in resp.iter_lines():
                chunk = _sse_data(line)
                if chunk is not None:
                    yield chunk

    def close(self) -> None:
        self._http.close()


class AsyncHTTPBackend:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout)

    async def models(self) -> list[dict]:
        resp = await self._http.get("/v1/models")
        if resp.status_code != 200:
            raise _error_from_response(resp)
        return resp.json()["data"]

    async def stream(self, endpoint: str, body: dict) -> AsyncIterator[dict]:
        async with self._http.stream("POST", _PATHS[endpoint], json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _error_from_response(resp)
            async for line in resp.aiter_lines():
                chunk = _sse_data(line)
                if chunk is not None:
                    yield chunk

    async def close(self) -> None:
        await self._http.aclose()


class ServeHandleBackend:
    """In-cluster transport over a Ray Serve `DeploymentHandle` of the ingress deployment.

    Iterating a streaming handle response synchronously works outside an event loop;
    inside one use `AsyncServeHandleBackend`.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def models(self) -> list[dict]:
        return self._handle.list_models.remote().result()["data"]

    def stream(self, endpoint: str, body: dict) -> Iterator[dict]:
        gen = self._handle.options(stream=True).generate_frames.remote(IngressRequest(endpoint, body))
        finished = False
        try:
            for chunk in gen:
                yield _check_chunk(chunk)
            finished = True
        finally:
            if not finished:  # the caller left early: Serve cancels the replica's generator
                gen.cancel()

    def close(self) -> None:
        pass


class AsyncServeHandleBackend:
    def __init__(self, handle: Any) -> None:
        self._handle = handle

    async def models(self) -> list[dict]:
        return (await self._handle.list_models.remote())["data"]

    async def stream(self, endpoint: str, body: dict) -> AsyncIterator[dict]:
        gen = self._handle.options(stream=True).generate_frames.remote(IngressRequest(endpoint, body))
        finished = False
        try:
            async for chunk in gen:
                yield _check_chunk(chunk)
            finished = True
        finally:
            if not finished:  # the caller left early: Serve cancels the replica's generator
                gen.cancel()

    async def close(self) -> None:
        pass
