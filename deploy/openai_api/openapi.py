"""The ingress's OpenAPI description: the real request schemas and every error it answers.

The POST routes read their body themselves (a size limit first, then strict JSON parsing
with errors in OpenAI's shape), so FastAPI cannot infer their request schemas; they are
declared here from the same pydantic models the ingress parses with, and every route
lists the error responses it can give, all in the `ErrorResponse` shape.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from deploy.openai_api.protocol import ErrorResponse

ERRORS = {
    400: "Invalid request: the message and `param` name the problem",
    401: "Missing or wrong API key (only when the server has keys)",
    403: "An admin route called from beyond loopback on a server without API keys",
    404: "Unknown model (the message lists the models served) or route",
    405: "Method not allowed on this route (the `Allow` header lists the allowed ones)",
    409: "The model name is in the catalog already (admin)",
    413: "Request body above the server's limit",
    422: "The checkpoint fits no device or could not be placed (admin)",
    429: "Overloaded: retry after the number of seconds in `Retry-After`",
    500: "The engine failed to generate",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def generate_route(request_model: type[BaseModel], response_model: type[BaseModel],
                   chunk_model: type[BaseModel]) -> dict[str, Any]:
    """Keyword arguments of `app.post(...)` for a completions route."""
    ref = {"$ref": f"#/components/schemas/{request_model.__name__}"}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}},
        "responses": {
            200: {"model": response_model,
                  "description": f"One {response_model.__name__}, or with `stream: true` server-sent events, "
                                 f"each `data: <{chunk_model.__name__}>`, ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **error_responses(400, 401, 404, 413, 429, 500),
        },
    }


def add_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the request models (and the models they use) into the spec's components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
