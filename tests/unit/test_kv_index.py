"""The router's index of the engines' KV-cache blocks (flagscale/router/kv_index.py) and the block keys it is
looked up with (flagscale/router/kv_keys.py): the keys equal the engine's own, computed by vLLM's code."""

from __future__ import annotations

import random
import types
from array import array

import pytest

from flagscale.router.kv_index import APPLIED, DUPLICATE, GAP, RESTARTED, KVIndex, ReplicaIndex, block_key
from flagscale.router.kv_keys import BlockHasher, BoundedMemo, KeyChain, PromptTokens


def stored(hashes, medium=None, block_size=4):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes, medium=None):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(ts, *events):
    return [ts, list(events), 0]


def test_store_remove_clear_and_depth_by_medium():
    index = ReplicaIndex()
    assert index.apply(0, batch(1.0, stored([1, 2, 3])), now=0) == APPLIED
    assert index.depth([1, 2, 3, 4]) == (3, 3) and index.block_size == 4
    index.apply(1, batch(2.0, removed([2]), stored([2], medium="CPU")), now=0)
    assert index.depth([1, 2, 3]) == (1, 3)  # block 2 moved to the CPU tier; 3 is held past it
    index.apply(2, batch(3.0, {"type": "AllBlocksCleared"}), now=0)
    assert index.blocks == 0 and index.depth([1]) == (0, 0) and index.cleared == 1


def test_a_gap_asks_a_replay_and_the_replay_fills_it_without_doubles():
    index = ReplicaIndex()
    index.apply(0, batch(1.0, stored([1])), now=0)
    assert index.apply(3, batch(4.0, stored([4])), now=0) == GAP  # 1 and 2 missed: nothing applied
    assert index.last_seq == 0 and index.gaps == 1
    results = [
        index.apply(seq, b, now=0, replaying=True)
        for seq, b in [
            (0, batch(1.0, stored([1]))),
            (1, batch(2.0, stored([2]))),
            (2, batch(3.0, stored([3]))),
            (3, batch(4.0, stored([4]))),
        ]
    ]
    assert results == [DUPLICATE, APPLIED, APPLIED, APPLIED]
    assert index.apply(3, batch(4.0, stored([4])), now=0) == DUPLICATE  # the stream's copy after the replay
    assert index.depth([1, 2, 3, 4]) == (4, 4) and index.lost == 0


def test_a_replay_that_no_longer_has_the_missing_batches_counts_them_lost():
    index = ReplicaIndex()
    index.apply(0, batch(1.0, stored([1])), now=0)
    assert index.apply(5, batch(6.0, stored([6])), now=0, replaying=True) == APPLIED
    assert index.lost == 4


def test_a_new_publisher_restarts_the_index():
    index = ReplicaIndex()
    for seq in range(3):
        index.apply(seq, batch(1.0 + seq, stored([seq])), now=0)
    assert index.apply(0, batch(1.0, stored([0])), now=0) == DUPLICATE  # an old batch again, not a restart
    assert index.apply(0, batch(10.0, stored([9])), now=0) == RESTARTED  # sequence 0, later stamp: new engine
    assert index.blocks == 0 and index.last_seq == -1 and index.restarts == 1
    assert index.apply(0, batch(10.0, stored([9])), now=0, replaying=True) == APPLIED
    assert index.depth([9]) == (1, 1)


def test_memory_is_bounded_by_blocks_oldest_first():
    index = ReplicaIndex(max_blocks=3)
    index.apply(0, batch(1.0, stored([1, 2, 3, 4, 5])), now=0)
    assert index.blocks == 3 and index.evicted == 2 and index.depth([3, 4, 5]) == (3, 3)
    assert 0 < index.memory_bytes() < 10_000


def test_a_replica_sent_work_that_publishes_nothing_is_not_live():
    index = ReplicaIndex()
    index.synced = True
    index.expect(now=100.0)
    assert index.live(now=110.0) and not index.live(now=120.0)
    assert index.stats(120.0)["state"] == "silent"
    index.apply(0, batch(1.0, stored([1])), now=121.0)
    assert index.live(now=121.0)


def test_a_replica_that_leaves_is_forgotten():
    index = KVIndex()
    index.follow("r1").apply(0, batch(1.0, stored([1])), now=0)
    index.follow("r2")
    assert index.depths([1], ["r1", "r2"]) == {"r1": (1, 1), "r2": (0, 0)}
    index.forget("r1")
    assert index.depths([1], ["r1", "r2"]) == {"r2": (0, 0)}


