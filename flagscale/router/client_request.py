"""What the client sent, checked before it is routed: the body read within its limits (size, time, the process's
budget of bodies being read), parsed once (orjson), the fields the router reads checked (400 naming the field);
and the router's own answers in OpenAI's error shape.

Parsing must not stall the event loop every stream of the process is relayed on: a body is refused unread past
MAX_JSON_CONTAINERS brackets (a body of `[[],[],...]` costs orjson about a second per 4 million), bodies up to
INLINE_PARSE_BYTES are parsed inline, larger ones on one worker thread (the depth walk is Python and yields the
interpreter to the loop; one at a time, so the loop waits for at most one parse's C part at once)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from flagscale.config.routing import Admission
from flagscale.router.guard import BodyBudget
from flagscale.router.resume import dumps, loads

# Headers not passed on (either way). "expect": the router has the whole body before it sends the request.
HOP_BY_HOP = frozenset("connection keep-alive transfer-encoding content-length host upgrade te trailer expect".split())
# Deeper request bodies are refused: vLLM's server parses with Python's json, whose recursion gives out near 1000
# levels (a 500 there would count against the replica), and no OpenAI request nests anywhere near this.
MAX_JSON_DEPTH = 64
# Brackets ([ and {, inside strings too) a body may hold: far beyond any request's, and bounded parse work.
MAX_JSON_CONTAINERS = 200_000
INLINE_PARSE_BYTES = 256 * 1024
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="flagscale-router-body")


def error_response(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class BadRequest(Exception):
    """The request cannot be routed as it is: the client gets `status` and this message."""

    KINDS = {413: "RequestEntityTooLargeError", 408: "RequestTimeoutError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        response = error_response(self.status, str(self), self.KINDS.get(self.status, "BadRequestError"), headers)
        if self.status in (408, 413):  # the rest of the body is not waited for
            response.force_close()
        return response


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


async def read_payload(request, bounds: Admission, budget: BodyBudget) -> tuple[bytes, Any]:
    """The request's body and its JSON ({} for an empty body), or BadRequest: 413 as soon as it is over
    max_body_bytes (before reading it when Content-Length says so), 408 when it did not come within
    client_body_timeout_s, 503 when the process is reading max_reading_body_bytes of bodies already, 400 when it
    is not JSON the router can route (parse_body)."""
    limit = bounds.max_body_bytes

    def too_large() -> BadRequest:
        return BadRequest(f"request body is over the limit of {limit} bytes (deploy.max_body_bytes)", 413)

    def busy() -> BadRequest:
        return BadRequest("the router is reading too many request bodies at once (deploy.max_reading_body_bytes)", 503)

    reserved = request.content_length or 0
    if reserved > limit:
        raise too_large()
    if not budget.take(reserved, bounds.max_reading_body_bytes):
        raise busy()
    try:
        chunks, size, brackets = [], 0, 0
        try:
            async with asyncio.timeout(bounds.client_body_timeout_s):
                async for chunk in request.content.iter_any():
                    size += len(chunk)
                    if size > limit:
                        raise too_large()
                    if size > reserved:  # (chunked: the budget grows with the body)
                        if not budget.take(size - reserved, bounds.max_reading_body_bytes):
                            raise busy()
                        reserved = size
                    brackets += chunk.count(b"[") + chunk.count(b"{")
                    chunks.append(chunk)
        except TimeoutError:
            message = f"the request body did not arrive within {bounds.client_body_timeout_s:g} s"
            raise BadRequest(message + " (deploy.client_body_timeout_s)", 408) from None
        if brackets > MAX_JSON_CONTAINERS:
            raise BadRequest(f"request body has over {MAX_JSON_CONTAINERS} JSON arrays and objects ([ and {{ counted)")
        body = b"".join(chunks)
        if not body:
            return body, {}
        if len(body) <= INLINE_PARSE_BYTES:
            return body, parse_body(body)
        return body, await asyncio.get_running_loop().run_in_executor(_PARSER, parse_body, body)
    finally:
        budget.give_back(reserved)
