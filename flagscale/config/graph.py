"""Deployment graphs: validate the custom Python nodes of a config and turn them into a GraphPlan.

A custom node is `module` (a .py file) + `name` (a class with a `forward` method) + `depends` (other custom
nodes). Nodes without `depends` get the request fields as keyword arguments; the others get their
dependencies' outputs as positional arguments, in the listed order; the single sink answers the request.
Engine nodes are not steps of the graph: a custom node reaches one through a client injected into its
constructor parameter named after the engine's serve_id.

Everything here runs before anything starts, and each problem is a ConfigError naming the node and file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flagscale.config.load import ConfigSources
from flagscale.config.replicas import ReplicaSettings, replica_settings
from flagscale.config.request import RequestField, parse_fields
from flagscale.config.schema import NodeConfig, ServeConfig
from flagscale.errors import ConfigError

DEFAULT_ROUTE = "/generate"
GRAPH_DRIVER_DEPLOYMENT = "graph"  # the deployment that runs the DAG
RESERVED_ROUTES = ("/v1", "/health")


@dataclass(frozen=True)
class CustomNodePlan(ReplicaSettings):
    serve_id: str
    module_path: str  # absolute
    module_digest: str  # of the file's bytes: new code is a change to update in place (flagscale/update.py)
    class_name: str
    depends: list[str]
    engine_params: dict[str, str]  # constructor parameter -> engine serve_id


@dataclass
class GraphPlan:
    route: str
    request_fields: list[RequestField] | None  # None: the roots get the JSON body's fields as they come
    nodes: list[CustomNodePlan]  # in topological order
    sink: str
    engine_models: dict[str, str] = field(default_factory=dict)  # engine serve_id -> model name to request

    @property
    def request_args(self) -> list[str] | None:
        return None if self.request_fields is None else [f.name for f in self.request_fields]

    def node(self, serve_id: str) -> CustomNodePlan:
        return next(n for n in self.nodes if n.serve_id == serve_id)


def resolve_module(module: str, sources: ConfigSources) -> Path | None:
    """The node's .py file: absolute, or relative to the config dir(s), else to the working dir."""
    path = Path(module).expanduser()
    if path.is_absolute():
        return path if path.is_file() else None
    for base in candidate_dirs(sources):
        if (base / path).is_file():
            return (base / path).resolve()
    return None


def candidate_dirs(sources: ConfigSources) -> list[Path]:
    dirs = [Path(f).parent for f in (sources.main, sources.serve) if f and not f.startswith("<")]
    dirs.append(Path.cwd())
    return list(dict.fromkeys(d.resolve() for d in dirs))


def load_class(module_path: str | Path, class_name: str) -> type | None:
    """Import the file as a module of its own (its directory importable, for sibling modules)."""
    path = Path(module_path).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    module_name = f"flagscale_node_{path.stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        sys.modules[module_name] = module  # dataclasses and pickling look classes up here
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
    cls = getattr(module, class_name, None)
    return cls if inspect.isclass(cls) else None


def find_cycle(depends: dict[str, list[str]]) -> list[str] | None:
    """A dependency cycle as [a, b, ..., a], or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for dep in depends.get(node, []):
            cycle = visit(dep)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in depends:
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def topological_order(depends: dict[str, list[str]]) -> list[str]:
    order: list[str] = []
    placed: set[str] = set()

    def place(node: str) -> None:
        if node in placed:
            return
        for dep in depends[node]:
            place(dep)
        placed.add(node)
        order.append(node)

    for node in depends:
        place(node)
    return order


def check_forward_arity(cls: type, node: NodeConfig, request_args: list[str] | None, where: str) -> None:
    forward = getattr(cls, "forward", None)
    if not callable(forward):
        raise ConfigError(f"class {cls.__name__} has no forward method", where)
    params = list(inspect.signature(forward).parameters.values())[1:]  # without self
    kinds = inspect.Parameter
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == kinds.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == kinds.VAR_KEYWORD for p in params)
    signature = f"{cls.__name__}.forward{inspect.signature(forward)}"
    if node.depends:
        required = [p for p in positional if p.default is p.empty]
        required_kw = [p.name for p in params if p.kind == kinds.KEYWORD_ONLY and p.default is p.empty]
        n = len(node.depends)
        if len(required) > n or (n > len(positional) and not has_varargs) or required_kw:
            raise ConfigError(
                f"{signature} does not take {n} positional argument(s), one per dependency {node.depends}", where
            )
        return
    if request_args is None:
        return
    by_keyword = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    unaccepted = [a for a in request_args if a not in by_keyword] if not has_varkw else []
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        and p.name not in request_args
    ]
    if unaccepted or missing:
        problem = (
            f"does not accept request field(s) {unaccepted}" if unaccepted else f"needs {missing}, not request fields"
        )
        raise ConfigError(
            f"{signature} {problem}; a node without depends gets the request fields "
            f"{request_args} as keyword arguments",
            where,
        )


def engine_parameters(cls: type, engines: dict[str, str], where: str) -> dict[str, str]:
    """Constructor parameters that receive an engine client: those named after an engine's serve_id."""
    by_param = {serve_id.replace("-", "_"): serve_id for serve_id in engines}
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    injected = {}
    for param in params:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in by_param:
            injected[param.name] = by_param[param.name]
        elif param.default is param.empty:
            known = ", ".join(by_param) or "none in this graph"
            raise ConfigError(
                f"constructor parameter '{param.name}' of {cls.__name__} has no default and names no "
                f"engine node (engine clients: {known})",
                where,
            )
    return injected


