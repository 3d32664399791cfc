"""The router's admin call for LoRA adapters (docs/operations.md, "Adapters at run time"): an operator adds and
removes a node's adapters on a running deployment without a `run`.

    GET  /admin/adapters                     every LoRA node: its set, and what each replica loaded or failed
    POST /admin/adapters {"model": <the node's base model>, "add": {name: directory}, "remove": [name, ...]}

Both need the deployment's engine key (exp_dir/engine_api_key, keyring.py), never a client key: whoever holds it
can already reach the engines' own LoRA routes. A POST checks every added adapter as `run` does (its directory,
adapter_config.json, base model and rank: config/lora.py's check_adapter) and its name against the served
models, stores the node's whole new set (replica/runtime_adapters.py), then waits (at most WAIT_S) until every
replica of the node has loaded or refused each adapter of the set and dropped the removed ones: 200 when all
loaded, 409 when some replica refused one (each refusal said), 504 when the wait ran out (what is pending said).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from flagscale.config.lora import check_adapter, read_adapter
from flagscale.errors import ConfigError
from flagscale.replica import runtime_adapters
from flagscale.replica.registry import ReplicaRecord
from flagscale.router.client_request import error_response
from flagscale.router.guard import KeyCheck
from flagscale.router.keyring import header_key
from flagscale.router.spec import LoraNode, RouterSpec

PATH = "/admin/adapters"
WAIT_S = 180.0  # the most a POST waits for the replicas to load the new set (each load: the engine's own bound)
POLL_S = 0.5


class BadChange(ValueError):
    """A POST that changes nothing: the message names the culprit."""


def changed_set(spec: RouterSpec, sets: dict[str, dict[str, str]], body: Any) -> tuple[str, dict[str, str]]:
    """The node a POST names (serve_id) and its new set; BadChange when the body, a name or an adapter is wrong.
    `sets`: the sets given at run time so far (a node without one has its configured set)."""
    if not isinstance(body, dict) or set(body) - {"model", "add", "remove"}:
        raise BadChange('the body is {"model": <base model>, "add": {name: directory}, "remove": [name, ...]}')
    model, add, remove = body.get("model"), body.get("add", {}), body.get("remove", [])
    nodes = {node.base: (serve_id, node) for serve_id, node in spec.lora_nodes.items()}
    if model not in nodes:
        raise BadChange(f"model {model!r} is no base model with LoRA here; those are: {', '.join(sorted(nodes))}")
    if not isinstance(add, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in add.items()):
        raise BadChange('"add" is an object of adapter name -> directory')
    if not isinstance(remove, list) or not all(isinstance(name, str) for name in remove):
        raise BadChange('"remove" is a list of adapter names')
    serve_id, node = nodes[model]
    current = dict(sets.get(serve_id, node.adapters))
    for name in remove:
        if name not in current:
            raise BadChange(f"remove: {name!r} is no adapter of {model!r} (its adapters: {', '.join(current)})")
        del current[name]
    for name, path in add.items():
        _check_added(spec, node, name, path)
        current[name] = read_adapter(path).path
    return serve_id, current


def _check_added(spec: RouterSpec, node: LoraNode, name: str, path: str) -> None:
    if not name or len(name) > 200 or any(c.isspace() or c in "/\\" for c in name):
        raise BadChange(f"add: {name!r} is no adapter name (no spaces or slashes, at most 200 characters)")
    if name in spec.models and spec.adapters.get(name) != node.base:
        raise BadChange(f"add: {name!r} is already a model here (of another node, or a base model)")
    try:
        check_adapter(name, read_adapter(path), node.model, node.max_lora_rank, node.default_rank_limit, f"add.{name}")
    except ConfigError as exc:
        raise BadChange(str(exc)) from None


def progress(records: list[ReplicaRecord], serve_id: str, node: LoraNode, wanted: dict[str, str]) -> dict[str, dict]:
    """Per replica of the node: which adapters of `wanted` it loaded, refused (why), lacks yet, and which it still
    serves that `wanted` dropped."""
    report = {}
    for record in records:
        if record.serve_id != serve_id:
            continue
        serving = set(record.models) - set(node.served)  # its models past the node's own names: its adapters
        report[record.replica_id] = {
            "loaded": sorted(name for name in wanted if name in serving),
            "refused": {name: why for name, why in record.adapter_errors.items() if name in wanted},
            "pending": sorted(name for name in wanted if name not in serving and name not in record.adapter_errors),
            "dropping": sorted(serving - set(wanted)),
        }
    return report


async def engine_key_only(request: web.Request, spec: RouterSpec, keys: KeyCheck, handler) -> web.StreamResponse:
    """The admin routes take the deployment's engine key alone, never a client key (later and later answers for an
    address that keeps failing, as for client keys)."""
    given = header_key(request.headers.get("Authorization", "")) or ""
    address = request.remote or ""
    if not spec.engine_key or not hmac.compare_digest(given.encode(errors="surrogateescape"), spec.engine_key.encode()):
        delay = keys.failure_delay(address)
        if delay:
            await asyncio.sleep(delay)
        message = "the admin routes take the deployment's engine key (exp_dir/engine_api_key)"
        return error_response(401, message, "AuthenticationError")
    keys.succeeded(address)
    return await handler(request)


class AdapterAdmin:
    """GET/POST /admin/adapters. `spec`: the router's current spec; `records`: the live replicas' records;
    `refresh`: reads the registry and the sets given at run time again (and applies them)."""

    def __init__(
        self,
        spec: Callable[[], RouterSpec],
        records: Callable[[], list[ReplicaRecord]],
        refresh: Callable[[], Awaitable[None]],
    ) -> None:
        self._spec, self._records, self._refresh = spec, records, refresh
        self._changing = asyncio.Lock()  # one change at a time in this process

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return web.json_response(await self._listing())
        if request.method != "POST":
            return error_response(405, f"{PATH} takes GET and POST", "MethodNotAllowed")
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, f"{PATH}: the body is no JSON", "BadRequestError")
        async with self._changing:
            loop = asyncio.get_running_loop()
            spec = self._spec()
            sets = await loop.run_in_executor(None, runtime_adapters.read_all, spec.app)
            try:  # (reads each added adapter's files: off the router's loop)
                serve_id, wanted = await loop.run_in_executor(None, changed_set, spec, sets, body)
            except BadChange as exc:
                return error_response(400, str(exc), "BadRequestError")
            await loop.run_in_executor(None, runtime_adapters.put, spec.app, serve_id, wanted)
            return await self._until_applied(serve_id, wanted)

    async def _until_applied(self, serve_id: str, wanted: dict[str, str]) -> web.Response:
        deadline = time.monotonic() + WAIT_S
        while True:
            await self._refresh()
            node = self._spec().lora_nodes.get(serve_id)
            if node is None:  # an update took the node away meanwhile
                return error_response(409, f"node {serve_id!r} left the deployment", "ConflictError")
            report = progress(self._records(), serve_id, node, wanted)
            busy = any(r["pending"] or r["dropping"] for r in report.values())
            if not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
        refused = any(r["refused"] for r in report.values())
        status = 504 if busy else 409 if refused else 200
        return web.json_response({"serve_id": serve_id, "adapters": wanted, "replicas": report}, status=status)

    async def _listing(self) -> dict:
        spec = self._spec()
        sets = await asyncio.get_running_loop().run_in_executor(None, runtime_adapters.read_all, spec.app)
        records = self._records()
        nodes = {}
        for serve_id, node in spec.lora_nodes.items():
            wanted = sets.get(serve_id, node.adapters)
            nodes[node.base] = {
                "serve_id": serve_id,
                "adapters": wanted,
                "given_at_run_time": serve_id in sets,
                "replicas": progress(records, serve_id, node, wanted),
            }
        return {"models": nodes}
