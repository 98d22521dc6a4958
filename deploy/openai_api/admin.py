"""Admin routes of the live catalog at the HTTP edge (`tokenmux models ...` speaks to them).

    GET    /admin/models                 the catalog: models, versions, retiring keys, events
    POST   /admin/models                 {name, path, slo_ttft_s?, slo_tpot_s?, tensor_parallel?} -> 201
    PUT    /admin/models/{name}          {path}: a new version, switched to with no gap
    DELETE /admin/models/{name}?drain_s= stop serving it; in-flight requests finish (or are cut after drain_s)

They sit behind the API key like every route (auth.py); a server without keys takes them only
from loopback (403 otherwise), so an open edge never lets a stranger change what it serves.
Bad input is a 4xx naming the field (`param`), and nothing changes. The catalog itself is the
`CatalogAdmin` the Serve app plugs in (deploy/serve_app/app.py: the cluster deployment's
LiveCatalog); the routes only parse, check and map its refusals to OpenAI-shaped errors.
"""
from __future__ import annotations

import ipaddress
from typing import Any, Protocol

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, Field

from deploy.openai_api.errors import OpenAIError
from deploy.openai_api.openapi import error_responses


class AddModelRequest(BaseModel):
    model_config = {"extra": "forbid"}
    name: str = Field(min_length=1, max_length=128, description="what clients put in `model`")
    path: str = Field(min_length=1, description="local checkpoint directory on every node")
    slo_ttft_s: float | None = Field(None, gt=0, lt=3600, description="TTFT SLO (default: the server's)")
    slo_tpot_s: float | None = Field(None, gt=0, lt=3600, description="TPOT SLO (default: the server's)")
    tensor_parallel: int = Field(1, ge=1, description="devices of one node the model is split over (a power "
                                                      "of two, at most a node's devices)")


class UpdateModelRequest(BaseModel):
    model_config = {"extra": "forbid"}
    path: str = Field(min_length=1, description="the new version's checkpoint directory")


class CatalogModel(BaseModel):
    name: str
    path: str
    version: int
    key: str
    fingerprint: str
    ttft_s: float | None = None
    tbt_s: float | None = None
    tensor_parallel: int = 1


class RemovedModel(BaseModel):
    model: str
    key: str
    cut: int = Field(description="requests in flight ended with an error after the drain")


class CatalogView(BaseModel):
    revision: int
    models: dict[str, CatalogModel]
    retiring: dict[str, str]
    events: list[dict[str, Any]]


class CatalogAdmin(Protocol):
    async def catalog(self) -> dict: ...

    async def change(self, op: str, **kwargs: Any) -> dict:
        """op: add | update | remove. The result, or {"error": {message, field, status}}."""
        ...


ADMIN_ERRORS = error_responses(400, 401, 403, 404)


def add_admin_routes(app: FastAPI, admin: CatalogAdmin, keyed: bool) -> None:
    """keyed: the server has API keys (the middleware checks them); without, loopback only."""

    def check_caller(request: Request) -> None:
        if keyed:
            return
        host = request.client.host if request.client else ""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise OpenAIError(403, "the admin routes answer only loopback callers on a server without API keys",
                              code="admin_forbidden")

    async def changed(op: str, **kwargs: Any) -> dict:
        result = await admin.change(op, **kwargs)
        error = result.get("error")
        if error:
            raise OpenAIError(int(error["status"]), error["message"], param=error.get("field"),
                              code="catalog_refused")
        return result

    @app.get("/admin/models", response_model=CatalogView, responses=ADMIN_ERRORS, tags=["admin"])
    async def list_models(request: Request) -> dict:
        check_caller(request)
        return await admin.catalog()

    @app.post("/admin/models", status_code=201, response_model=CatalogModel, tags=["admin"],
              responses={**ADMIN_ERRORS, **error_responses(409, 422)})
    async def add_model(body: AddModelRequest, request: Request) -> dict:
        check_caller(request)
        return await changed("add", name=body.name, path=body.path, ttft_s=body.slo_ttft_s, tbt_s=body.slo_tpot_s,
                             tensor_parallel=body.tensor_parallel)

    @app.put("/admin/models/{name:path}", response_model=CatalogModel, tags=["admin"],
             responses={**ADMIN_ERRORS, **error_responses(422)})
    async def update_model(name: str, body: UpdateModelRequest, request: Request) -> dict:
        check_caller(request)
        return await changed("update", name=name, path=body.path)

    @app.delete("/admin/models/{name:path}", response_model=RemovedModel, responses=ADMIN_ERRORS, tags=["admin"])
    async def remove_model(name: str, request: Request,
                           drain_s: float | None = Query(None, ge=0, le=3600,
                                                         description="cut requests still in flight after this")) -> dict:
        check_caller(request)
        return await changed("remove", name=name, drain_s=drain_s)
