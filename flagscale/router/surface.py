"""The router's public surface (docs/operations.md): the paths it answers itself (GET /health, GET /metrics,
GET /v1/models, POST on the graph's route) and the paths it passes on, an allowlist from the engine kinds of the
models it serves (EngineKind.public_paths); any other path answers 404 at the router and never reaches an engine.

Built once per RouterSpec. A request costs one dict lookup (a path with a `{name}` segment: a regex per such
pattern), its model's engine one more; the body fields only the router sets (EngineKind.router_fields) are dropped
from what a client sent, once per request, wherever the engine would read them.
"""

from __future__ import annotations

import re
from typing import Any

from flagscale import engines

# A `{name}` segment of a public path: what an id in a URL is made of (so a matched path is sent on as it is)
_SEGMENT = "[A-Za-z0-9._~:-]+"


class Surface:
    """What `spec` (a RouterSpec) serves: `own` (path -> the one method the router answers on it itself),
    `served(path)`, `engine_of` (served model name -> engine kind) and `strip`."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.own = {"/health": "GET", "/metrics": "GET", "/v1/models": "GET"}
        if spec.graph_route:
            self.own[spec.graph_route] = "POST"
        self.engine_of = {model: spec.engines.get(model, engines.DEFAULT_ENGINE) for model in spec.models}
        self._exact: dict[str, dict[str, bool]] = {}
        self._patterns: list[tuple[re.Pattern, dict[str, bool]]] = []
        self._router_fields: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for name in sorted(set(self.engine_of.values())):
            kind = engines.get(name)
            self._router_fields[name] = (kind.router_fields, kind.extra_args_fields)
            for path in kind.public_paths:
                self._route(path)[name] = path in kind.inference_paths

    def _route(self, path: str) -> dict[str, bool]:
        if "{" not in path:
            return self._exact.setdefault(path, {})
        regex = re.compile("".join(_SEGMENT if part.startswith("{") else re.escape(part) for part in _parts(path)))
        for known, route in self._patterns:
            if known.pattern == regex.pattern:
                return route
        self._patterns.append((regex, {}))
        return self._patterns[-1][1]

    def served(self, path: str) -> dict[str, bool] | None:
        """Engine kind -> whether the engine runs the model on `path` (EngineKind.inference_paths), for the kinds
        that serve it publicly; None: no engine here does (the router answers 404)."""
        route = self._exact.get(path)
        if route is None:
            for regex, candidate in self._patterns:
                if regex.fullmatch(path):
                    return candidate
        return route

    def strip(self, model: str, payload: dict[str, Any]) -> bool:
        """Drop what the client put where only the router may (kv_transfer_params, at the top level and in the
        engine's extra-args fields); True when anything was dropped."""
        fields, extra = self._router_fields[self.engine_of[model]]
        dropped = False
        for container in (payload, *(payload.get(name) for name in extra)):
            if isinstance(container, dict):
                for field in fields:
                    if field in container:
                        del container[field]
                        dropped = True
        return dropped


def _parts(path: str) -> list[str]:
    """ "/v1/responses/{id}/cancel" -> ["/v1/responses/", "{id}", "/cancel"]."""
    return [part for part in re.split(r"(\{[^}]*\})", path) if part]
