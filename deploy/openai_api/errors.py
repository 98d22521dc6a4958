"""Errors at the HTTP edge, in the OpenAI shape `{"error": {message, type, param, code}}`.

Everything a client can get wrong is a 400 `invalid_request_error` naming the field
(OpenAI returns 400 for invalid parameters; FastAPI's default 422 is replaced); an
unknown model is a 404 `model_not_found` that lists the models served; a body above the
server's limit is a 413 `request_too_large` (decided before it is parsed); a missing or
wrong API key is a 401 (deploy/openai_api/auth.py); an overloaded model is a 429
`rate_limit_exceeded` with Retry-After (deploy/openai_api/admission.py); a failure inside the engine is a 500
`server_error` (or, once a stream has started, an SSE error event).
"""
from __future__ import annotations

from pydantic import ValidationError

from deploy.openai_api.protocol import ErrorInfo, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# pydantic puts the union member that failed into the error location ("prompt", "str");
# these are type tags, not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}
_TYPE_TAG_PREFIXES = ("list[", "dict[", "literal[", "function-")


def _is_type_tag(p: object) -> bool:
    return isinstance(p, str) and (p.lower() in _TYPE_TAGS or p.lower().startswith(_TYPE_TAG_PREFIXES))


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers   # sent with the response (429: Retry-After)
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def unsupported(param: str, why: str = "") -> OpenAIError:
    detail = f" ({why})" if why else ""
    return OpenAIError(400, f"'{param}' is not supported by tokenmux{detail}", param=param,
                       code="unsupported_parameter")


def model_not_found(model: str, available: list[str]) -> OpenAIError:
    listing = ", ".join(sorted(available)) or "(none)"
    return OpenAIError(404, f"The model '{model}' does not exist. Available models: {listing}",
                       param="model", code="model_not_found")


def request_too_large(num_bytes: int, limit: int, at_least: bool = False) -> OpenAIError:
    size = f"more than {limit}" if at_least else str(num_bytes)
    return OpenAIError(413, f"The request body is {size} bytes, above this server's limit of {limit} bytes",
                       code="request_too_large")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, type=SERVER_ERROR)


def _param_of(loc: tuple) -> str:
    names = [str(p) for p in loc if not _is_type_tag(p)]
    return ".".join(names)


def from_validation_error(exc: ValidationError | list[dict]) -> OpenAIError:
    """Map pydantic (or FastAPI) validation errors to one 400 naming the first bad field."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        return invalid(f"request body is not valid JSON: {first['msg']}")
    loc = tuple(p for p in first["loc"] if p != "body")  # FastAPI prefixes "body"
    param = _param_of(loc)
    if first["type"] == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return invalid(f"Missing required parameter: '{param}'", param=param)
    same_field = [e for e in errors if _param_of(tuple(p for p in e["loc"] if p != "body")) == param]
    if len(same_field) > 1:  # a union: say which forms are accepted
        forms = sorted({str(p) for e in same_field for p in e["loc"] if _is_type_tag(p)})
        if forms:
            return invalid(f"Invalid type for '{param}': expected one of {', '.join(forms)}",
                           param=param)
    return invalid(f"Invalid value for '{param}': {first['msg']}", param=param)
