"""A replica's LoRA adapters: the set its node should have (Serve's user_config of the engine deployment, so a
changed set reaches running replicas without a restart, and a replica that starts later gets it before it is READY)
loaded and unloaded through its engine's runtime LoRA routes (EngineKind.lora_load_request / lora_unload_request,
on the engine's own port: never on the router's public surface). An adapter that fails to load is left out of the
replica's models (the router sends it no request for it), with the reason in the replica's record."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flagscale.engines.base import EngineKind

LOAD_TIMEOUT_S = 120.0  # one adapter's load (the engine reads its weights and checks them against the model)
Post = Callable[[str, dict[str, Any]], str | None]  # (path, body) -> None when done, else why not


@dataclass
class AdapterSet:
    """What one replica's engine has loaded (name -> directory) and why the ones it lacks failed."""

    loaded: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def sync(self, kind: EngineKind, desired: dict[str, str], post: Post) -> list[str]:
        """Load what `desired` adds or moves to another directory, unload what it drops; returns what was done,
        one line each (for the engine log)."""
        done = []
        for name in sorted(set(self.loaded) - set(desired)):
            problem = post(*kind.lora_unload_request(name))
            if problem is None or problem.startswith("HTTP 404"):  # already gone
                done.append(f"adapter {name!r} unloaded")
            else:
                done.append(f"adapter {name!r} could not be unloaded ({problem}); no request is routed to it")
            del self.loaded[name]
        for name in sorted(self.errors):
            if name not in desired:
                del self.errors[name]
        for name, path in sorted(desired.items()):
            if self.loaded.get(name) == path:
                continue
            problem = post(*kind.lora_load_request(name, path, replace=name in self.loaded))
            if problem is None:
                self.loaded[name] = path
                self.errors.pop(name, None)
                done.append(f"adapter {name!r} loaded from {path}")
            else:
                self.loaded.pop(name, None)
                self.errors[name] = f"loading {path} failed: {problem}"
                done.append(f"adapter {name!r}: {self.errors[name]}")
        return done


def running(kind: EngineKind, url: str, api_key: str | None, timeout_s: float = 2.0) -> list[str] | None:
    """The adapters the engine at `url` runs or has queued now, as its /metrics say (None: it did not answer in
    time, or does not say)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=timeout_s) as r:
            return kind.lora_running(r.read().decode())
    except (OSError, ValueError):
        return None


def poster(url: str, api_key: str | None, timeout_s: float = LOAD_TIMEOUT_S) -> Post:
    """POSTs JSON to the engine at `url` (with the deployment's key): None on 2xx, else the error's text."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}

    def post(path: str, body: dict[str, Any]) -> str | None:
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return None
        except urllib.error.HTTPError as exc:  # before OSError, which it is too
            try:
                text = exc.read().decode(errors="replace")
                text = json.loads(text).get("error", {}).get("message", text)
            except (OSError, ValueError, AttributeError):
                text = ""
            return f"HTTP {exc.code}: {text}".strip()
        except OSError as exc:
            return f"no answer within {timeout_s:g} s ({exc})"

    return post
