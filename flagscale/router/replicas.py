"""The engine replicas as the router sees them: one Upstream per replica (its load, its circuit breaker), the
table of them by model and pool as last read from the registry, the routing policies over them (Replicas), and
the health probes: the one that readmits a replica whose circuit cool-down is over, and the one that tells
whether a replica that failed a request lost its engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

import aiohttp

from flagscale import engines
from flagscale.config.routing import DEFAULT_MAX_ONGOING_REQUESTS
from flagscale.replica import registry
from flagscale.replica.liveness import Liveness
from flagscale.router.circuit_breaker import CircuitBreaker, CircuitState
from flagscale.router.kv_events import KVEvents
from flagscale.router.policies import Policy
from flagscale.router.state import Clients
from flagscale.router.verdict import Verdict

log = logging.getLogger("flagscale.router")

HEALTH_PROBE_TIMEOUT_S = 2.0
DEATH_PROBE_TIMEOUT_S = 2.0  # after a 5xx, the replica's health check that tells whether its engine died
# A replica silent this long on an answer being relayed gets a health check (FROZEN_PROBE_TIMEOUT_S to answer): a
# frozen process (SIGSTOP, a lost host) is given up on in seconds, while a long prefill goes on (its server answers).
QUIET_PROBE_S = 5.0
FROZEN_PROBE_TIMEOUT_S = 5.0


def devices_of(record: registry.ReplicaRecord) -> frozenset[str]:
    """The devices a replica computes on (policies.base.Replica.devices): its GPUs (or its family's devices), else
    the CPU cores its engine's workers are pinned to; none known when it has neither or no host id."""
    host = record.node_id or record.node_ip
    if not host:
        return frozenset()
    if record.gpus:
        return frozenset(f"{host}/{record.family or 'gpu'}:{gpu}" for gpu in record.gpus)
    return frozenset(f"{host}/cpu:{core}" for core in record.worker_cpus)


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
    woken: int = -1  # the sleep of the replica (record.sleeps) this router woke it from (router/wake.py)
    # prompt characters of this router's requests here that have no first byte yet, less what was cached for them
    # (cache_aware's balance_by prefill: the prefill queued before a new request's first token), over all its models
    prefill_chars: float = 0.0
    _devices: tuple = field(default=(None, frozenset()), repr=False)  # (the record they are of, devices_of it)

    @property
    def replica_id(self) -> str:
        return self.record.replica_id

    @property
    def devices(self) -> frozenset[str]:
        if self._devices[0] is not self.record:
            self._devices = (self.record, devices_of(self.record))
        return self._devices[1]


@dataclass
class ReplicaTable:
    by_model: dict[str, list[Upstream]] = field(default_factory=dict)  # replicas that answer (colocated or decode)
    prefill_by_model: dict[str, list[Upstream]] = field(default_factory=dict)  # prefill pools
    by_replica: dict[str, Upstream] = field(default_factory=dict)

    @classmethod
    def of(cls, records: list[registry.ReplicaRecord], old: ReplicaTable, read_began: float = 0.0) -> ReplicaTable:
        """The table of the registry's records (read in a read that began at `read_began`, monotonic), keeping the
        Upstream (load, circuit) of a replica still at its URL."""
        table = cls()
        for record in records:
            upstream = old.by_replica.get(record.replica_id)
            if upstream is None or upstream.record.url != record.url:
                upstream = Upstream(record)
            else:
                upstream.record = record
            upstream.breaker.heartbeat(record.seq, read_began)
            table.by_replica[record.replica_id] = upstream
            pools = table.prefill_by_model if record.role == "prefill" else table.by_model
            for model in record.models:
                pools.setdefault(model, []).append(upstream)
        return table


class Replicas:
    """The replica table as last read (`table`: replaced whole on each refresh) and each model's routing policy,
    one per pool: `policies` over the replicas that answer, `prefill_policies` over the prefill replicas of a
    disaggregated model. What the router's parts look replicas and policies up in."""

    def __init__(self, policies: dict[str, Policy], prefill_policies: dict[str, Policy]) -> None:
        self.table = ReplicaTable()
        self.policies = policies
        self.prefill_policies = prefill_policies
        self.kv_events = KVEvents()  # the engines' own KV events, for the policies that route on them
        self.liveness = Liveness(registry.STALE_AFTER_S)  # the records' heartbeats, by this process's clock

    def pool(self, model: str, prefill: bool = False) -> list[Upstream]:
        """The replicas of `model` that answer, or (`prefill`) its prefill replicas."""
        return (self.table.prefill_by_model if prefill else self.table.by_model).get(model, [])

    def policy(self, model: str, prefill: bool = False) -> Policy | None:
        return (self.prefill_policies if prefill else self.policies).get(model)

    def disaggregated(self, model: str) -> bool:
        """Does `model` have a prefill pool (its requests are prefilled first: pd.py)?"""
        return model in self.prefill_policies

    def missing(
        self, models: Iterable[str], at_zero: Container[str] = (), prefill_at_zero: Container[str] = ()
    ) -> list[str]:
        """Which of `models` (and of the disaggregated models' prefill pools) have no replica now, but those that
        may be at zero (`at_zero`, `prefill_at_zero`: they start one on their next request)."""
        missing = [m for m in models if not self.table.by_model.get(m)]
        return [m for m in missing if m not in at_zero] + [
            f"{m} (prefill{'' if m in missing else '; decoding without it'})"
            for m in self.prefill_policies
            if not self.table.prefill_by_model.get(m) and m not in prefill_at_zero
        ]

    def update(
        self, records: list[registry.ReplicaRecord], max_ongoing: Callable[[Upstream], int], read_began: float = 0.0
    ) -> list[registry.ReplicaRecord]:
        """The registry's records read again (a read that began at `read_began`, monotonic): the new table of the
        records not stale (liveness.py), each replica's limit, the policies told who came and went. Returns the
        stale records (the router withdraws them from the registry)."""
        records, stale = self.liveness.split(records, lambda r: r.replica_id)
        old = self.table
        self.table = table = ReplicaTable.of(records, old, read_began)
        for upstream in table.by_replica.values():
            upstream.max_ongoing = max_ongoing(upstream)
        tell_policies(self.policies, old.by_model, table.by_model)
        tell_policies(self.prefill_policies, old.prefill_by_model, table.prefill_by_model)
        self.kv_events.sync(
            {m: [u.record for u in ups] for m, ups in table.by_model.items()},
            self.policies,
            ({m: [u.record for u in ups] for m, ups in table.prefill_by_model.items()}, self.prefill_policies),
        )
        return stale

    def stats(self) -> dict[str, dict]:
        """Per replica: served, in flight, circuit, moves, and its policy's table (Router.stats)."""
        counts: dict[str, dict] = {}
        for upstream in self.table.by_replica.values():
            entry = {
                "serve_id": upstream.record.serve_id,
                "url": upstream.record.url,
                "served": upstream.served,
                "inflight": upstream.inflight,
                "prefill_queue_chars": round(upstream.prefill_chars),
                "circuit": upstream.breaker.state().value,
                "circuit_opened": upstream.breaker.opened,
                "migrations": upstream.migrations,
                "heartbeat_age_s": round(self.liveness.age(upstream.replica_id) or 0.0, 1),
            }
            for model in upstream.record.models:
                policy = self.policy(model, prefill=upstream.record.role == "prefill")
                if policy is not None:
                    entry["routing"] = policy.name
                    entry.update(policy.stats(upstream.replica_id))
            counts[upstream.record.replica_id] = entry
        return counts


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
    probes = [u for u in upstreams if u.breaker.state(now) is CircuitState.HALF_OPEN]
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


async def engine_death(session: aiohttp.ClientSession, upstream: Upstream, verdict: Verdict) -> str:
    """Why a replica whose answer was judged FAILED or ENGINE_DIED (verdict.judge) is taken to have lost its
    engine (its answer was the engine kind's engine-dead error, or its health check fails right after), or ""
    when it still looks alive."""
    if verdict is Verdict.ENGINE_DIED:
        return "its engine died (the engine-dead error)"
    url = upstream.record.url + engines.get(upstream.record.engine).health_path
    timeout = aiohttp.ClientTimeout(total=DEATH_PROBE_TIMEOUT_S)
    try:
        async with session.get(url, timeout=timeout) as resp:
            healthy = resp.status < 500
    except (TimeoutError, aiohttp.ClientError):
        healthy = False
    return "" if healthy else "its engine died (its health check failed right after)"


async def give_up_on_frozen(table: ReplicaTable, clients: Clients) -> None:
    """Replicas silent for QUIET_PROBE_S on an answer being relayed: one the registry no longer has, or whose
    health check does not answer within FROZEN_PROBE_TIMEOUT_S, is given up on: every answer being relayed from
    it fails (upstream_http.Stalled), so its requests move to other replicas and its streams resume there, and
    its circuit opens."""
    relay = clients.relay
    quiet = relay.watch.quiet_replicas(QUIET_PROBE_S)
    if not quiet:
        return
    known = {relay.address(u.record.url): u for u in table.by_replica.values()}

    async def check(key: tuple[str, int]) -> None:
        upstream = known.get(key)
        if upstream is None:
            reason = f"was withdrawn from the registry and sent nothing for {QUIET_PROBE_S:g} s"
        else:
            url = upstream.record.url + engines.get(upstream.record.engine).health_path
            try:
                timeout = aiohttp.ClientTimeout(total=FROZEN_PROBE_TIMEOUT_S)
                async with clients.session.get(url, timeout=timeout) as resp:
                    await resp.read()
                return  # its server answers: busy (a long prefill), not frozen
            except (TimeoutError, aiohttp.ClientError):
                pass
            upstream.breaker.trip(time.monotonic())
            reason = f"sent nothing for {QUIET_PROBE_S:g} s and its health check did not answer"
        given_up = relay.watch.give_up(key, reason)
        if given_up:
            log.warning("the replica at %s:%d %s: %d of its answers given up", *key, reason, given_up)

    await asyncio.gather(*(check(key) for key in quiet))
