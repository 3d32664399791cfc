"""LoRA adapter sets given at run time through the router's admin call (docs/operations.md, "Adapters at run time").

A node's adapters come from its config (Serve's user_config of its engine deployment: replica/adapters.py). An
operator may change the set without a `run`: the router's `POST /admin/adapters` stores the node's whole new set
here, in Ray's GCS key-value store beside the replica records, and from then on that set is the node's:

- every replica of the node reads it on its health checks and loads/unloads to match; a replica that starts later
  reads it before it is READY (EngineReplica.reconfigure);
- every router process reads it on its refresh and serves the set's adapters as models (RouterSpec.with_adapter_sets);
- `run` again (an update) and `stop` remove it: the config is the deployment's truth again.
"""

from __future__ import annotations

import json

from flagscale.cluster.ray_compat import kv_del, kv_get, kv_list, kv_put
from flagscale.replica.registry import KV_NAMESPACE


def _prefix(app: str) -> bytes:
    return f"adapters/{app}/".encode()


def put(app: str, serve_id: str, adapters: dict[str, str]) -> None:
    """`adapters` (name -> directory) is node `serve_id`'s set from now on."""
    kv_put(_prefix(app) + serve_id.encode(), json.dumps(adapters, sort_keys=True).encode(), namespace=KV_NAMESPACE)


def get(app: str, serve_id: str) -> dict[str, str] | None:
    """The node's set given at run time, or None (its config's set holds)."""
    raw = kv_get(_prefix(app) + serve_id.encode(), namespace=KV_NAMESPACE)
    return None if raw is None else dict(json.loads(raw))


def read_all(app: str) -> dict[str, dict[str, str]]:
    """Every node of `app` whose set was given at run time: serve_id -> its set."""
    sets = {}
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        raw = kv_get(key, namespace=KV_NAMESPACE)
        if raw is not None:
            sets[key[len(_prefix(app)) :].decode()] = dict(json.loads(raw))
    return sets


def clear(app: str) -> dict[str, dict[str, str]]:
    """Forget every set given at run time (an update or stop: the config holds again); returns what was there."""
    sets = read_all(app)
    for serve_id in sets:
        kv_del(_prefix(app) + serve_id.encode(), namespace=KV_NAMESPACE)
    return sets
