"""The engines' own KV-cache events, followed by this router process (docs/routing.md, "The engines' own KV
events"): one subscription per replica whose record names a publisher (EngineKind.kv_events_launch), feeding
that replica's index (kv_index.py); the `cache_aware` policies of models routed on them ask `match` for each
request and tell `sent` where it went. A replica of several data-parallel engines publishes a stream per rank:
each is followed into an index of its own, and a request sent there is pinned to one rank (kv_ranks.py).

Each router process subscribes itself (ZMQ PUB/SUB; the engine's PUB socket serves any number of subscribers), so
KV state needs no gossip between router processes. A new subscription first asks the replica's replay endpoint
for every batch it still buffers (a router that restarts rebuilds its index before routing on it), and so does a
sequence gap or a new publisher on the stream. A replica that leaves, or whose record names another publisher
(its engine restarted), has its entries dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flagscale.adaptors import msgspec_msgpack, zmq, zmq_asyncio
from flagscale.router.kv_index import GAP, RESTARTED, KVIndex, ReplicaIndex
from flagscale.router.kv_keys import BlockHasher, KeyChain, PromptTokens
from flagscale.router.kv_ranks import RANK_HEADER, RankLoad, parts, pick_rank, ranks_stats
from flagscale.router.zmq_subscription import Subscription

log = logging.getLogger("flagscale.router")

REPLAY_TIMEOUT_S = 3.0  # the replay endpoint's silence between two replies that gives up on a replay
RETRY_S = 2.0  # after a failed replay, before the next try
CPU_TIER_WEIGHT = 0.5  # a block on the CPU tier counts this much of one on the GPU (it is copied back first)
OFF_LOOP_CHARS = 8_192  # prompts longer than this are keyed in a thread (prepare), shorter ones when routed
MAX_KEYED_CHARS = 65_536  # only the prompt's first this many characters are tokenized (an 8k-token prompt fits)
END_OF_REPLAY = -1


@dataclass
class Match:
    """What the index says of a request: each replica's reusable depth in blocks (CPU tier weighted), the block
    size in tokens, and the prompt's length in tokens."""

    depths: dict[str, float]
    block_tokens: int
    prompt_tokens: int


class ModelKeys:
    """One model's tokenizer (loaded in a thread: the router's loop never waits for it) and block hasher."""

    def __init__(self, info: dict[str, Any], loop: asyncio.AbstractEventLoop | None):
        self.hasher = BlockHasher(info.get("hash_algo", "sha256"), str(info.get("hash_seed", "")))
        self.tokens: PromptTokens | None = None
        self.failed: str | None = None
        args = (info.get("tokenizer", ""), info.get("tokenizer_revision"), info.get("chat_template"))
        if loop is not None:
            loop.run_in_executor(None, self._load, *args)
        else:
            self._load(*args)

    def _load(self, source: str, revision: str | None, template: str | None) -> None:
        try:
            self.tokens = PromptTokens(source, revision, template)
        except Exception as exc:  # no tokenizer.json (a slow-only tokenizer), the hub unreachable, ...
            self.failed = f"{source}: {exc}"
            log.warning("KV-event routing: cannot load the tokenizer %s; routing on the approximate table", self.failed)


