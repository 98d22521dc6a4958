"""The live catalog's admin routes and `tokenmux models` on the real Serve app (session Ray,
2 virtual devices, tiny zoo models): bad input to every route is a 4xx naming the field and
changes nothing; add, update and remove over HTTP and the CLI; /v1/models, system_fingerprint,
/openapi.json and `tokenmux status` follow. A server without keys refuses callers beyond loopback."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.net import free_port

APP = "tokenmux"
MiB = 1 << 20
MODELS = {"llama-a": "zoo:llama-tiny-a", "qwen-b": "zoo:qwen2-tiny-b"}
ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
        "host_kv_gb": 0.01, "num_slots": 2}


@pytest.fixture(scope="module")
def url(ray_session):
    from deploy.local import run_local

    with run_local(MODELS, port=free_port(), app_name=APP, **ARGS) as base:
        yield base


def _complete(url, model):
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": True})


def _served(url):
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"])


def test_bad_input_to_every_admin_route_is_a_4xx_naming_the_field(url, tmp_path, zoo_model):
    before = httpx.get(f"{url}/admin/models", timeout=30).json()
    good = str(zoo_model("mistral-tiny-a"))
    cases = [("POST", "/admin/models", {"json": {"name": "x", "path": str(tmp_path / "none")}}, 400, "path"),
             ("POST", "/admin/models", {"json": {"name": "x"}}, 400, "path"),
             ("POST", "/admin/models", {"json": {"name": "llama-a", "path": good}}, 409, "name"),
             ("POST", "/admin/models", {"json": {"name": "x", "path": good, "slo_ttft_s": -1}}, 400, "slo_ttft_s"),
             ("POST", "/admin/models", {"json": {"name": "x", "path": good, "tensor_parallel": 4}}, 422,
              "tensor_parallel"),   # more than the node's 2 devices (an exact TP-2 add: test_catalog_tensor_parallel.py)
             ("POST", "/admin/models", {"json": {"name": "x", "path": good, "color": 1}}, 400, "color"),
             ("POST", "/admin/models", {"json": {"path": good}}, 400, "name"),
             ("POST", "/admin/models", {"json": {"name": "bad name!", "path": good}}, 400, "name"),
             ("POST", "/admin/models", {"json": {"name": "x", "path": good, "slo_tpot_s": "fast"}}, 400,
              "slo_tpot_s"),
             ("PUT", "/admin/models/nope", {"json": {"path": good}}, 404, "name"),
             ("PUT", "/admin/models/llama-a", {"json": {"path": str(tmp_path)}}, 400, "path"),
             ("PUT", "/admin/models/llama-a", {"json": {}}, 400, "path"),
             ("PUT", "/admin/models/llama-a", {"json": {"path": good, "version": 3}}, 400, "version"),
             ("PUT", "/admin/models/bad name!", {"json": {"path": good}}, 400, "name"),
             ("DELETE", "/admin/models/nope", {}, 404, "name"),
             ("DELETE", "/admin/models/bad name!", {}, 400, "name"),
             ("DELETE", "/admin/models/llama-a", {"params": {"drain_s": -1}}, 400, "drain_s"),
             ("DELETE", "/admin/models/llama-a", {"params": {"drain_s": "soon"}}, 400, "drain_s"),
             ("DELETE", "/admin/models/llama-a", {"params": {"drain_s": 4000}}, 400, "drain_s")]
    for method, path, kwargs, status, field in cases:
        r = httpx.request(method, url + path, timeout=60, **kwargs)
        assert r.status_code == status, (method, path, r.text)
        assert field in (r.json()["error"]["param"] or ""), r.text
    # every admin operation that takes input (a body, a path or query parameter) has a case above
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]
    with_input = {(method.upper(), path) for path, ops in spec.items() if path.startswith("/admin/")
                  for method, op in ops.items() if op.get("parameters") or op.get("requestBody")}
    covered = {(method, "/admin/models/{name}" if path.count("/") > 2 else path) for method, path, *_ in cases}
    assert with_input and with_input <= covered, with_input - covered
    after = httpx.get(f"{url}/admin/models", timeout=30).json()
    assert after["models"] == before["models"] and after["retiring"] == before["retiring"]
    assert _served(url) == ["llama-a", "qwen-b"]


def test_add_update_remove_over_http_and_the_cli(url, zoo_model, capsys):
    from deploy.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["models", "add", "new-m", str(zoo_model("mistral-tiny-a")), "--url", url])
    assert done.value.code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fingerprint"] == "new-m@v1"
    assert "new-m" in _served(url)
    r = _complete(url, "new-m")
    assert r.status_code == 200 and r.json()["system_fingerprint"] == "new-m@v1"

    r = httpx.put(f"{url}/admin/models/llama-a", json={"path": str(zoo_model("llama-tiny-b"))}, timeout=120)
    assert r.status_code == 200 and r.json()["key"] == "llama-a@v2", r.text
    r = _complete(url, "llama-a")
    assert r.status_code == 200 and r.json()["system_fingerprint"] == "llama-a@v2"

    r = httpx.delete(f"{url}/admin/models/qwen-b", params={"drain_s": 5}, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "qwen-b", r.text
    assert _complete(url, "qwen-b").status_code == 404
    assert _served(url) == ["llama-a", "new-m"]

    with pytest.raises(SystemExit) as done:
        main(["models", "remove", "qwen-b", "--url", url])
    assert done.value.code == 2 and "(name)" in capsys.readouterr().err

    with pytest.raises(SystemExit) as done:
        main(["status"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "catalog r" in out and "new-m@v1" in out and "llama-a@v2" in out


def test_the_admin_schemas_are_in_the_openapi_spec(url):
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    assert {"/admin/models", "/admin/models/{name}"} <= set(spec["paths"])
    assert {"AddModelRequest", "UpdateModelRequest", "CatalogModel", "CatalogView"} <= set(spec["components"]["schemas"])


def test_without_keys_a_caller_beyond_loopback_is_refused_and_nothing_changes():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from deploy.openai_api.admin import add_admin_routes
    from deploy.openai_api.errors import OpenAIError

    class Untouched:   # any call would be a change: the guard must stop the request before it
        async def catalog(self):
            raise AssertionError("reached the catalog")

        async def change(self, op, **kwargs):
            raise AssertionError("reached the catalog")

    app = FastAPI()

    @app.exception_handler(OpenAIError)
    async def _error(_, e):
        from fastapi.responses import JSONResponse

        return JSONResponse(e.to_dict(), status_code=e.status)

    add_admin_routes(app, Untouched(), keyed=False)
    client = TestClient(app, client=("203.0.113.7", 5000))
    assert client.get("/admin/models").status_code == 403
    assert client.post("/admin/models", json={"name": "x", "path": "/p"}).status_code == 403
    assert client.delete("/admin/models/x").status_code == 403
