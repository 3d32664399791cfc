"""Heavy third-party modules, imported on first use rather than when flagscale is imported.

`import ray` costs a second or more and pulls in grpc and Serve; the CLI's dryrun, status of a stopped run, the
config checks and the router's benchmark do without it. A module here is a `LazyImport` whose first attribute
access imports it, so the rest of the code writes `from flagscale.adaptors import ray` at its top and uses `ray.get`
as usual, instead of an `import ray` inside each function that needs it.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any


class LazyImport:
    """A module imported at the first attribute access (thread-safe; an ImportError surfaces there)."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None
        self._lock = threading.Lock()

    def load(self) -> ModuleType:
        if self._module is None:
            with self._lock:
                if self._module is None:
                    self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazily imported module {self._name!r}, {state}>"


ray = LazyImport("ray")
serve = LazyImport("ray.serve")
ray_exceptions = LazyImport("ray.exceptions")
ray_accelerators = LazyImport("ray._private.accelerators")  # Ray's managers of each chip family
ray_scheduling = LazyImport("ray.util.scheduling_strategies")
cbor2 = LazyImport("cbor2")
hydra_config = LazyImport("hydra.core.hydra_config")
huggingface_hub = LazyImport("huggingface_hub")
jinja2_sandbox = LazyImport("jinja2.sandbox")
msgspec_msgpack = LazyImport("msgspec.msgpack")
matplotlib_figure = LazyImport("matplotlib.figure")  # Figure without pyplot: no global state, an Agg canvas
networkx = LazyImport("networkx")
safetensors_torch = LazyImport("safetensors.torch")
tokenizers = LazyImport("tokenizers")
torch = LazyImport("torch")
transformers = LazyImport("transformers")
zmq = LazyImport("zmq")
zmq_asyncio = LazyImport("zmq.asyncio")