class KVEvents:
    """This router process's subscriptions to the engines' KV events, their index, and the keys of each model."""

    def __init__(self) -> None:
        self.index = KVIndex()
        self.tasks: dict[str, tuple[str, asyncio.Task | None]] = {}  # index id -> (its publisher, follower)
        self.parts: dict[str, list[str]] = {}  # replica id -> the index ids of its ranks' streams, in rank order
        self.rank_loads: dict[str, RankLoad] = {}  # a DP rank's index id -> what this router pinned there
        self.keys: dict[str, ModelKeys] = {}  # by the tokenizer source of the records
        self.model_keys: dict[str, ModelKeys] = {}  # model -> its keys
        self.model_replicas: dict[str, set[str]] = {}  # model -> the index ids of its replicas followed
        # a LoRA adapter's served name -> (name, path), as the records list them (`loras` of their kv_events): a
        # request for it is keyed with the adapter, as the engine keys its blocks
        self.loras: dict[str, tuple[str, str]] = {}
        self.fallbacks: Counter[tuple[str, str]] = Counter()  # (model, why) -> requests routed on the table
        self.metrics: Any = None  # RouterMetrics, set by the router (predicted hits, fallbacks)

    # ---- which replicas are followed -----------------------------------------------------------------------

    def sync(
        self,
        records_by_model: dict[str, Iterable[Any]],
        policies: dict[str, Any],
        prefill: tuple[dict[str, Iterable[Any]], dict[str, Any]] = ({}, {}),
    ) -> None:
        """The replica table changed: follow the publishers of the replicas of models whose policy routes on KV
        events (and hand those policies this), a stream per DP rank; stop following the rest, drop their entries.
        `prefill`: a disaggregated model's prefill pools (records, policies), followed the same way."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # a router built without its loop (unit tests): no subscriptions
            loop = None
        wanted = self._wanted([(records_by_model, policies), prefill], loop)
        for index_id, (endpoint, task) in list(self.tasks.items()):
            if wanted.get(index_id, {}).get("endpoint") != endpoint:
                if task is not None:
                    task.cancel()
                del self.tasks[index_id]
                self.index.forget(index_id)
                self.rank_loads.pop(index_id, None)
                if self.metrics is not None:
                    with contextlib.suppress(KeyError):  # no batch applied yet: no series
                        self.metrics.kv_last_seq.remove(index_id)
        for index_id, info in wanted.items():
            if index_id not in self.tasks:
                self.index.follow(index_id)
                task = loop.create_task(self._follow(index_id, info)) if loop is not None else None
                self.tasks[index_id] = (info["endpoint"], task)

    def _wanted(
        self, pools: list[tuple[dict[str, Iterable[Any]], dict[str, Any]]], loop: asyncio.AbstractEventLoop | None
    ) -> dict[str, dict]:
        """The streams to follow (index id -> its kv_events info) of each pool (records by model, policies by
        model); self.parts and model_replicas set to them (a model's replicas: those of all its pools)."""
        wanted: dict[str, dict] = {}
        self.parts = {}
        self.model_replicas = {}
        for records_by_model, policies in pools:
            for model, policy in policies.items():
                if not getattr(policy, "uses_kv_events", False):
                    continue
                policy.exact = self
                followed = self.model_replicas.setdefault(model, set())
                for record in records_by_model.get(model, ()):
                    info = record.kv_events
                    if info:
                        streams = parts(record.replica_id, info)
                        wanted.update(streams)
                        self.parts[record.replica_id] = [index_id for index_id, _ in streams]
                        followed.update(self.parts[record.replica_id])
                        self.loras.update({name: (name, path) for name, path in (info.get("loras") or {}).items()})
                        self._keys_of(model, info, loop)
        return wanted

    def _keys_of(self, model: str, info: dict, loop: asyncio.AbstractEventLoop | None) -> None:
        source = repr((info.get("tokenizer"), info.get("chat_template"), info.get("hash_algo"), info.get("hash_seed")))
        keys = self.keys.get(source)
        if keys is None:
            keys = self.keys[source] = ModelKeys(info, loop)
        self.model_keys[model] = keys

    # ---- the policy's questions ------------------------------------------------------------------------------

    def match(self, request: Any, replicas: list[Any], now: float) -> Match | None:
        """How much of the request's prompt each replica holds, by the engines' own events (a replica of DP ranks:
        its deepest rank's, each rank's in memo["kv_rank_depths"]); None when the request goes by the approximate
        table instead (counted by reason)."""
        request.memo.pop("kv_rank_depths", None)
        followed = [u for u in replicas if u.replica_id in self.parts]
        if not followed:
            return None  # replicas that publish nothing (llama.cpp, a user's own publisher): the table, always
        why = self._keys(request, followed, now)
        if why is not None:
            self._fell_back(request.model, why)
            return None
        keys, block_tokens, tokens = request.memo["kv_keys"], request.memo["kv_block"], request.memo["kv_tokens"]
        depths, rank_depths = {}, {}
        for upstream in followed:
            per_rank = [self._depth(index_id, keys) for index_id in self.parts[upstream.replica_id]]
            depths[upstream.replica_id] = max(per_rank)
            if len(per_rank) > 1:
                rank_depths[upstream.replica_id] = per_rank
        request.memo["kv_depths"], request.memo["kv_rank_depths"] = depths, rank_depths
        return Match(depths, block_tokens, tokens)

    def _depth(self, index_id: str, keys: list[int]) -> float:
        on_gpu, anywhere = self.index.replicas[index_id].depth(keys)
        return on_gpu + CPU_TIER_WEIGHT * (anywhere - on_gpu)

    def reset_at(self, replica_id: str) -> float:
        """When the replica's engine cache was last found emptied (any of its ranks'); -inf if never."""
        indexes = self.index.replicas
        return max((indexes[i].reset_at for i in self.parts.get(replica_id, ()) if i in indexes), default=float("-inf"))

    def has_ranks(self, replicas: list[Any]) -> bool:
        """Whether any of these replicas runs several data-parallel engines followed apart."""
        return any(len(self.parts.get(u.replica_id, ())) > 1 for u in replicas)

    def _keys(self, request: Any, followed: list[Any], now: float) -> str | None:
        """The request's block keys into its memo (unless prepare put them there); else why not."""
        index_ids = [index_id for u in followed for index_id in self.parts[u.replica_id]]
        if any(not self.index.replicas[index_id].live(now) for index_id in index_ids):
            return "index not live"
        keys = self.model_keys.get(request.model)
        if keys is None or keys.tokens is None:
            return "no tokenizer" if keys is not None and keys.failed else "tokenizer loading"
        if "kv_keys" not in request.memo and not request.memo.get("kv_unkeyable"):
            made = _keyed(
                keys, request.body, self._block_size(index_ids), self.loras.get(request.model), self._held(index_ids)
            )
            request.memo.update(made or {"kv_unkeyable": True})
        return "not tokenizable" if request.memo.get("kv_unkeyable") else None

    def _held(self, index_ids: Iterable[str]) -> Callable[[int], bool]:
        return _held_by([self.index.replicas[i] for i in index_ids if i in self.index.replicas])

    def _block_size(self, index_ids: Iterable[str]) -> int | None:
        """The block size the engines of these streams store blocks of (from their events), None before any."""
        sizes = (self.index.replicas[i].block_size for i in index_ids if i in self.index.replicas)
        return next((size for size in sizes if size), None)

    async def prepare(self, request: Any, policy: Any) -> None:
        """A long prompt of a model routed on events is keyed in a thread before it is routed, so the router's
        loop goes on meanwhile (a short one is keyed when routed: the thread's hop would cost more)."""
        if getattr(policy, "exact", None) is not self or _chars(request.body) < OFF_LOOP_CHARS:
            return
        keys = self.model_keys.get(request.model)
        if keys is None or keys.tokens is None:
            return
        block = self._block_size(self.model_replicas.get(request.model, ()))
        lora = self.loras.get(request.model)
        held = self._held(self.model_replicas.get(request.model, ()))
        made = await asyncio.get_running_loop().run_in_executor(None, _keyed, keys, request.body, block, lora, held)
        request.memo.update(made or {"kv_unkeyable": True})

    def _fell_back(self, model: str, why: str) -> None:
        self.fallbacks[(model, why)] += 1
        if self.metrics is not None:
            self.metrics.kv_fallbacks.labels(model, why).inc()

    def pin(self, upstream: Any, request: Any, balance_abs_threshold: int, cache_threshold: float) -> None:
        """The request goes to `upstream`: a replica of DP ranks, matched on the events, gets it on the rank
        kv_ranks.pick_rank chooses, by the X-data-parallel-rank header (request.upstream_headers)."""
        request.memo.pop("kv_rank", None)
        depths = request.memo.get("kv_rank_depths", {}).get(upstream.replica_id)
        index_ids = self.parts.get(upstream.replica_id, [])
        if depths is None or len(depths) != len(index_ids):
            return  # the table or the events: vLLM's own balancer picks the rank
        loads = [self.rank_loads.setdefault(index_id, RankLoad()) for index_id in index_ids]
        block, tokens = request.memo["kv_block"], request.memo["kv_tokens"]
        rank = pick_rank(depths, loads, block, tokens, balance_abs_threshold, cache_threshold)
        loads[rank].inflight += 1
        loads[rank].sent += 1
        request.memo["kv_rank"] = index_ids[rank]
        request.upstream_headers[RANK_HEADER] = str(rank)

    def done(self, request: Any) -> None:
        """The request's attempt is over: its rank's in-flight count goes down."""
        load = self.rank_loads.get(request.memo.pop("kv_rank", None) or "")
        if load is not None and load.inflight > 0:
            load.inflight -= 1

    def sent(self, upstream: Any, request: Any, now: float) -> None:
        """The request went to `upstream` (a DP replica: to the rank pinned): the prefix tokens the engine should
        find cached (the router's prediction, beside the engine's own prefix-cache counters on /metrics), and an
        event to expect if it stores new blocks. A DP replica's rank left to vLLM is predicted nothing."""
        index_ids = self.parts.get(upstream.replica_id, [])
        index_id = index_ids[0] if len(index_ids) == 1 else request.memo.get("kv_rank")
        index = self.index.replicas.get(index_id or "")
        keys = request.memo.get("kv_keys")
        if index is None or keys is None:
            return
        block = request.memo["kv_block"]
        on_gpu, _ = index.depth(keys)
        # the engine computes at least the prompt's last token: a prompt of whole blocks reuses one block less
        hits = min(on_gpu, (request.memo["kv_tokens"] - 1) // block) * block
        if self.metrics is not None:
            self.metrics.kv_predicted_hits.labels(request.model, upstream.replica_id).inc(hits)
        if len(keys) > on_gpu:
            index.expect(now)

    def stats(self, replica_id: str) -> dict[str, Any]:
        """The replica's index for status: a DP replica's ranks summed (kv_ranks.ranks_stats)."""
        now = time.monotonic()
        indexes = [self.index.replicas[i] for i in self.parts.get(replica_id, []) if i in self.index.replicas]
        if len(indexes) > 1:
            return {"kv_index": ranks_stats([index.stats(now) for index in indexes])}
        return {"kv_index": indexes[0].stats(now)} if indexes else {}

    # ---- one replica's stream ------------------------------------------------------------------------------

    async def _follow(self, index_id: str, info: dict) -> None:
        index = self.index.replicas[index_id]
        sub = Subscription(zmq_asyncio.Context.instance(), info["endpoint"], info.get("topic", ""))
        try:
            while True:
                if not index.synced:  # subscribed first: what the replay misses, the subscription has
                    if not await self._replay(index, info):
                        await asyncio.sleep(RETRY_S)
                        continue
                    if self.metrics is not None:
                        self.metrics.kv_last_seq.labels(index_id).set(index.last_seq)
                await sub.ready()
                for frames in sub.queued():
                    if len(frames) != 3:
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if index.apply(seq, _decoded(frames[2]), time.monotonic()) in (GAP, RESTARTED):
                        index.synced = False
                        break
                if self.metrics is not None and index.synced:
                    self.metrics.kv_last_seq.labels(index_id).set(index.last_seq)
        except asyncio.CancelledError:
            raise
        except Exception:  # never let a bad stream take the router down: this replica goes by the table
            log.exception(
                "following the KV events of %s failed; its replica is routed on the approximate table", index_id
            )
        finally:
            sub.close()

    @staticmethod
    async def _replay(index: ReplicaIndex, info: dict) -> bool:
        """Every batch the engine still buffers from the index's next sequence on; False when its replay endpoint
        does not answer (bounded by REPLAY_TIMEOUT_S between replies)."""
        dealer = zmq_asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(info["replay_endpoint"])
        began, batches = time.monotonic(), 0
        try:
            await dealer.send_multipart([b"", (index.last_seq + 1).to_bytes(8, "big")])
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    return False
                frames = await dealer.recv_multipart()  # empty delimiter, topic, sequence, batch
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                index.apply(seq, _decoded(frames[3]), time.monotonic(), replaying=True)
                batches += 1
            index.synced = True
            index.replays += 1
            log.info("KV events of %s: replayed %d batches in %.2f s", info["replay_endpoint"], batches,
                     time.monotonic() - began)  # fmt: skip
            return True
        finally:
            dealer.close(linger=0)


def _keyed(
    keys: ModelKeys,
    body: dict[str, Any],
    block: int | None,
    lora: tuple[str, str] | None = None,
    held: Callable[[int], bool] | None = None,
) -> dict[str, Any] | None:
    """A request's memo entries: its prompt's length in tokens and its block keys (none before the engines stored
    any block: nothing can be reused then), `lora` the adapter (name, path) it runs with; None when it cannot be
    tokenized as the engine would. `held(key)`: whether any replica it may go to holds that block. Blocks chain,
    so none after a block no replica holds can be reused anywhere: once a chunk's last block is held nowhere, the
    prompt is tokenized no further (its length in tokens then estimated from the characters left), and a prompt
    never seen costs one chunk. (Only a chunk's last block is asked: an engine evicts a prompt's later blocks
    first, and asking too little only tokenizes further, never keys wrong.)"""
    assert keys.tokens is not None
    growing = keys.tokens.growing(body, MAX_KEYED_CHARS)
    if growing is None:
        return None
    chain = KeyChain(keys.hasher, block, lora, _salt(body)) if block else None
    tokens: Sequence[int] = []
    for tokens, covered, cut in growing:
        if chain is None:
            continue
        # a prompt cut short: its last block may tokenize otherwise
        added = chain.extend(tokens, len(tokens) // block - (1 if cut and covered >= 1 else 0))
        if covered < 1 and held is not None and added and not held(added[-1]):
            return {"kv_tokens": round(len(tokens) / covered), "kv_keys": chain.keys, "kv_block": block}
    return {"kv_tokens": len(tokens), "kv_keys": chain.keys if chain else [], "kv_block": block or 1}


def _held_by(indexes: list[ReplicaIndex]) -> Callable[[int], bool]:
    """Whether any of these indexes holds a block (on any medium)."""
    tables = [hashes for index in indexes for hashes in index.media.values()]
    return lambda key: any(key in hashes for hashes in tables)


def _chars(body: dict[str, Any]) -> int:
    """About how many characters a request's prompt has (its messages' or prompt's text)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(m.get("content") or "") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


def _decoded(payload: bytes) -> Any:
    try:
        return msgspec_msgpack.decode(payload)
    except Exception:  # a batch we cannot read counts as an empty one: the sequence still advances
        return []


def _salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
