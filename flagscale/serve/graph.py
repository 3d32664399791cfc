"""Deployment graphs at run time: custom nodes as Serve deployments, and the driver that runs the DAG.

Each custom node is a `CustomNode` deployment that loads the user's class from its file inside the replica.
The `GraphDriver` deployment holds a handle per custom node and runs one request through the graph with
asyncio: a node starts as soon as all its dependencies are done, so independent nodes run concurrently.
The router forwards the graph's route to the driver. Engine nodes are reached from custom nodes through an
`EngineClient`, which sends OpenAI requests through the router like any other client.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from flagscale.adaptors import serve
from flagscale.config.graph import GRAPH_DRIVER_DEPLOYMENT, GraphPlan, load_class  # noqa: F401
from flagscale.config.request import bind
from flagscale.errors import error_excerpt


class EngineCallError(RuntimeError):
    pass


class EngineClient:
    """What a custom node's constructor parameter named after an engine node receives.

    `await client.generate(prompt, max_tokens=32)` returns the generated text; `complete` and `chat` return
    the OpenAI response as a dict. A sync `forward` runs in a worker thread and can use `asyncio.run(...)`.
    With deploy.api_key set, every call carries it, as the router requires of any client.
    """

    def __init__(self, endpoint: str, model: str, timeout_s: float = 600, api_key: str | None = None):
        self.endpoint = endpoint
        self.model = model
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __repr__(self) -> str:
        return f"EngineClient({self.endpoint!r}, {self.model!r})"

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            request = {"model": self.model, **body}
            async with session.post(self.endpoint + path, json=request, headers=self._headers) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineCallError(f"{self.model}{path}: HTTP {resp.status}: {text[:500]}")
                return json.loads(text)

    async def complete(self, prompt: str, **params: Any) -> dict[str, Any]:
        return await self._post("/v1/completions", {"prompt": prompt, **params})

    async def generate(self, prompt: str, **sampling: Any) -> str:
        return (await self.complete(prompt, **sampling))["choices"][0]["text"]

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        return await self._post("/v1/chat/completions", {"messages": messages, **params})


@dataclass
class NodeSpec:
    serve_id: str
    module_path: str
    class_name: str
    engine_clients: dict[str, tuple[str, str]]  # constructor parameter -> (router endpoint, model name)
    module_digest: str = ""  # part of the deployment's version: changed code replaces the replicas
    # deploy.api_key: in the replica's init args, which Serve's status does not show (unlike ray_actor_options)
    api_key: str | None = field(default=None, repr=False)


class CustomNode:
    """One replica of a custom node: the user's object, with forward run so the event loop stays free."""

    def __init__(self, spec: NodeSpec):
        self.spec = spec
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        cls = load_class(spec.module_path, spec.class_name)
        if cls is None:
            raise RuntimeError(f"{spec.module_path} has no class {spec.class_name}")
        clients = {
            param: EngineClient(endpoint, model, api_key=spec.api_key)
            for param, (endpoint, model) in spec.engine_clients.items()
        }
        self.instance = cls(**clients)
        self.forward_is_async = inspect.iscoroutinefunction(self.instance.forward)

    async def forward(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The node's output and when it ran (wall clock of this replica)."""
        start = time.time()
        if self.forward_is_async:
            output = await self.instance.forward(*args, **kwargs)
        else:
            # A sync forward runs in a thread, so this replica keeps taking requests meanwhile.
            output = await asyncio.to_thread(self.instance.forward, *args, **kwargs)
        trace = {"node": self.spec.serve_id, "replica": self.replica_id, "start": start, "end": time.time()}
        return output, trace


class GraphNodeError(RuntimeError):
    def __init__(self, serve_id: str, cause: BaseException):
        self.serve_id = serve_id
        super().__init__(f"node '{serve_id}' failed: {_root_cause(cause)}")


def _root_cause(exc: BaseException) -> str:
    """Serve wraps a replica's exception in a RayTaskError whose text is a traceback; keep its error line."""
    return error_excerpt(str(exc), after=0, fallback=1).strip() or type(exc).__name__


class GraphDriver:
    """Runs one request through the DAG. Returns {"status", "result" | "error", "trace"?}."""

    def __init__(self, graph: GraphPlan, **handles):
        self.graph = graph
        self.handles = handles  # serve_id -> DeploymentHandle of the CustomNode deployment

    async def run(self, payload: Any, with_trace: bool = False) -> dict[str, Any]:
        request, problem = bind(self.graph.request_fields, payload)
        if problem:
            return {"status": 400, "error": problem}
        traces: list[dict[str, Any]] = []
        tasks: dict[str, asyncio.Task] = {}

        async def run_node(serve_id: str, depends: list[str]) -> Any:
            if depends:
                args, kwargs = list(await asyncio.gather(*(tasks[d] for d in depends))), {}
            else:
                args, kwargs = [], request
            try:
                output, trace = await self.handles[serve_id].forward.remote(args, kwargs)
            except Exception as exc:
                raise GraphNodeError(serve_id, exc) from exc
            traces.append(trace)
            return output

        for node in self.graph.nodes:  # topological: every dependency's task exists already
            tasks[node.serve_id] = asyncio.ensure_future(run_node(node.serve_id, node.depends))
        try:
            result = await tasks[self.graph.sink]
        except GraphNodeError as exc:
            return {"status": 500, "error": str(exc), "node": exc.serve_id}
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        reply: dict[str, Any] = {"status": 200, "result": result}
        if with_trace:
            reply["trace"] = sorted(traces, key=lambda t: t["start"])
        return reply
