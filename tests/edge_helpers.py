"""Shared by the HTTP-edge tests: zoo models for the fake engine, and a real uvicorn
server on a free loopback port, run in a thread."""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from actors.zoo.zoo import ensure_model
from deploy.openai_api.engine_protocol import ServedModel
from fakes import FakeEngineClient
from polling import wait_until
from deploy.openai_api.ingress import build_ingress_app
from deploy.openai_api.config import IngressConfig

MODEL = "llama-tiny-a"
OTHER_MODEL = "qwen2-tiny-a"
MAX_CONTEXT = 256
MAX_TOKENS_CAP = 128


def zoo_models() -> list[ServedModel]:
    return [ServedModel(name, str(ensure_model(name)), MAX_CONTEXT) for name in (MODEL, OTHER_MODEL)]


def make_engine(**kwargs) -> FakeEngineClient:
    return FakeEngineClient(zoo_models(), **kwargs)


@contextmanager
def running_server(engine: FakeEngineClient, config: IngressConfig | None = None) -> Iterator[str]:
    """Serve the ingress over `engine` on 127.0.0.1; yields the base URL."""
    config = config or IngressConfig(max_tokens_cap=MAX_TOKENS_CAP, default_max_tokens=16)
    app = build_ingress_app(engine, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout_s=20, what="uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def expected_output(tokenizer, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], str]:
    """What FakeEngineClient generates: the prompt's ids, cyclically."""
    ids = [prompt_ids[k % len(prompt_ids)] for k in range(num_tokens)]
    return ids, tokenizer.decode(ids, skip_special_tokens=True)