def _route(name: str | None, where: str) -> str:
    route = name or DEFAULT_ROUTE
    route = route if route.startswith("/") else "/" + route
    if route == "/" or any(route == r or route.startswith(r + "/") for r in RESERVED_ROUTES):
        raise ConfigError(
            f"route {route!r} collides with the OpenAI routes (/v1/..., /health); pick e.g. /generate", where
        )
    return route


def build_graph_plan(config: ServeConfig, sources: ConfigSources, engine_models: dict[str, str]) -> GraphPlan | None:
    """None when the config has no custom node (a plain set of engines). `engine_models`: serve_id -> model name."""
    serve_file = sources.file_for(("serve",))
    deploy = config.experiment.runner.deploy
    deploy_where = f"{sources.main}: experiment.runner.deploy"
    index_of = {node.serve_id: i for i, node in enumerate(config.serve)}
    custom = [node for node in config.serve if not node.is_engine]

    def where(node: NodeConfig) -> str:
        return f"{serve_file}: serve[{index_of[node.serve_id]}]({node.serve_id})"

    _check_reserved_ids(config.serve, bool(custom), where)
    if not custom:
        if deploy.name is not None or deploy.request is not None:
            raise ConfigError(
                "no sink: deploy.name/request describe a graph entry, but the graph has no custom node "
                "(module + name) to answer it",
                deploy_where,
            )
        return None
    route = _route(deploy.name, f"{deploy_where}.name")
    request_fields = parse_fields(deploy.request, f"{deploy_where}.request")
    request_args = None if request_fields is None else [f.name for f in request_fields]
    depends = _dependencies(custom, engine_models, index_of, where)
    cycle = find_cycle(depends)
    if cycle:
        raise ConfigError(f"dependency cycle: {' -> '.join(cycle)}", where(config.serve[index_of[cycle[0]]]))
    sink = _sink(depends, serve_file)
    plans = {
        node.serve_id: _custom_node_plan(node, sources, request_args, engine_models, where(node)) for node in custom
    }
    return GraphPlan(
        route=route,
        request_fields=request_fields,
        nodes=[plans[serve_id] for serve_id in topological_order(depends)],
        sink=sink,
        engine_models=dict(engine_models),
    )


def _check_reserved_ids(nodes: list[NodeConfig], has_custom: bool, where: Callable[[NodeConfig], str]) -> None:
    reserved = {"router", GRAPH_DRIVER_DEPLOYMENT} if has_custom else {"router"}  # the app's own deployments
    for node in nodes:
        if node.serve_id in reserved:
            raise ConfigError(
                f"serve_id '{node.serve_id}' is reserved for the application's own deployment; rename the node",
                where(node),
            )


def _dependencies(
    custom: list[NodeConfig],
    engine_models: dict[str, str],
    index_of: dict[str, int],
    where: Callable[[NodeConfig], str],
) -> dict[str, list[str]]:
    """serve_id -> the custom nodes it depends on, each checked: a custom node of this config, listed once."""
    depends: dict[str, list[str]] = {}
    for node in custom:
        for dep in node.depends:
            if dep in engine_models:
                raise ConfigError(
                    f"depends on engine node '{dep}': engine nodes are not graph steps; call it from the node through "
                    f"the client injected into its constructor parameter '{dep.replace('-', '_')}'",
                    where(node),
                )
            if dep not in index_of:
                raise ConfigError(
                    f"unknown dependency '{dep}' (custom nodes: {', '.join(n.serve_id for n in custom)})", where(node)
                )
        if len(set(node.depends)) != len(node.depends):
            raise ConfigError(f"depends lists a node twice: {node.depends}", where(node))
        depends[node.serve_id] = list(node.depends)
    return depends


def _sink(depends: dict[str, list[str]], serve_file: str) -> str:
    """The one node nothing depends on: it answers the request."""
    depended_on = {dep for deps in depends.values() for dep in deps}
    sinks = [serve_id for serve_id in depends if serve_id not in depended_on]
    if len(sinks) != 1:
        raise ConfigError(
            f"the graph needs exactly one sink (a node nothing depends on) to answer the request; "
            f"found {len(sinks)}: {', '.join(sinks)}",
            serve_file,
        )
    return sinks[0]


def _custom_node_plan(
    node: NodeConfig,
    sources: ConfigSources,
    request_args: list[str] | None,
    engine_models: dict[str, str],
    where: str,
) -> CustomNodePlan:
    """One custom node: its module found and imported, its class's forward and constructor checked."""
    path = resolve_module(node.module, sources)
    if path is None:
        tried = ", ".join(str(d) for d in candidate_dirs(sources))
        raise ConfigError(f"module file {node.module!r} not found (relative to: {tried})", where)
    node_where = f"{where} ({path})"
    try:
        cls = load_class(path, node.name)
    except Exception as exc:
        raise ConfigError(f"importing the module failed: {type(exc).__name__}: {exc}", node_where) from None
    if cls is None:
        raise ConfigError(f"module has no class '{node.name}'", node_where)
    check_forward_arity(cls, node, request_args, node_where)
    engine_params = engine_parameters(cls, engine_models, node_where)
    return CustomNodePlan(
        serve_id=node.serve_id,
        module_path=str(path),
        module_digest=hashlib.sha256(path.read_bytes()).hexdigest()[:16],
        class_name=node.name,
        depends=list(node.depends),
        engine_params=engine_params,
        **vars(replica_settings(node.resources)),
    )
