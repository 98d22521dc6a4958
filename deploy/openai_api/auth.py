"""API keys at the HTTP edge: with keys set, every route but `/health` needs
`Authorization: Bearer <key>` (what the openai SDK sends as `api_key`), else a 401 in
OpenAI's error shape. The docs routes (/docs, /redoc, /openapi.json) are behind it too.

Keys come from the serve config / AppArgs (`api_keys`), `tokenmux serve --api-key`, and
$TOKENMUX_API_KEYS (comma-separated). They are held as SHA-256 digests, and a config may
give `sha256:<hex>` instead of a key, so that Serve's stored app args need not hold a
secret. A presented key is hashed and compared with every digest by hmac.compare_digest
(no early exit), so the timing shows neither how much of a key matched nor which key.
In-cluster callers (Serve handles) do not pass through HTTP and need no key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable, Mapping

from deploy.openai_api.errors import OpenAIError

ENV_VAR = "TOKENMUX_API_KEYS"
DIGEST_PREFIX = "sha256:"
OPEN_PATHS = frozenset({"/health"})
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def key_digest(key: str) -> str:
    """A key (or an already hashed `sha256:<hex>`) -> `sha256:<hex>`; ValueError on a bad one."""
    if not isinstance(key, str) or not key.strip() or key != key.strip():
        raise ValueError("an API key must be a non-empty string without surrounding spaces")
    if key.startswith(DIGEST_PREFIX):
        hexdigest = key[len(DIGEST_PREFIX):].lower()
        if not _HEX64.match(hexdigest):
            raise ValueError(f"an API key given as {DIGEST_PREFIX}<hex> needs 64 hex digits")
        return DIGEST_PREFIX + hexdigest
    return DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def key_digests(keys: Iterable[str]) -> tuple[str, ...]:
    """Digests of `keys`, de-duplicated, in order."""
    return tuple(dict.fromkeys(key_digest(k) for k in keys))


def keys_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    return [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]


class APIKeyMiddleware:
    """ASGI middleware: checks the bearer key before the app sees the request."""

    def __init__(self, app, digests: Iterable[str]) -> None:
        self.app = app
        self.digests = [bytes.fromhex(d[len(DIGEST_PREFIX):]) for d in key_digests(digests)]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.digests or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        failure = self._check(dict(scope.get("headers") or ()).get(b"authorization"))
        if failure is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(failure.to_dict()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _check(self, header: bytes | None) -> OpenAIError | None:
        if not header:
            return OpenAIError(401, "You didn't provide an API key. Send it in an Authorization header using "
                                    "Bearer auth (Authorization: Bearer YOUR_KEY).", code="missing_api_key")
        scheme, _, presented = header.decode("latin-1").partition(" ")
        digest = hashlib.sha256(presented.strip().encode("latin-1")).digest()
        matched = False
        for known in self.digests:   # every digest is compared: no early exit
            matched |= hmac.compare_digest(digest, known)
        if scheme.lower() == "bearer" and matched:
            return None
        return OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
