"""What the router's parts share besides the replicas (replicas.py): the process's counters and its HTTP clients to
the replicas. Router (router.py) makes one of each and hands each part the ones it uses."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from flagscale.router.upstream_http import UpstreamClient


@dataclass
class Counters:
    """This router process's counts, as its `stats` report them."""

    inflight: int = 0  # client requests being served (the graph route's included)
    moved: int = 0  # requests moved to another replica after theirs failed them
    resumed: int = 0  # of them, streams resumed mid-way
    decode_only: int = 0  # disaggregated requests no prefill replica took: decoded without prefill (pd.py)
    kv_released: int = 0  # prefills' KV blocks no decode replica took, released by the router (pd.py)
    draining: bool = False  # refusing new requests (stop, or another process of the deployment asked)


@dataclass
class Clients:
    """The router's clients to the replicas: `relay` (upstream_http) for the requests it relays, `session`
    (aiohttp's) for its own calls: health probes, /metrics, /v1/models, prefill. The session is made on the
    router's event loop when it starts (router.upstream_session)."""

    relay: UpstreamClient
    session: aiohttp.ClientSession | None = None
