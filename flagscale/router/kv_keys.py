"""A request's KV-cache block keys, computed as its engine computes them (docs/routing.md, "The same keys as the
engine"), so the router can look them up in the engines' own block index (kv_index.py).

Two steps, each as the engine does it, from what the replica's record says (EngineKind.kv_events_launch):
- tokens: the model's own tokenizer (`tokenizer.json`, through the `tokenizers` library: no transformers, no
  torch in the router) and its chat template (rendered with Jinja2's sandbox as transformers renders it: trimmed
  blocks, the special tokens as variables); completions' prompt with the special tokens, chat's rendered
  conversation without (the OpenAI server's `add_special_tokens` defaults);
- keys: the engine's prefix-cache hash chained over full blocks of `block_size` tokens: hash((parent, the block's
  tokens, extra keys)), the first block's parent the hash of the seed; the extra keys are the LoRA adapter
  (every block) and the request's `cache_salt` (the first block); each hash cut to 64 bits as the events carry it.

A request it cannot key exactly (content parts, tools, a template of the request's own, a batch of prompts, ...)
gets None: the policy then routes it on the approximate table (counted).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flagscale.adaptors import cbor2, huggingface_hub, jinja2_sandbox, tokenizers
from flagscale.router.kv_index import block_key
from flagscale.router.token_prefixes import TokenPrefixes

# request fields that change what the engine's template renders or tokenizes in ways not repeated here
CHAT_FIELDS_NOT_KEYED = ("tools", "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs")
COMPLETION_FIELDS_NOT_KEYED = ("truncate_prompt_tokens", "prompt_embeds", "suffix")


def _pickle_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_sha256(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _sglang_page(item: tuple) -> bytes:
    """SGLang's page hash: sha256 over the parent page's digest (empty for the first page) and the page's token ids
    as little-endian uint32 (flagscale/engines/sglang_kv_events.py); extra keys are not hashed."""
    parent, tokens, _ = item
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


@dataclass(frozen=True)
class HashScheme:
    """An engine's block hash: of (parent digest, the block's token ids, extra keys); the first block's parent from
    the seed; and the key its events carry, from a digest."""

    block: Callable[[tuple], bytes]
    first_parent: Callable[[str], bytes]
    key: Callable[[bytes], int]


SCHEMES: dict[str, HashScheme] = {
    "sha256": HashScheme(_pickle_sha256, _pickle_sha256, block_key),
    "sha256_cbor": HashScheme(_cbor_sha256, _cbor_sha256, block_key),
    "sglang_sha256": HashScheme(_sglang_page, lambda _seed: b"", lambda digest: int.from_bytes(digest[:8], "big")),
}
# The hasher's memos, each an LRU bounded by what its entries hold (tokens as uint32 bytes, keys, and the
# dict's own share per entry, measured with psutil: ~230 bytes); per model, so a router's keying holds at most
# TokenPrefixes' 16 MB of tokens and these
MAX_SEEN_BYTES = 48 << 20  # block hashes: ~170k blocks of 16 tokens, ~65k of 128
MAX_RUN_BYTES = 32 << 20  # runs of blocks
ENTRY_BYTES = 230
MIN_RUN_BLOCKS = 4  # the blocks one extend of a prompt's keys adds: a run this long or longer is remembered ...
MAX_RUN_TOKENS = 4096  # ... up to this many tokens (a chunk of text is ~300; a whole prompt keyed at once is not)


class BoundedMemo:
    """A map from keys to what they cost to compute, least recently used dropped first beyond `max_bytes` as
    `size(key, value)` counts them; the router's loop and its executor threads key prompts at once."""

    def __init__(self, max_bytes: int, size: Callable[[tuple, Any], int]):
        self.max_bytes, self._size = max_bytes, size
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)  # in use: stays; one-off prompts' entries go first
            return value

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self.bytes += self._size(key, value)
            while self.bytes > self.max_bytes:
                dropped = self._items.popitem(last=False)
                self.bytes -= self._size(*dropped)

    def keys(self) -> list[tuple]:
        with self._lock:
            return list(self._items)


def _packed(tokens: Sequence[int]) -> bytes | tuple:
    """Tokens as a memo keys them: uint32 bytes (4 a token), or a tuple of an id that does not fit."""
    if isinstance(tokens, array):
        return tokens.tobytes()
    try:
        return array("I", tokens).tobytes()
    except OverflowError:
        return tuple(tokens)


