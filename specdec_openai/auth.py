"""An API key for the OpenAI face, as vLLM's ``--api-key``: every ``/v1`` request must carry it.

A request whose path starts with ``/v1`` needs ``Authorization: Bearer <key>``; one
without it, or with another key, gets HTTP 401 in OpenAI's error shape and never
reaches a route, so an unknown ``/v1`` path is a 401 too and tells nothing about which
routes exist. ``/health`` and ``/metrics`` stay open, as in vLLM: load balancers and
Prometheus ask them without credentials, and they carry no model output.

The check is a pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: the latter
wraps ``receive``, and the routes watch ``receive`` for the client's disconnect to
cancel its Triton request. Keys are compared as bytes with :func:`hmac.compare_digest`,
in time that does not depend on where they differ. The key appears in no log line, no
error body and no ``repr``.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Mapping

from specdec_openai.responses import error_body

# Where the key may come from, after ``--api-key``: ours first, then vLLM's, so that a
# deployment written for ``vllm serve`` keeps its access control when pointed at this server.
KEY_ENV_VARS = ("SPECDEC_OPENAI_API_KEY", "VLLM_API_KEY")
GUARDED_PREFIX = "/v1"

MISSING = "no API key: send it as 'Authorization: Bearer <key>'"
WRONG = "incorrect API key in the Authorization header"


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the key, where it came from): ``--api-key``, else the first of :data:`KEY_ENV_VARS` set non-empty.

    An empty environment variable counts as unset (templated deployments write ``KEY=``);
    an empty ``--api-key`` is refused: it is a variable that expanded to nothing, and
    serving without a key is not what it asked for.
    """
    if flag is not None:
        if not flag.strip():
            raise ValueError("--api-key is empty; leave it out to serve without a key")
        return flag, "--api-key"
    for name in KEY_ENV_VARS:
        if environ.get(name, "").strip():
            return environ[name], name
    return None, "none"


def authorized(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``key`` as a Bearer token.

    The scheme is matched without regard to case (RFC 7235); the token exactly. Starlette
    decodes header bytes as latin-1, so encoding back gives the bytes the client sent.
    """
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("latin-1", "replace"), key.encode("utf-8"))


class ApiKeyMiddleware:
    """Refuses ``/v1`` requests that do not carry the key; passes every other request on untouched."""

    def __init__(self, app, key: str):
        self.app, self._key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        if authorized(header, self._key):
            await self.app(scope, receive, send)
            return
        message = MISSING if header is None else WRONG
        body = json.dumps(error_body(message, code="invalid_api_key")).encode("utf-8")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def __repr__(self) -> str:
        return "ApiKeyMiddleware(key=<hidden>)"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
