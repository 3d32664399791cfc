"""Where the router learns which engine replicas serve which model, at which URL.

Each engine replica writes one record into Ray's GCS key-value store when its server is healthy and
refreshes it on every Serve health check; the router lists the records. A record that stops being
refreshed goes stale and is dropped, so a dead replica disappears even if it never said goodbye.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from flagscale.cluster.ray_compat import kv_del, kv_get, kv_list, kv_put

STALE_AFTER_S = 30.0
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
    role: str = ""  # "prefill" / "decode" in a disaggregated node; "" colocated

    @property
    def stale(self) -> bool:
        return time.time() - self.updated_at > STALE_AFTER_S


def _prefix(app: str) -> bytes:
    return f"replicas/{app}/".encode()


def publish(record: ReplicaRecord) -> None:
    record.updated_at = time.time()
    key = _prefix(record.app) + record.replica_id.encode()
    kv_put(key, json.dumps(asdict(record)).encode(), namespace=KV_NAMESPACE)


def withdraw(app: str, replica_id: str) -> None:
    kv_del(_prefix(app) + replica_id.encode(), namespace=KV_NAMESPACE)


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
