"""Carrying a request across replicas, and every retry decision (docs/routing.md): the policy's replicas in turn
until one answers, each at most once and at most `max_migrations` moves after a failure.

- a refused connection (nothing was sent; not counted as a move): the next replica, its circuit tripped;
- a dropped connection or a 5xx before the client got anything: sent again as it was; a replica gone silent
  (upstream_watch.py, replicas.give_up_on_frozen) counts as a dropped connection, its circuit opened;
- a completions or chat stream broken off part-way: resumed from the tokens the client has (resume.py), or
  finished when every token is there, else ended with an error event;
- a 4xx is the client's problem: passed on, the replica not counted as failing; but a 401, which refused the
  router's engine key (the client's key never reaches an engine), is the replica's: never passed on, it counts
  against the replica and the request moves on as after a 5xx;
- a 5xx on a path where the engine does not run the model (EngineKind.inference_paths: /tokenize, /version, a
  stored response, ...): passed on as it is, the replica neither counted as failing nor passed over.

What an answer says of the replica is verdict.py's pure rule. After an engine dies during a request (dropped
connection, stream broken off, a 5xx saying the engine is dead, or a 5xx after which the replica's health check
fails) the request goes to at most RETRIES_AFTER_ENGINE_DEATH more replicas: it may be what killed the engine.
That is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from aiohttp import web

from flagscale import engines
from flagscale.router.admission import AdmissionQueue, Overloaded, first_untried, overloaded_answer, overloaded_message
from flagscale.router.client_request import HOP_BY_HOP, error_response
from flagscale.router.cold_start import ColdStart
from flagscale.router.exchange import Exchange
from flagscale.router.kv_ranks import with_headers
from flagscale.router.pd import DECODE_ONLY, Prefill
from flagscale.router.peers import PeerLink
from flagscale.router.replicas import Replicas, Upstream, engine_death
from flagscale.router.resume import CHAT, COMPLETIONS, error_event
from flagscale.router.spec import RouterSpec
from flagscale.router.state import Clients, Counters
from flagscale.router.upstream_http import Answer, ConnectFailed, Disconnected, Stalled
from flagscale.router.verdict import RETRIES_AFTER_ENGINE_DEATH, Verdict, judge
from flagscale.router.wake import WakeFailed, Waker, prefer_awake

log = logging.getLogger("flagscale.router")


class Unreachable(Exception):
    """The replica could not be connected to: nothing was sent."""


class Failed(Exception):
    """The replica had the request and failed it before the client got its answer, or mid-stream where the
    stream can go on elsewhere: another replica may take it over. `engine_died`: the connection broke off (the
    engine's process is likely gone), as opposed to a 5xx answer."""

    def __init__(self, reason: str, engine_died: bool = False):
        super().__init__(reason)
        self.engine_died = engine_died


class _Attempt:
    """One replica's go at a request, and what its answer says of the replica: `ok` True, False, or None
    (unknown: nothing recorded)."""

    __slots__ = ("upstream", "name", "ok")

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.name = f"replica {upstream.record.replica_id} of {upstream.record.serve_id!r}"
        self.ok: bool | None = None

    def failed(self, error: Exception | None = None) -> None:
        """The replica failed the request; one that went silent (Stalled) has its circuit opened at once."""
        self.ok = False
        if isinstance(error, Stalled):
            self.upstream.breaker.trip(time.monotonic())
        else:
            self.upstream.breaker.failure(time.monotonic())


class Failover:
    """The request path after admission checks: prefill (disaggregated models), then the replicas in turn.

    `spec`: the router's current spec; `replicas`: the table and policies; `counters`: moves and resumes counted;
    `admission`: the queue for a free slot; `clients`: connections to the replicas; `peers`: routing hints; `prefill`:
    the prefill step; `refresh`: a registry read now; `waker`: sleeping replicas and awake targets (wake.py)."""

    def __init__(
        self,
        spec: Callable[[], RouterSpec],
        replicas: Replicas,
        counters: Counters,
        admission: AdmissionQueue,
        clients: Clients,
        peers: PeerLink,
        prefill: Prefill,
        refresh: Callable[[], Awaitable[None]],
        waker: Waker,
    ) -> None:
        self._spec, self._replicas, self._counters = spec, replicas, counters
        self._admission, self._clients, self._peers = admission, clients, peers
        self._prefill, self._refresh, self._waker = prefill, refresh, waker
        self.cold_start: ColdStart | None = None  # the Router's, where it has engine handles (scale from zero)

    async def route(self, exchange: Exchange, payload: dict) -> web.StreamResponse:
        """Prefill (disaggregated models), then replicas in the policy's order until one answers, bounded."""
        model, request = exchange.model, exchange.http
        if self._replicas.disaggregated(model) and request.method == "POST" and request.path in (COMPLETIONS, CHAT):
            # a disaggregated model's pools at zero replicas (cold_start.py): wait for its decode pool before prefill
            if self.cold_start and await self.cold_start.waits_for_pools(self._spec(), model, self._replicas):
                refused = await self._hold(exchange) if self._scales_from_zero(exchange) else None
                if refused is not None:
                    return refused
            kv = await self._prefill.kv_params(exchange, payload)
            if kv is DECODE_ONLY:  # no prefill replica took it: a decode replica computes the prompt itself
                pass
            elif not isinstance(kv, dict):
                return kv  # the prefill pool's answer (a 4xx) or why none could take the prompt
            else:
                exchange.with_kv(payload, kv)
        try:
            return await self._replicas_in_turn(exchange)
        finally:
            if exchange.kv_pending is not None:  # no decode replica answered (the client hung up, none could)
                self._prefill.release(model, request.path, exchange.headers, payload, exchange.kv_pending)

    async def _replicas_in_turn(self, exchange: Exchange) -> web.StreamResponse:
        model = exchange.model
        held = False
        while True:
            try:
                upstream = await self._admission.admitted(("serve", model), lambda: self._pick(exchange), self._spec())
            except Overloaded as exc:
                return await self._overloaded(exchange, str(exc))
            if upstream is None:
                if not exchange.refreshed:  # none left to try: one may have joined since the last refresh
                    exchange.refreshed = True
                    await self._refresh()
                    continue
                if not held and self._scales_from_zero(exchange):
                    held = True
                    refused = await self._hold(exchange)
                    if refused is None:
                        continue
                    return refused
                return await self._give_up(exchange)
            try:
                return await self.forward(exchange, upstream)
            except Unreachable:  # nothing was sent: the next replica may take it
                upstream.breaker.trip(time.monotonic())
                exchange.unreachable += 1
            except Failed as exc:  # the replica failed the request: another one takes it over, bounded
                if not self._moves_on(exchange, exc):
                    return await self._give_up(exchange)
                upstream.migrations += 1
                self._counters.moved += 1

    def _scales_from_zero(self, exchange: Exchange) -> bool:
        """A request no replica has seen, for a model whose node is at zero replicas and may start one."""
        fresh = exchange.response is None and exchange.last_answer is None
        fresh = fresh and not exchange.failure and not exchange.unreachable
        return self.cold_start is not None and fresh and exchange.model in self._spec().scale_from_zero

    async def _hold(self, exchange: Exchange) -> web.StreamResponse | None:
        return await self.cold_start.hold_for(self._spec(), exchange.model, self._replicas, self._refresh)

    def _moves_on(self, exchange: Exchange, failure: Failed) -> bool:
        """May the request a replica failed go to another one? (Counts the move.)"""
        exchange.failure = str(failure)
        if failure.engine_died:
            exchange.engine_deaths += 1
            if exchange.engine_deaths > RETRIES_AFTER_ENGINE_DEATH:
                exchange.failure += (
                    "; an engine already died during this request before, and the request may be what "
                    "kills them: it is not sent to another replica"
                )
                log.warning("%s", exchange.failure)
                return False
        if exchange.moves >= exchange.max_moves:
            return False
        exchange.moves += 1
        exchange.without_kv()  # another decode replica computes the prompt itself
        log.warning(
            "%s; moving the request to another replica (%d of at most %d)", failure, exchange.moves, exchange.max_moves
        )
        return True

    def _pick(self, exchange: Exchange) -> Upstream | str | None:
        upstreams = self._replicas.pool(exchange.model)
        if exchange.stream is not None and exchange.stream.sent_events:  # goes on only where the same model makes it
            same = [u for u in upstreams if u.record.fingerprint == exchange.fingerprint]
            exchange.other_versions |= any(u.replica_id not in exchange.tried for u in upstreams if u not in same)
            upstreams = same
        pick = partial(first_untried, exchange.policy, info=exchange.info, tried=exchange.tried)
        return prefer_awake(pick, upstreams, self._waker.targets.of(upstreams))

    async def _overloaded(self, exchange: Exchange, reason: str) -> web.StreamResponse:
        """503 with Retry-After (a stream already begun, waiting to go on elsewhere: a closing error event)."""
        if exchange.response is not None:
            exchange.failure = overloaded_message(exchange.model, reason)
            return await self._give_up(exchange)
        return overloaded_answer(exchange.model, reason)

    async def _give_up(self, exchange: Exchange) -> web.StreamResponse:
        """No replica is left to try: the last answer, an error, or (stream begun) a closing error event."""
        model = exchange.model
        if exchange.response is not None:
            message = f"{exchange.failure}; no other replica of {model!r} could take the stream over"
            if exchange.other_versions:
                message += (
                    " (the others run another version of it, after an update: the stream does not go on there, so"
                    " that one answer is not made by two models)"
                )
            await exchange.write(error_event(message))
            await exchange.response.write_eof()
            return exchange.response
        if exchange.last_answer is not None:
            return exchange.last_answer
        if exchange.failure:
            message = f"{exchange.failure}; no other replica of {model!r} could take it"
            return error_response(502, message, "BadGatewayError")
        if exchange.unreachable:
            return error_response(503, f"no replica of {model!r} could be reached", "ServiceUnavailableError")
        return error_response(503, f"no ready replica for model {model!r}", "ServiceUnavailableError")

    # ---- one replica ----------------------------------------------------------------------------------

    async def forward(self, exchange: Exchange, upstream: Upstream) -> web.StreamResponse:
        """Send the request to one replica and relay its answer. Raises Unreachable (nothing was sent) or
        Failed (the replica failed before the client got its answer, or mid-stream where the stream can go
        on elsewhere); a stream that cannot go on ends with an error event."""
        stream = exchange.stream
        if stream is not None and stream.sent_events:
            path, data = stream.resume_request()
        else:
            path = exchange.target
            data = stream.first_request(exchange.body) if stream is not None else exchange.body
        attempt = _Attempt(upstream)
        exchange.info.upstream_headers = {}  # (what the policy asks of this replica, below)
        exchange.policy.before_request(upstream, exchange.info)
        self._peers.send_hint("serve", exchange.model, upstream, exchange.info)
        upstream.inflight += 1
        upstream.sent += 1
        answer = None
        try:
            try:
                await self._waker.ready(upstream)
            except WakeFailed as exc:
                attempt.ok = False  # the caller trips the circuit
                raise Unreachable(str(exc)) from None
            answer = await self._send(exchange, attempt, path, data)
            exchange.kv_pending = None  # a decode replica has the request: its engine pulls or frees the KV
            headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
            if not attempt.ok or "text/event-stream" not in answer.headers.get("Content-Type", ""):
                return await self._whole_answer(exchange, attempt, answer, headers)
            return await self._relay_stream(exchange, attempt, answer, headers)
        finally:
            if answer is not None:
                answer.close()
            upstream.inflight -= 1
            self._admission.slot_freed(upstream)
            if attempt.ok is None:  # cancelled before it answered: another request may probe
                upstream.breaker.release()
            exchange.policy.after_request(upstream, exchange.info, bool(attempt.ok))

    async def _send(self, exchange: Exchange, attempt: _Attempt, path: str, data: bytes) -> Answer:
        """The replica's answer, its head in; its status recorded in the replica's circuit breaker."""
        upstream = attempt.upstream
        try:
            answer = await self._clients.relay.request(
                exchange.http.method,
                upstream.record.url + path,
                data,
                with_headers(exchange.headers, exchange.info.upstream_headers),  # e.g. a DP rank pinned
                # no pooled connection it may have closed
                keep_alive=engines.get(upstream.record.engine).capabilities.keeps_connections,
            )
        except ConnectFailed as exc:  # no connection: nothing sent, the next replica may take it
            attempt.ok = False  # the caller trips the circuit
            raise Unreachable(str(exc)) from exc
        except Disconnected as exc:
            attempt.failed(exc)
            raise Failed(f"{attempt.name} dropped the connection before answering ({exc})", engine_died=True) from exc
        upstream.served += 1
        verdict = judge(answer.status, exchange.inference)  # (its body, read later, may say the engine died)
        if verdict is Verdict.OK:
            attempt.ok = True
            upstream.breaker.success()
        elif verdict is Verdict.NOT_JUDGED:  # passed on as it is
            attempt.ok = True
            upstream.breaker.release()  # (if this was the half-open probe, the next request probes)
        else:
            attempt.failed()
        return answer

    async def _whole_answer(
        self, exchange: Exchange, attempt: _Attempt, answer: Answer, headers: dict
    ) -> web.StreamResponse:
        """An answer that is not an event stream (or a 5xx): read whole, then passed on or failed."""
        try:
            body = await answer.read()
        except Disconnected as exc:
            attempt.failed(exc)
            raise Failed(f"{attempt.name} broke off its answer ({exc})", engine_died=True) from exc
        reply = web.Response(status=answer.status, body=body, headers=headers)
        if not attempt.ok:
            upstream = attempt.upstream
            marker = engines.get(upstream.record.engine).dead_engine_marker
            verdict = judge(answer.status, exchange.inference, body, marker)
            if verdict is Verdict.KEY_REFUSED:  # never passed on: the key was the router's, not the client's
                exchange.key_refusals += 1
                log.warning(
                    "%s refused the router's engine key (401) during a request of %r", attempt.name, exchange.model
                )
                raise Failed(f"{attempt.name} refused the router's engine key (401)")
            if exchange.response is None:
                exchange.last_answer = reply  # returned as is when no other replica can take it
            death = await engine_death(self._clients.session, upstream, verdict)
            if death:
                attempt.upstream.breaker.trip(time.monotonic())
                log.warning(
                    "%s answered %d and %s during a request of %r", attempt.name, answer.status, death, exchange.model
                )
                raise Failed(f"{attempt.name} answered {answer.status} ({death})", engine_died=True)
            raise Failed(f"{attempt.name} answered {answer.status}")
        if exchange.response is not None:  # a stream's continuation was refused (a 4xx)
            message = f"{attempt.name} refused to continue the stream: {body[:500].decode(errors='replace')}"
            await exchange.write(error_event(message, answer.status, "BadRequestError"))
            await exchange.response.write_eof()
            return exchange.response
        exchange.answer_began()
        exchange.sent_bytes += len(body)
        return reply

    async def _relay_stream(
        self, exchange: Exchange, attempt: _Attempt, answer: Answer, headers: dict
    ) -> web.StreamResponse:
        """An event stream, piece by piece to the client (Exchange.relay_piece) until its end or its break."""
        stream = exchange.stream
        if exchange.response is None:
            await exchange.begin_stream(web.StreamResponse(status=answer.status, headers=headers))
            exchange.fingerprint = attempt.upstream.record.fingerprint
        try:
            await answer.relay(exchange.relay_piece, exchange.drain)
        except Disconnected as exc:  # the replica broke off mid-stream (a client gone raises in drain)
            attempt.failed(exc)
            if stream is None:  # not an OpenAI event stream: cut off as it is, the client's connection closed
                log.warning("%s broke off its answer (%s)", attempt.name, exc)
                exchange.client.close()  # (so the answer is not ended as if it were whole)
                return exchange.response
            return await self._broken_stream(exchange, f"{attempt.name} broke off the stream ({exc})")
        if stream is not None and not stream.done:  # the connection closed before the stream's end
            attempt.failed()
            return await self._broken_stream(exchange, f"{attempt.name} closed the stream before its end")
        await exchange.response.write_eof()
        return exchange.response

    async def _broken_stream(self, exchange: Exchange, reason: str) -> web.StreamResponse:
        """A replica's stream broke off: finish it, hand it to another replica (raise Failed), or end it with
        an error event."""
        stream, response = exchange.stream, exchange.response
        if stream.finished:  # every token is there: only the end was lost
            if not stream.done:
                await exchange.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        if not stream.sent_events:  # the client has nothing of it yet: send it again as it was
            raise Failed(reason, engine_died=True)
        if stream.can_resume():
            remaining = stream.remaining_tokens()
            if remaining is not None and remaining <= 0:  # it broke off after its last token
                await exchange.write(stream.finish_events() + b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            if exchange.engine_deaths < RETRIES_AFTER_ENGINE_DEATH:
                self._counters.resumed += 1
            raise Failed(reason + "; resuming it", engine_died=True)
        await exchange.write(error_event(f"{reason}; this request's stream cannot be resumed elsewhere"))
        await response.write_eof()
        return response
