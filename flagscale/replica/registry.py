"""Where the router learns which engine replicas serve which model, at which URL.

Each engine replica writes one record into Ray's GCS key-value store when its server is healthy and
refreshes it on every Serve health check; the router lists the records. A record that stops being
refreshed goes stale and is dropped, so a dead replica disappears even if it never said goodbye.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from flagscale.cluster.ray_compat import kv_del, kv_get, kv_list, kv_put
from flagscale.engines import DEFAULT_ENGINE

STALE_AFTER_S = 30.0
ROUTER_REFRESH_S = 2.0  # how often the router re-reads the records: a withdrawn replica gets no request after that
KV_NAMESPACE = "flagscale"


@dataclass
class ReplicaRecord:
    app: str
    serve_id: str
    replica_id: str
    models: list[str]
    url: str
    node_id: str
    node_ip: str
    pid: int
    engine_pid: int
    log_path: str
    updated_at: float
    worker_cpus: list[int] = field(default_factory=list)  # cores the engine's workers are bound to (CPU engines)
    gpus: list[str] = field(default_factory=list)  # the devices Ray gave the replica (its family's visible ids)
    family: str = ""  # their device family (flagscale/devices): nvidia, ascend, ...; "" before families / CPUs
    role: str = ""  # "prefill" / "decode" in a disaggregated node; "" colocated
    version: str = ""  # version_of(the replica's spec): which update of its deployment it runs
    engine: str = DEFAULT_ENGINE  # the engine kind (flagscale/engines/)
    # the replica's engine processes by rank: {"rank": int, "pid": int, "host": ip, "cpus": [...], "gpus": [...]};
    # [] for a one-process engine
    ranks: list[dict] = field(default_factory=list)

    @property
    def stale(self) -> bool:
        return time.time() - self.updated_at > STALE_AFTER_S


def version_of(built_from: Any) -> str:
    """A deployment's version: a digest of what its replicas are built from (their spec), so that an update
    restarts exactly the deployments whose spec changed, and `run` knows when every replica runs the new one."""
    return hashlib.sha256(json.dumps(built_from, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _prefix(app: str) -> bytes:
    return f"replicas/{app}/".encode()


def publish(record: ReplicaRecord) -> None:
    record.updated_at = time.time()
    key = _prefix(record.app) + record.replica_id.encode()
    kv_put(key, json.dumps(asdict(record)).encode(), namespace=KV_NAMESPACE)


def withdraw(app: str, replica_id: str) -> None:
    kv_del(_prefix(app) + replica_id.encode(), namespace=KV_NAMESPACE)


def withdraw_all(app: str) -> None:
    """Remove every record of `app` (its stop, after the application is gone)."""
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        kv_del(key, namespace=KV_NAMESPACE)
    kv_del(_stopping_key(app), namespace=KV_NAMESPACE)


def _stopping_key(app: str) -> bytes:
    return f"stopping/{app}".encode()


def mark_stopping(app: str, within_s: float) -> None:
    """`stop` has drained the routers of `app` (they refuse new requests) and deletes it: its replicas need not
    wait for the routers to notice them gone. Good for `within_s`, so a stop that died half-way cannot speak for a
    later deployment of the same name."""
    kv_put(_stopping_key(app), json.dumps({"until": time.time() + within_s}).encode(), namespace=KV_NAMESPACE)


def stopping(app: str) -> bool:
    raw = kv_get(_stopping_key(app), namespace=KV_NAMESPACE)
    return raw is not None and time.time() < json.loads(raw)["until"]


def list_replicas(app: str, include_stale: bool = False) -> list[ReplicaRecord]:
    records = []
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        raw = kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        record = ReplicaRecord(**json.loads(raw))
        if include_stale or not record.stale:
            records.append(record)
    return records
