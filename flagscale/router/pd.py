"""Prefill/decode disaggregation, the router's part (docs/disaggregation.md): a disaggregated model's request
first goes to a prefill replica, which computes the prompt's KV cache and keeps it; its answer's
kv_transfer_params go with the request to a decode replica (failover.py), which pulls the KV and streams the
answer. Each prefill replica takes the prompt at most once; a 4xx is the client's and is passed on. After a prefill
engine died during the prompt (a dropped connection, or a 5xx the failover takes for an engine death) the prompt
goes to at most RETRIES_AFTER_ENGINE_DEATH more prefill replicas: it may be what kills them.

When no prefill replica is left to take the prompt (the pool is gone: none registered, every one refused or
failed it) while the model has decode replicas, the request goes on decode-only (DECODE_ONLY): a decode replica
computes the prompt itself, as a colocated engine would; counted (Counters.decode_only) and shown by `status`.

A prefill engine keeps the prompt's KV blocks until a decode engine pulls them (or its NIXL lease runs out,
kv_connector_extra_config.kv_lease_duration, 30 s in vLLM 0.32). A request that ends before any decode replica
answered it (the client hung up, no decode replica could take it) has the blocks released (`release`): the same
request with the same kv_transfer_params and one token, sent to a decode replica, which pulls them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from flagscale import engines
from flagscale.router.admission import AdmissionQueue, Overloaded, first_untried, overloaded_answer
from flagscale.router.client_request import HOP_BY_HOP, error_response
from flagscale.router.exchange import Exchange
from flagscale.router.peers import PeerLink
from flagscale.router.policies import Policy
from flagscale.router.replicas import Replicas, Upstream, engine_death
from flagscale.router.spec import RouterSpec
from flagscale.router.state import Clients, Counters
from flagscale.router.verdict import RETRIES_AFTER_ENGINE_DEATH, Verdict, judge

log = logging.getLogger("flagscale.router")

# What a prefill replica is asked for: compute the prompt's KV cache, keep it for a decode replica to pull.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


DECODE_ONLY = "decode-only"  # Prefill.kv_params: no prefill replica took the prompt; decode computes it itself
RELEASE_TIMEOUT_S = 60.0  # a release request's bound (it pulls the blocks and computes one token)


def prefill_body(payload: dict, kv: dict = REMOTE_DECODE) -> bytes:
    """The request as a prefill replica gets it: one token, not streamed, its KV kept for a decode replica (or,
    with a prefill's `kv`, as a decode replica gets it to release those blocks)."""
    body = {k: v for k, v in payload.items() if k != "stream_options"}
    body.update(stream=False, max_tokens=1, kv_transfer_params=kv)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


class PrefillFailed:
    """Why a prefill replica failed the prompt; `engine_died`: its engine is taken to have died meanwhile."""

    def __init__(self, reason: str, engine_died: bool = False) -> None:
        self.reason, self.engine_died = reason, engine_died


class Prefill:
    """The prefill step of the disaggregated models: `spec` gives the router's current spec; `replicas`, the
    prefill pools and their policies; `counters`, where moves are counted; `admission`, the queue for a replica's
    free slot; `clients`, the session prefill requests go through; `peers`, where routing hints go."""

    def __init__(
        self,
        spec: Callable[[], RouterSpec],
        replicas: Replicas,
        counters: Counters,
        admission: AdmissionQueue,
        clients: Clients,
        peers: PeerLink,
    ) -> None:
        self._spec, self._replicas, self._counters = spec, replicas, counters
        self._admission, self._clients, self._peers = admission, clients, peers
        self._releases: set[asyncio.Task] = set()  # (a task is kept until it ends)

    async def kv_params(self, exchange: Exchange, payload: dict):
        """A disaggregated model's first step: a prefill replica computes the prompt's KV cache and answers with
        the kv_transfer_params a decode replica pulls it with. Returns them, or the answer for the client: a
        prefill replica's 4xx as is, or why no prefill replica could take the prompt (each tried at most once)."""
        data = prefill_body(payload)
        policy = self._replicas.policy(exchange.model, prefill=True)
        pool = self._replicas.pool(exchange.model, prefill=True)
        tried: set[str] = set()
        failure = ""
        deaths = 0
        while True:
            try:
                upstream = await self._admission.admitted(
                    ("prefill", exchange.model), lambda: first_untried(policy, pool, exchange.info, tried), self._spec()
                )
            except Overloaded as exc:  # (nothing reached the client yet)
                return overloaded_answer(exchange.model, f"(prefill) {exc}")
            if upstream is None:
                reason = f"{failure}; " if failure else ""
                message = f"{reason}no prefill replica of {exchange.model!r} could take the prompt"
                if self._replicas.pool(exchange.model):
                    self._decode_only(exchange.model, message)
                    return DECODE_ONLY
                return error_response(503, message, "ServiceUnavailableError")
            name = f"prefill replica {upstream.record.replica_id} of {upstream.record.serve_id!r}"
            outcome = await self._ask(exchange, policy, upstream, name, data)
            if outcome is None:  # refused the connection: the next one takes the prompt
                continue
            if isinstance(outcome, PrefillFailed):  # nothing reached the client: the next prefill replica takes it
                failure = outcome.reason
                upstream.breaker.failure(time.monotonic())
                deaths += outcome.engine_died
                if deaths > RETRIES_AFTER_ENGINE_DEATH:
                    message = (
                        f"{failure}; an engine already died during this prompt before, and it may be what kills them"
                    )
                    log.warning("%s: not sent to another prefill replica", message)
                    return error_response(502, message + ": not sent to another prefill replica", "BadGatewayError")
                upstream.migrations += 1
                self._counters.moved += 1
                continue
            upstream.breaker.success()
            upstream.served += 1
            return self._kv_of(name, *outcome)

    def _decode_only(self, model: str, why: str) -> None:
        counters = self._counters
        counters.decode_only += 1
        if counters.decode_only == 1 or counters.decode_only % 100 == 0:  # (not a line per request)
            log.warning("%s: decoding without prefill (decode-only, %d so far)", why, counters.decode_only)

    def release(self, model: str, path: str, headers: dict, payload: dict, kv: dict) -> None:
        """The prefill's KV blocks `kv` that no decode replica took: a decode replica pulls them (in the background,
        bounded: the request that had them may be being cancelled)."""
        decodes = [u for u in self._replicas.pool(model) if u.breaker.allows(time.monotonic())]
        if not decodes:
            return  # (the prefill engine frees them when its lease runs out)
        upstream = min(decodes, key=lambda u: u.inflight)
        task = asyncio.get_running_loop().create_task(self._release(upstream, path, headers, prefill_body(payload, kv)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, upstream: Upstream, path: str, headers: dict, data: bytes) -> None:
        timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_S)
        try:
            async with self._clients.session.post(
                upstream.record.url + path, data=data, headers=headers, timeout=timeout
            ) as resp:
                await resp.read()
            self._counters.kv_released += 1
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.warning("releasing a prefill's KV blocks through %s failed: %r", upstream.record.url, exc)

    async def _ask(self, exchange: Exchange, policy: Policy, upstream: Upstream, name: str, data: bytes):
        """One prefill replica's answer: (response, body) when it answered below 500; None when it refused the
        connection (its circuit tripped); else why it failed (PrefillFailed: a 5xx, a broken connection)."""
        ok = None
        failure = None
        policy.before_request(upstream, exchange.info)
        self._peers.send_hint("prefill", exchange.model, upstream, exchange.info)
        upstream.inflight += 1
        upstream.sent += 1
        try:
            url = upstream.record.url + exchange.http.path
            # (bounded: the session's read timeout, deploy.upstream_first_byte_timeout_s)
            async with self._clients.session.post(url, data=data, headers=exchange.headers) as resp:
                answer = await resp.read()
            marker = engines.get(upstream.record.engine).dead_engine_marker
            verdict = judge(resp.status, True, answer, marker)  # (a prefill request always runs the model)
            ok = verdict is Verdict.OK
            if not ok:
                failure = PrefillFailed(f"{name} answered {resp.status}")
        except aiohttp.ClientConnectorError:
            ok = False
            upstream.breaker.trip(time.monotonic())
            return None
        except aiohttp.ClientError as exc:
            ok = False
            failure = PrefillFailed(f"{name} failed ({exc!r})", engine_died=True)
        finally:
            upstream.inflight -= 1
            self._admission.slot_freed(upstream)
            if ok is None:  # cancelled before it answered: another request may probe
                upstream.breaker.release()
            policy.after_request(upstream, exchange.info, bool(ok))
        if ok:
            return resp, answer
        if not failure.engine_died:
            death = await engine_death(self._clients.session, upstream, verdict)
            if death:
                upstream.breaker.trip(time.monotonic())
                log.warning("%s answered %d and %s", name, resp.status, death)
                failure = PrefillFailed(f"{failure.reason} ({death})", engine_died=True)
        return failure

    @staticmethod
    def _kv_of(name: str, resp: aiohttp.ClientResponse, answer: bytes):
        """The kv_transfer_params of a prefill replica's answer, or the answer for the client."""
        if resp.status >= 400:  # the client's problem: it would fail on decode too
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
            return web.Response(status=resp.status, body=answer, headers=headers)
        try:
            kv = json.loads(answer).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not kv:
            return error_response(502, f"{name} answered without kv_transfer_params", "BadGatewayError")
        return kv