def test_byte_hashes_are_cut_as_the_engine_cuts_them():
    digest = bytes(range(32))
    assert block_key(digest) == int.from_bytes(digest, "big") & (2**64 - 1) == int.from_bytes(digest[-8:], "big")


# ---- the keys: equal to vLLM's own ----------------------------------------------------------------------------


def _vllm_keys(algo, tokens, block_size, lora=None, salt=None):
    """vLLM's own block hashes of a request (its get_request_block_hasher over a request with these fields), cut
    as its events carry them."""
    from vllm.utils.hashing import get_hash_fn_by_name  # the engine's code is what the router must agree with
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    request = types.SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=[],
        prompt_embeds=None,
        lora_request=types.SimpleNamespace(lora_name=lora[0], lora_path=lora[1]) if lora else None,
        cache_salt=salt,
    )
    hashes = kv_cache_utils.get_request_block_hasher(block_size, fn)(request)
    return [block_key(h) for h in hashes]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize(
    "lora, salt",
    [(None, None), (("sql", "/adapters/sql"), None), (None, "tenant-7"), (("sql", "/adapters/sql"), "tenant-7")],
)
def test_block_keys_equal_vllms_own(algo, lora, salt, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(1000, 1000 + 70))
    ours = BlockHasher(algo, "vllm-none-hash").keys(tokens, 16, lora=lora, cache_salt=salt)
    assert len(ours) == 4 and ours == _vllm_keys(algo, tokens, 16, lora, salt)
    assert ours != BlockHasher(algo, "vllm-none-hash").keys(tokens, 16, lora=("other", "/x"), cache_salt="other")


