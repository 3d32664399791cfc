"""The engine replicas as the router sees them: one Upstream per replica (its load, its circuit breaker), the
table of them by model and pool as last read from the registry, and the /health probe that readmits a replica
whose circuit cool-down is over."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from flagscale.config.routing import DEFAULT_MAX_ONGOING_REQUESTS
from flagscale.replica import registry
from flagscale.router.circuit_breaker import CircuitBreaker
from flagscale.router.policies import Policy

HEALTH_PROBE_TIMEOUT_S = 2.0


@dataclass
class Upstream:
    """One engine replica as the router sees it."""

    record: registry.ReplicaRecord
    inflight: int = 0
    sent: int = 0  # requests routed here, counted when picked (served only counts once headers are back)
    served: int = 0
    migrations: int = 0  # requests that failed here and moved to another replica
    max_ongoing: int = DEFAULT_MAX_ONGOING_REQUESTS  # its deployment's max_ongoing_requests: more wait in the router
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def replica_id(self) -> str:
        return self.record.replica_id


@dataclass
class ReplicaTable:
    by_model: dict[str, list[Upstream]] = field(default_factory=dict)  # replicas that answer (colocated or decode)
    prefill_by_model: dict[str, list[Upstream]] = field(default_factory=dict)  # prefill pools
    by_replica: dict[str, Upstream] = field(default_factory=dict)

    @classmethod
    def of(cls, records: list[registry.ReplicaRecord], old: ReplicaTable) -> ReplicaTable:
        """The table of the registry's records, keeping the Upstream (load, circuit) of a replica still at its URL."""
        table = cls()
        for record in records:
            upstream = old.by_replica.get(record.replica_id)
            if upstream is None or upstream.record.url != record.url:
                upstream = Upstream(record)
            else:
                upstream.record = record
            upstream.breaker.heartbeat(record.updated_at)
            table.by_replica[record.replica_id] = upstream
            pools = table.prefill_by_model if record.role == "prefill" else table.by_model
            for model in record.models:
                pools.setdefault(model, []).append(upstream)
        return table


def tell_policies(policies: dict[str, Policy], old: dict[str, list[Upstream]], new: dict[str, list[Upstream]]) -> None:
    """Tell each model's policy which replicas left and joined (a replica at a new URL: both)."""
    for model, policy in policies.items():
        before = {id(u): u for u in old.get(model, [])}
        after = {id(u): u for u in new.get(model, [])}
        for key in before.keys() - after.keys():
            policy.on_replica_left(before[key].replica_id)
        for key in after.keys() - before.keys():
            policy.on_replica_joined(after[key])


async def probe_half_open(upstreams: list[Upstream], session: aiohttp.ClientSession) -> None:
    """Replicas whose circuit cool-down is over get one /health probe, so an idle router readmits them too."""
    now = time.monotonic()
    probes = [u for u in upstreams if u.breaker.state(now) == "half_open"]
    if probes:
        await asyncio.gather(*(_probe(u, session) for u in probes))


async def _probe(upstream: Upstream, session: aiohttp.ClientSession) -> None:
    if not upstream.breaker.begin(time.monotonic()):
        return
    try:
        timeout = aiohttp.ClientTimeout(total=HEALTH_PROBE_TIMEOUT_S)
        async with session.get(upstream.record.url + "/health", timeout=timeout) as resp:
            healthy = resp.status == 200
    except Exception:
        healthy = False
    if healthy:
        upstream.breaker.success()
    else:
        upstream.breaker.failure(time.monotonic())
