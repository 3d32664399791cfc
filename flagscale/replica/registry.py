"""Where the router learns which engine replicas serve which model, at which URL.

Each engine replica writes one record into Ray's GCS key-value store when its server is healthy and
refreshes it on every Serve health check, advancing the record's `seq`; the router lists the records. A record
whose `seq` stops advancing goes stale (judged by the router's own clock: liveness.py, never by comparing the
replica host's wall clock with the router's) and is dropped and withdrawn by the router, so a dead replica
disappears even if it never said goodbye.
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
    updated_at: float  # the publisher's wall clock at its last publish: shown, never compared across hosts
    worker_cpus: list[int] = field(default_factory=list)  # cores the engine's workers are bound to (CPU engines)
    gpus: list[str] = field(default_factory=list)  # the devices Ray gave the replica (its family's visible ids)
    family: str = ""  # their device family (flagscale/devices): nvidia, ascend, ...; "" before families / CPUs
    role: str = ""  # "prefill" / "decode" in a disaggregated node; "" colocated
    version: str = ""  # version_of(the replica's spec): which update of its deployment it runs
    fingerprint: str = ""  # what makes its answers (EngineSpec.fingerprint): a stream resumes only on the same
    engine: str = DEFAULT_ENGINE  # the engine kind (flagscale/engines/)
    # the replica's engine processes by rank: {"rank": int, "pid": int, "host": ip, "cpus": [...], "gpus": [...]};
    # [] for a one-process engine
    ranks: list[dict] = field(default_factory=list)
    # sleep mode (resources.sleep_delay_s): the engine sleeps now (its GPU memory freed; the router wakes it), and
    # how many times it went to sleep (the router's wake answers one of them: router/wake.py)
    asleep: bool = False
    sleeps: int = 0
    # its engine's KV-cache events: endpoints and how to key blocks (EngineKind.kv_events_launch); {}: none
    kv_events: dict = field(default_factory=dict)
    seq: int = 0  # advanced on every publish: readers judge staleness by it (liveness.py)
    # LoRA adapters of its node that its engine failed to load: name -> why (its loaded ones are in `models`)
    adapter_errors: dict[str, str] = field(default_factory=dict)
    # the adapters its engine ran or had queued at its last health check, as the engine reports it
    adapters_running: list[str] = field(default_factory=list)


def version_of(built_from: Any) -> str:
    """A deployment's version: a digest of what its replicas are built from (their spec), so that an update
    restarts exactly the deployments whose spec changed, and `run` knows when every replica runs the new one."""
    return hashlib.sha256(json.dumps(built_from, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _prefix(app: str) -> bytes:
    return f"replicas/{app}/".encode()


def publish(record: ReplicaRecord) -> None:
    record.updated_at = time.time()
    record.seq += 1
    key = _prefix(record.app) + record.replica_id.encode()
    kv_put(key, json.dumps(asdict(record)).encode(), namespace=KV_NAMESPACE)


def withdraw(app: str, replica_id: str) -> None:
    kv_del(_prefix(app) + replica_id.encode(), namespace=KV_NAMESPACE)


def withdraw_stale(app: str, records: list[ReplicaRecord]) -> None:
    """Withdraw records a reader found stale (liveness.py). One its replica publishes again meanwhile comes back
    with that replica's next heartbeat."""
    for record in records:
        withdraw(app, record.replica_id)


def withdraw_all(app: str) -> None:
    """Remove every record of `app` (its stop, after the application is gone)."""
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        kv_del(key, namespace=KV_NAMESPACE)
    kv_del(_stopping_key(app), namespace=KV_NAMESPACE)


def _stopping_key(app: str) -> bytes:
    return f"stopping/{app}".encode()


def mark_stopping(app: str) -> None:
    """`stop` has drained the routers of `app` (they refuse new requests) and deletes it: its replicas need not
    wait for the routers to notice them gone. The mark holds no time (the replicas' hosts' clocks need not agree
    with this one's): the stop removes it when done (withdraw_all), and a deploy of `app` removes one a stop that
    died half-way left (clear_stopping), so it cannot speak for a later deployment of the same name."""
    kv_put(_stopping_key(app), b"stopping", namespace=KV_NAMESPACE)


def clear_stopping(app: str) -> None:
    kv_del(_stopping_key(app), namespace=KV_NAMESPACE)


def stopping(app: str) -> bool:
    return kv_get(_stopping_key(app), namespace=KV_NAMESPACE) is not None


def list_replicas(app: str) -> list[ReplicaRecord]:
    """Every record of `app` as stored: a reader that watches them over time drops stale ones (liveness.py)."""
    records = []
    for key in kv_list(_prefix(app), namespace=KV_NAMESPACE):
        raw = kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        records.append(ReplicaRecord(**json.loads(raw)))
    return records
