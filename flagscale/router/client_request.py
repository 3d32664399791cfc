"""What the client sent, checked before it is routed: the body read within its limit, parsed once (orjson), the
fields the router reads checked (400 naming the field); and the router's own answers in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from flagscale.router.resume import dumps, loads

# Headers not passed on (either way). "expect": the router has the whole body before it sends the request.
HOP_BY_HOP = frozenset("connection keep-alive transfer-encoding content-length host upgrade te trailer expect".split())
# Deeper request bodies are refused: vLLM's server parses with Python's json, whose recursion gives out near 1000
# levels (a 500 there would count against the replica), and no OpenAI request nests anywhere near this.
MAX_JSON_DEPTH = 64


def error_response(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class BadRequest(Exception):
    """The request cannot be routed as it is: the client gets `status` and this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def response(self) -> web.Response:
        kind = "RequestEntityTooLargeError" if self.status == 413 else "BadRequestError"
        return error_response(self.status, str(self), kind)


def _nests_deeper(value: Any, levels: int) -> bool:
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return False
    if levels == 0:
        return True
    return any(_nests_deeper(item, levels - 1) for item in value if isinstance(item, (dict, list)))


def parse_body(body: bytes) -> Any:
    """A request body as JSON, or BadRequest naming what is wrong with it (not UTF-8, not JSON, an integer
    beyond 64 bits, nested deeper than MAX_JSON_DEPTH)."""
    try:
        value = loads(body)
    except ValueError as exc:  # orjson's JSONDecodeError says what and where
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    # only a body with that many brackets can nest that deep: most never pay for the walk
    if body.count(b"{") + body.count(b"[") > MAX_JSON_DEPTH and _nests_deeper(value, MAX_JSON_DEPTH):
        raise BadRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


# The fields the router itself reads, and the JSON types it can read them as (null: absent).
_ROUTED_FIELDS = (
    ("model", str, "a string"),
    ("stream", bool, "true or false"),
    ("stream_options", dict, "an object"),
    ("messages", list, "a list"),
)


def check_payload(payload: Any) -> None:
    """BadRequest unless the body is an object whose fields the router reads have a type it can read; the rest
    of the request is the engine's to check."""
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(payload).__name__}")
    for key, kind, described in _ROUTED_FIELDS:
        value = payload.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadRequest(f"`{key}` must be {described}, not {dumps(value)[:100].decode(errors='replace')}")


async def read_body(request, limit: int) -> bytes:
    """The request's body, or BadRequest(413) as soon as it is over `limit` bytes (before reading it all when
    Content-Length says so)."""

    def too_large() -> BadRequest:
        return BadRequest(f"request body is over the limit of {limit} bytes (deploy.max_body_bytes)", 413)

    if request.content_length is not None and request.content_length > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)
