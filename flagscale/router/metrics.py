"""The deployment's Prometheus metrics on the endpoint's `/metrics` (docs/operations.md).

Every engine replica's own `/metrics` is scraped (in parallel, each bounded in time) and its samples get the
replica's labels (serve_id, replica, role, host); samples of one metric family from all replicas are written
together under one HELP/TYPE header, as the exposition format requires. The router's own series follow under
`flagscale_router_`, from prometheus_client. A replica that does not answer in time is left out and counted in
`flagscale_router_metrics_scrape_failures_total`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SCRAPE_TIMEOUT_S = 3.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


class RouterMetrics:
    """The router's own series (one registry per router)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "flagscale_router_requests", "Requests answered, by model and HTTP status.", ["model", "status"], registry=r
        )
        self.inflight = Gauge("flagscale_router_inflight_requests", "Requests being served.", registry=r)
        self.ttft = Histogram(
            "flagscale_router_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of its answer sent to the client.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "flagscale_router_request_duration_seconds",
            "From the request's arrival to the end of its answer.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.bytes = Counter(
            "flagscale_router_response_bytes", "Bytes of answers relayed to clients.", ["model"], registry=r
        )
        self.moved = Counter(
            "flagscale_router_requests_moved",
            "Requests a replica failed that moved to another replica (docs/routing.md).",
            ["model"],
            registry=r,
        )
        self.resumed = Counter(
            "flagscale_router_streams_resumed", "Streams resumed on another replica mid-way.", ["model"], registry=r
        )
        self.tokens = Counter(
            "flagscale_router_streamed_tokens",
            "Tokens streamed to clients (completions and chat streams the router tracks; a LoRA adapter: its name).",
            ["model"],
            registry=r,
        )
        self.key_refusals = Counter(
            "flagscale_router_engine_key_refusals",
            "Answers in which an engine replica refused the router's engine key (401): never passed on, the request "
            "moved to another replica.",
            ["model"],
            registry=r,
        )
        self.scrape_failures = Counter(
            "flagscale_router_metrics_scrape_failures",
            "Engine replicas whose /metrics did not answer in time for a scrape of the endpoint's /metrics.",
            registry=r,
        )
        self._add_wake_series(r)
        self._add_kv_series(r)

    def _add_wake_series(self, r: CollectorRegistry) -> None:
        """Sleeping replicas woken for requests (router/wake.py)."""
        self.wakes = Counter(
            "flagscale_router_replica_wakes", "Sleeping replicas woken for a request.", ["model"], registry=r
        )
        self.wake_failures = Counter(
            "flagscale_router_replica_wake_failures",
            "Sleeping replicas that could not be woken.",
            ["model"],
            registry=r,
        )
        self.wake_seconds = Histogram(
            "flagscale_router_replica_wake_seconds",
            "From asking a sleeping replica to wake to its engine awake.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def _add_kv_series(self, r: CollectorRegistry) -> None:
        """The KV-event index that cache_aware routes on (router/kv_events.py)."""
        self.kv_predicted_hits = Counter(
            "flagscale_router_kv_predicted_hit_tokens",
            "Prompt tokens the router predicted each replica's engine would find in its prefix cache, from the "
            "engines' KV events (beside the engine's own prefix-cache hit counter of the same replica).",
            ["model", "replica"],
            registry=r,
        )
        self.kv_last_seq = Gauge(
            "flagscale_router_kv_last_sequence",
            "The last KV-event batch of each replica's engine this router process applied to its index.",
            ["replica"],
            registry=r,
        )
        self.kv_fallbacks = Counter(
            "flagscale_router_kv_fallbacks",
            "Requests of models routed on KV events that went by the approximate table instead, by why.",
            ["model", "reason"],
            registry=r,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class _Family:
    comments: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)


def _family_of(name: str, families: dict[str, _Family]) -> str:
    """The family a sample belongs to: its own name, or the histogram/summary/counter base it extends."""
    if name in families:
        return name
    for suffix in ("_bucket", "_sum", "_count", "_created", "_total", "_info"):
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merge_replica_metrics(scrapes: list[tuple[dict[str, str], str]]) -> str:
    """Several replicas' exposition texts -> one, each sample labelled with its replica's `labels`."""
    families: dict[str, _Family] = {}
    for labels, text in scrapes:
        extra = ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items())
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = families.setdefault(parts[2], _Family())
                    if not any(c.split(None, 2)[1] == parts[1] for c in family.comments):
                        family.comments.append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, existing, rest = match.groups()
            if existing and existing != "{}":
                labelled = f"{name}{{{existing[1:-1].rstrip(',')},{extra}}}{rest}"
            else:
                labelled = f"{name}{{{extra}}}{rest}"
            families.setdefault(_family_of(name, families), _Family()).samples.append(labelled)
    out = []
    for family in families.values():
        out.extend(family.comments)
        out.extend(family.samples)
    return "\n".join(out) + "\n"
