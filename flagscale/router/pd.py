"""Prefill/decode disaggregation, the router's part (docs/disaggregation.md): a disaggregated model's request
first goes to a prefill replica, which computes the prompt's KV cache and keeps it; its answer's
kv_transfer_params go with the request to a decode replica (failover.py), which pulls the KV and streams the
answer. Each prefill replica takes the prompt at most once; a 4xx is the client's and is passed on. After a prefill
engine died during the prompt (a dropped connection, or a 5xx the failover takes for an engine death) the prompt
goes to at most RETRIES_AFTER_ENGINE_DEATH more prefill replicas: it may be what kills them."""

from __future__ import annotations

import json
import logging
import time

import aiohttp
from aiohttp import web

from flagscale.router.admission import Overloaded, first_untried
from flagscale.router.client_request import HOP_BY_HOP, error_response
from flagscale.router.exchange import Exchange
from flagscale.router.failover import RETRIES_AFTER_ENGINE_DEATH
from flagscale.router.replicas import Upstream

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


def prefill_body(payload: dict) -> bytes:
    """The request as a prefill replica gets it: one token, not streamed, its KV kept for a decode replica."""
    body = {k: v for k, v in payload.items() if k != "stream_options"}
    body.update(stream=False, max_tokens=1, kv_transfer_params=REMOTE_DECODE)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


class PrefillFailed:
    """Why a prefill replica failed the prompt; `engine_died`: its engine is taken to have died meanwhile."""

    def __init__(self, reason: str, engine_died: bool = False) -> None:
        self.reason, self.engine_died = reason, engine_died


class Prefill:
    """The prefill step of `router`'s disaggregated models (the Router of flagscale/router/router.py: its
    prefill pools, their policies, its admission queue and aiohttp session)."""

    def __init__(self, router) -> None:
        self.router = router

    async def kv_params(self, exchange: Exchange, payload: dict):
        """A disaggregated model's first step: a prefill replica computes the prompt's KV cache and answers with
        the kv_transfer_params a decode replica pulls it with. Returns them, or the answer for the client: a
        prefill replica's 4xx as is, or why no prefill replica could take the prompt (each tried at most once)."""
        router = self.router
        data = prefill_body(payload)
        policy = router.prefill_policies[exchange.model]
        pool = router.table.prefill_by_model.get(exchange.model, [])
        tried: set[str] = set()
        failure = ""
        deaths = 0
        while True:
            try:
                upstream = await router.admission.admitted(
                    ("prefill", exchange.model), lambda: first_untried(policy, pool, exchange.info, tried), router.spec
                )
            except Overloaded as exc:
                return await router.failover.overloaded(exchange, f"(prefill) {exc}")
            if upstream is None:
                reason = f"{failure}; " if failure else ""
                message = f"{reason}no prefill replica of {exchange.model!r} could take the prompt"
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
                router.moved += 1
                continue
            upstream.breaker.success()
            upstream.served += 1
            return self._kv_of(name, *outcome)

    async def _ask(self, exchange: Exchange, policy, upstream: Upstream, name: str, data: bytes):
        """One prefill replica's answer: (response, body) when it answered below 500; None when it refused the
        connection (its circuit tripped); else why it failed (PrefillFailed: a 5xx, a broken connection)."""
        ok = None
        failure = None
        policy.before_request(upstream, exchange.info)
        self.router.peers.send_hint("prefill", exchange.model, upstream, exchange.info)
        upstream.inflight += 1
        upstream.sent += 1
        try:
            url = upstream.record.url + exchange.http.path
            async with self.router.session.post(url, data=data, headers=exchange.headers) as resp:
                answer = await resp.read()
            ok = resp.status < 500
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
            self.router.admission.slot_freed(upstream)
            if ok is None and upstream.breaker.probing:
                upstream.breaker.probing = False
            policy.after_request(upstream, exchange.info, bool(ok))
        if ok:
            return resp, answer
        if not failure.engine_died:
            death = await self.router.failover.engine_death(upstream, answer)
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
