"""The API key on every route of a vLLM server but /health.

vLLM's own key check (`--api-key` / VLLM_API_KEY) guards only a few path prefixes (/v1, /v2, ...): /invocations
runs completions and chat, and /tokenize, /metrics and more answer anyone who reaches the port. An engine replica
with a key passes `--middleware flagscale.engines.vllm_auth.RequireApiKey` to its server; vLLM adds an
ASGI middleware class given there with `app.add_middleware(cls)` and no arguments (0.26 - 0.32 alike), so the key
is read from the server's environment, where the replica put it, never from argv.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = f"{__name__}.RequireApiKey"
OPEN_PATHS = frozenset({"/health"})  # Serve's and the router's liveness probes carry no key
WEBSOCKET_POLICY_VIOLATION = 1008
_UNAUTHORIZED = json.dumps(
    {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error", "code": "invalid_api_key"}}
).encode()


def _digest(value: bytes) -> bytes:
    # Equal-length digests, so the comparison takes as long whatever the key's length and the guess's.
    return hashlib.sha256(value).digest()


class RequireApiKey:
    """Pure ASGI: a request without `Authorization: Bearer <key>` gets 401 in OpenAI's error shape (a websocket
    is closed before it is accepted); GET /health and lifespan events pass. Without a key in the environment
    everything passes."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV)
        self._expected = _digest(b"Bearer " + key.encode()) if key else None

    def _authorized(self, scope: Scope) -> bool:
        given = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(_digest(given[0]), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected is None or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": WEBSOCKET_POLICY_VIOLATION})
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