def test_a_shared_seed_gives_the_engines_keys(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    tokens = list(range(64))
    assert BlockHasher("sha256", "12345").keys(tokens, 16) == _vllm_keys("sha256", tokens, 16)


def test_a_bounded_memo_drops_the_least_recently_used_entries_past_its_bytes():
    memo = BoundedMemo(30, lambda key, value: len(key[0]) + value)
    for name in ("a", "b", "c"):
        memo.put((name * 5,), 5)  # 10 bytes each: full
    assert memo.get(("aaaaa",)) == 5  # used: now the most recent
    memo.put(("ddddd",), 5)  # past 30: the least recently used ("b") dropped, not all of them
    assert memo.keys() == [("ccccc",), ("aaaaa",), ("ddddd",)] and memo.bytes == 30
    memo.put(("e" * 15,), 0)  # a larger one drops as many as it takes
    assert memo.keys() == [("ddddd",), ("e" * 15,)] and memo.bytes == 25


def test_the_block_hash_memo_keeps_to_its_bound_and_a_dropped_block_hashes_alike(monkeypatch):
    from flagscale.router import kv_keys

    monkeypatch.setattr(kv_keys, "MAX_SEEN_BYTES", 8 * (16 * 4 + kv_keys.ENTRY_BYTES))  # 8 blocks of 16 tokens
    monkeypatch.setattr(kv_keys, "MIN_RUN_BLOCKS", 10**6)  # block by block
    hasher = BlockHasher("sha256", "seed")
    first = hasher.keys(list(range(64)), 16)  # 4 blocks remembered
    hasher.keys(list(range(100, 164)), 16)  # 4 more: full
    hasher.keys(list(range(200, 232)), 16)  # 2 more: the first prompt's 2 oldest dropped
    assert len(hasher._seen) == 8 and hasher._seen.bytes <= kv_keys.MAX_SEEN_BYTES
    remembered = {key[1] for key in hasher._seen.keys()}
    assert all(array("I", range(base, base + 16)).tobytes() in remembered for base in (100, 116, 132, 148))
    assert hasher.keys(list(range(64)), 16) == first  # a dropped block hashes to the same key again


def _chunkwise(hasher, tokens, step, lora=None, salt=None, as_array=False):
    """The keys of `tokens` extended `step` tokens at a time, as a prompt keyed a chunk of text at a time is."""
    chain = KeyChain(hasher, 16, lora, salt)
    for end in range(step, len(tokens) + step, step):
        chain.extend(array("I", tokens[:end]) if as_array else tokens[:end])
    return chain.keys


@pytest.mark.parametrize("lora, salt", [(None, None), (("sql", "/a"), None), (None, "tenant-7")])
def test_a_prefix_keyed_again_is_keyed_by_runs_to_the_same_keys(lora, salt):
    rng = random.Random(3)
    shared = [rng.randrange(70_000) for _ in range(400)]
    first, second = shared + [1] * 200, shared + [2] * 200
    hasher = BlockHasher("sha256", "seed")
    assert _chunkwise(hasher, first, 100, lora, salt) == BlockHasher("sha256", "seed").keys(first, 16, lora, salt)
    chained, calls = hasher.chained, []
    hasher.chained = lambda *args: calls.append(args) or chained(*args)
    keys = _chunkwise(hasher, second, 100, lora, salt, as_array=True)
    assert keys == BlockHasher("sha256", "seed").keys(second, 16, lora, salt)
    # the shared 25 blocks came from the runs remembered (a salted first block apart): a loop turn for each block
    # after them only
    assert len(calls) == len(second) // 16 - len(shared) // 16 + (1 if salt else 0)
    # the same tokens under another adapter: other keys, not the runs remembered
    other = BlockHasher("sha256", "seed").keys(first, 16, ("other", "/o"), salt)
    assert _chunkwise(hasher, first, 100, ("other", "/o"), salt) == other != keys


def test_ids_that_are_no_uint32_are_keyed_block_by_block():
    tokens = [2**40 + i for i in range(100)]
    assert _chunkwise(BlockHasher("sha256", "s"), tokens, 50) == BlockHasher("sha256", "s").keys(tokens, 16)


def test_the_run_memo_keeps_to_its_bound(monkeypatch):
    from flagscale.router import kv_keys

    monkeypatch.setattr(kv_keys, "MAX_RUN_BYTES", 3 * (64 * 4 + 36 * 4 + kv_keys.ENTRY_BYTES))  # three 4-block runs
    hasher = BlockHasher("sha256", "seed")
    prompts = [list(range(base, base + 64)) for base in (0, 1000, 2000, 3000)]
    for tokens in prompts:
        hasher.keys(tokens, 16)
    assert len(hasher._runs) == 3 and hasher._runs.bytes <= kv_keys.MAX_RUN_BYTES
    assert hasher.keys(prompts[0], 16) == BlockHasher("sha256", "seed").keys(prompts[0], 16)  # dropped: rehashed


# SGLang 0.5.17's own page hash (sglang/srt/mem_cache/cpp_utils/native_hash.py's extension, built once from its
# wheel) over these tokens at page 16, as its events carry the keys: the digest's first 8 bytes as a signed int64
SGLANG_TOKENS = [(i * 7919 + 13) % 151000 for i in range(100)]
SGLANG_EVENT_KEYS = [
    5552345643374291582, -3809777323661071939, 1463172484546428797,
    -161716427167505629, -5775152521939569630, 7431844167528157737,
]  # fmt: skip


def test_sglang_page_keys_equal_sglangs_own_and_index_as_its_events_carry_them():
    ours = BlockHasher("sglang_sha256", "").keys(SGLANG_TOKENS, 16)
    assert ours == [block_key(key) for key in SGLANG_EVENT_KEYS]  # full pages only (the radix cache's)
    index = ReplicaIndex()
    batch = [0.0, [{"type": "BlockStored", "block_hashes": SGLANG_EVENT_KEYS[:4], "block_size": 16, "medium": "GPU"}]]
    index.apply(0, batch, 0.0)
    assert index.depth(ours) == (4, 4)
    # no extra keys in SGLang's hash: an adapter's or a salted request's pages key as the base model's
    assert BlockHasher("sglang_sha256", "").keys(SGLANG_TOKENS, 16, lora=("sql", "/a"), cache_salt="t") == ours


def test_demo_tokens_as_the_engine_tokenizes_them(demo_model_path):
    """Completion and chat prompts tokenized by the router equal what vLLM's server tokenizes: transformers'
    tokenizer and chat template, which vLLM applies (add_special_tokens: true for completions, false for chat)."""
    from transformers import AutoTokenizer  # the reference: what vLLM's server tokenizes with

    reference = AutoTokenizer.from_pretrained(str(demo_model_path))
    ours = PromptTokens(str(demo_model_path))
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    assert ours.of({"prompt": prompt}, 32768) == (reference.encode(prompt), False)
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.of({"messages": messages}, 32768) == (reference.encode(rendered, add_special_tokens=False), False)
    assert ours.of({"prompt": [5, 6, 7]}, 32768) == ([5, 6, 7], False)
    assert ours.of({"prompt": prompt}, 100)[1] is True  # cut: the caller drops its last block


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
        {"prompt": ["a", "b"]},
        {"prompt": "a", "suffix": "b"},
    ],
)
def test_requests_not_keyed_exactly_are_left_to_the_table(body, demo_model_path):
    assert PromptTokens(str(demo_model_path)).of(body, 32768) is None