class BlockHasher:
    """The engine's block hash chain for one hash function and seed."""

    def __init__(self, algo: str, seed: str):
        if algo not in SCHEMES:
            raise ValueError(f"block hash {algo!r} is not one the router computes ({', '.join(SCHEMES)})")
        scheme = SCHEMES[algo]
        self.hash, self.key = scheme.block, scheme.key
        self.none_hash = scheme.first_parent(seed)
        # (parent, block tokens, extra keys) -> its hash: a prefix seen before is hashed by lookups (a dict lookup
        # costs a tenth of pickling and sha256 it)
        self._seen = BoundedMemo(MAX_SEEN_BYTES, lambda key, _: len(key[1]) + ENTRY_BYTES)
        # (parent, the tokens of a run of blocks, block size, LoRA) -> (the run's last hash, its keys): a prompt is
        # keyed a chunk of text at a time (token_prefixes.py), so a long prefix seen before comes as the same runs,
        # each keyed by one lookup rather than a lookup per block
        self._runs = BoundedMemo(MAX_RUN_BYTES, lambda key, value: len(key[1]) + 36 * len(value[1]) + ENTRY_BYTES)

    def keys(
        self,
        tokens: list[int],
        block_size: int,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The keys of every full block of `tokens` (at most `max_blocks`), as the index holds them."""
        chain = KeyChain(self, block_size, lora, cache_salt)
        chain.extend(tokens, max_blocks)
        return chain.keys

    def chained(self, parent: bytes, block: Sequence[int], extra: tuple | None) -> bytes:
        """The hash of a block whose parent hash is `parent`."""
        item = (parent, _packed(block), extra)
        known = self._seen.get(item)
        if known is None:
            known = self.hash((parent, tuple(block), extra))
            self._seen.put(item, known)
        return known

    def run(self, item: tuple) -> tuple[bytes, tuple[int, ...]] | None:
        """A run of blocks keyed before: (its last block's hash, its keys), or None."""
        return self._runs.get(item)

    def remember_run(self, item: tuple, known: tuple[bytes, tuple[int, ...]]) -> None:
        self._runs.put(item, known)


class KeyChain:
    """The block keys of one prompt, extended as more of its tokens are known (a prompt keyed a chunk at a time
    is hashed once, block by block)."""

    def __init__(self, hasher: BlockHasher, block_size: int, lora: tuple[str, str] | None, cache_salt: str | None):
        self.hasher, self.block_size = hasher, block_size
        self._lora = [("lora", *lora)] if lora else []
        self._lora_key = tuple(lora) if lora else None
        self._salt = cache_salt
        self._parent = hasher.none_hash
        self.keys: list[int] = []

    def extend(self, tokens: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """Hash the full blocks of `tokens` (the prompt's tokens so far; at most `max_blocks`) not hashed yet;
        their keys (also appended to self.keys). The blocks one call adds are a run the hasher may know."""
        first = len(self.keys)
        count = (
            len(tokens) // self.block_size if max_blocks is None else min(max_blocks, len(tokens) // self.block_size)
        )
        start = first
        if start == 0 < count and self._salt:  # the salt is hashed into the first block only
            self._extend_block(tokens, 0)
            start = 1
        if MIN_RUN_BLOCKS <= count - start and (count - start) * self.block_size <= MAX_RUN_TOKENS:
            self._extend_run(tokens, start, count)
        for i in range(len(self.keys), count):
            self._extend_block(tokens, i)
        return self.keys[first:]

    def _extend_run(self, tokens: Sequence[int], start: int, end: int) -> None:
        size = self.block_size
        item = (self._parent, _packed(tokens[start * size : end * size]), size, self._lora_key)
        known = self.hasher.run(item)
        if known is None:
            for i in range(start, end):
                self._extend_block(tokens, i)
            self.hasher.remember_run(item, (self._parent, tuple(self.keys[start:end])))
        else:
            self._parent, keys = known
            self.keys += keys

    def _extend_block(self, tokens: Sequence[int], i: int) -> None:
        size = self.block_size
        extra = self._lora + ([("cache_salt", self._salt)] if i == 0 and self._salt else [])
        self._parent = self.hasher.chained(
            self._parent, tokens[i * size : (i + 1) * size], tuple(extra) if extra else None
        )
        self.keys.append(self.hasher.key(self._parent))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an added token's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptTokens:
    """A model's tokenizer and chat template, loaded from its directory (or the hub's cache of it)."""

    def __init__(self, source: str, revision: str | None = None, chat_template: str | None = None):
        self.source = source
        self.tokenizer = tokenizers.Tokenizer.from_file(str(self._file("tokenizer.json", revision)))
        config_path = self._file("tokenizer_config.json", revision, required=False)
        config = json.loads(config_path.read_text()) if config_path else {}
        self.special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
            if (text := _token_text(config.get(name))) is not None
        }
        template = self._template(chat_template, config, revision)
        self.template = self._environment().from_string(template) if template else None
        # a prompt's already-seen chunks are not tokenized again (token_prefixes.py)
        self.prefixes = TokenPrefixes(lambda text, special: self.tokenizer.encode(text, add_special_tokens=special).ids)

    def _file(self, name: str, revision: str | None, required: bool = True) -> Path | None:
        local = Path(self.source) / name
        if local.exists():
            return local
        if Path(self.source).is_dir():
            if required:
                raise FileNotFoundError(f"{local} does not exist")
            return None
        try:
            return Path(huggingface_hub.hf_hub_download(self.source, name, revision=revision))
        except Exception:
            if required:
                raise
            return None

    def _template(self, given: str | None, config: dict, revision: str | None) -> str | None:
        if given:  # the engine's --chat-template: a file, or the template itself
            return Path(given).read_text() if os.path.exists(given) else given
        own = self._file("chat_template.jinja", revision, required=False)
        if own is not None:
            return own.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    @staticmethod
    def _environment():
        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = jinja2_sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env

    def of(self, body: dict[str, Any], max_chars: int) -> tuple[list[int], bool] | None:
        """The request's prompt tokens (of at most its first `max_chars` characters) and whether they were cut
        there; None when this request cannot be tokenized as the engine would."""
        source = self._source(body)
        if source is None or isinstance(source, list):
            return None if source is None else (source[: max_chars // 2], False)
        text, special = source
        return self.prefixes.encode(text[:max_chars], special), len(text) > max_chars

    def growing(self, body: dict[str, Any], max_chars: int) -> Iterator[tuple[Sequence[int], float, bool]] | None:
        """The request's prompt tokens as they grow a chunk at a time (TokenPrefixes.growing): (the tokens so
        far, the share of the prompt's first `max_chars` characters they cover, whether the prompt was cut
        there); None when it cannot be tokenized as the engine would."""
        source = self._source(body)
        if source is None or isinstance(source, list):
            return None if source is None else iter([(source[: max_chars // 2], 1.0, False)])
        text, special = source
        kept, cut = text[:max_chars], len(text) > max_chars
        return ((ids, end / max(len(kept), 1), cut) for ids, end in self.prefixes.growing(kept, special))

    def _source(self, body: dict[str, Any]) -> tuple[str, bool] | list[int] | None:
        """What the engine tokenizes: (the text, whether with the special tokens), or the token ids as sent."""
        messages = body.get("messages")
        if messages is not None:
            text = self._rendered(body, messages)
            special = body.get("add_special_tokens", False)
        else:
            text, special = self._prompt(body), body.get("add_special_tokens", True)
            if isinstance(text, list):
                return text
        if text is None or not isinstance(special, bool):
            return None
        return text, special

    def _rendered(self, body: dict[str, Any], messages: Any) -> str | None:
        if self.template is None or any(body.get(name) is not None for name in CHAT_FIELDS_NOT_KEYED):
            return None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            return None  # content parts, tool calls, ...: the engine's own message parsing decides those
        generation = body.get("add_generation_prompt", True)
        if not isinstance(generation, bool) or body.get("continue_final_message"):
            return None
        try:
            return self.template.render(
                messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=generation,
                tools=None,
                documents=None,
                **self.special,
            )
        except Exception:  # a template that refuses the conversation: the engine answers it, the table routes it
            return None

    @staticmethod
    def _prompt(body: dict[str, Any]) -> str | list[int] | None:
        if any(body.get(name) is not None for name in COMPLETION_FIELDS_NOT_KEYED):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return None
