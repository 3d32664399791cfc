"""Tokens of prompt prefixes the router has tokenized before (docs/routing.md, "The same keys as the engine").

Keying a request as its engine does means tokenizing its whole prompt, ~6 ms of CPU for 8k tokens here; the
prompts KV routing is for share long prefixes (a system prompt, a growing chat). So the text is cut into chunks
of about CHUNK_CHARS, each cut between a word and the space that begins the next word, where byte-level BPE
tokenizers (GPT-2's and Llama 3's pre-tokenizer regex) never join two pieces into one token: the prompt's tokens
are then its chunks' tokens, one after another, and a chunk whose text and everything before it were seen before
is not tokenized again (an LRU of chunk tokens keyed by a digest of the text up to the chunk's end, bounded in
tokens).

Whether a tokenizer really splits that way is not assumed: the first CHECKS prompts of more than one chunk are
tokenized whole as well and compared; one difference turns the cache off for good (`exact` False: every prompt
tokenized whole), which a tokenizer that joins across spaces (SentencePiece's, a normalizer) or adds a special
token at the end would cause.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator

CHUNK_CHARS = 1024
MAX_TOKENS = 4_000_000  # tokens held in all (4 bytes each)
CHECKS = 16  # prompts of more than one chunk tokenized whole too, before the cache is trusted

Encode = Callable[[str, bool], list[int]]  # (text, add the special tokens) -> token ids


def cuts(text: str, every: int = CHUNK_CHARS) -> list[int]:
    """Where the text is cut: about every `every` characters, before a space that follows a non-space and is
    followed by one (never inside a run of spaces)."""
    out, start = [], every
    while start < len(text):
        at = text.find(" ", start)
        while at != -1 and (text[at - 1].isspace() or at + 1 >= len(text) or text[at + 1].isspace()):
            at = text.find(" ", at + 1)
        if at == -1:
            break
        out.append(at)
        start = at + every
    return out


class TokenPrefixes:
    """`encode(text, special)`: the text's token ids, its already-seen chunks from the cache."""

    def __init__(self, encode: Encode, max_tokens: int = MAX_TOKENS, chunk_chars: int = CHUNK_CHARS):
        self._encode, self._max_tokens, self._chunk_chars = encode, max_tokens, chunk_chars
        self._chunks: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()  # the router's loop and its executor threads key prompts at once
        self.tokens_held = 0
        self.exact = True  # False once a check found the chunked tokens differ from the whole text's
        self.checked = 0
        self.chunks_reused = 0

    def encode(self, text: str, special: bool) -> list[int]:
        positions = cuts(text, self._chunk_chars) if self.exact else []
        if not positions:
            return self._encode(text, special)
        ids: list[int] = []
        for _, chunk in self._chunks_of(text, special, positions):
            ids.extend(chunk)
        if self.checked < CHECKS:
            self._check(text, special, ids)
        return ids if self.exact else self._encode(text, special)

    def growing(self, text: str, special: bool) -> Iterator[tuple[list[int] | array, int]]:
        """The text's tokens as they grow a chunk at a time: (the tokens of text[:end], end) after each chunk, the
        last with end = len(text); a caller that has seen enough stops, and the rest is never tokenized. Until
        the chunked tokens are trusted (CHECKS passed), the whole text at once. The growing tokens are a uint32
        array (chunks are appended as memory, not as a list's ints)."""
        positions = cuts(text, self._chunk_chars) if self.exact and self.checked >= CHECKS else []
        if not positions:
            yield self.encode(text, special), len(text)
            return
        ids = array("I")
        for end, chunk in self._chunks_of(text, special, positions):
            ids.extend(chunk)
            yield ids, end

    def _chunks_of(self, text: str, special: bool, positions: list[int]) -> Iterator[tuple[int, array]]:
        """(end, the tokens of text[start:end]) per chunk, from the cache where the text up to end was seen."""
        digest = hashlib.blake2b(b"special" if special else b"plain", digest_size=16)
        start = 0
        for end in [*positions, len(text)]:
            piece = text[start:end]
            digest.update(piece.encode("utf-8", "surrogatepass"))
            key = digest.digest()
            with self._lock:
                chunk = self._chunks.get(key)
                if chunk is not None:
                    self._chunks.move_to_end(key)
                    self.chunks_reused += 1
            if chunk is None:
                chunk = array("I", self._encode(piece, special and start == 0))
                self._keep(key, chunk)
            yield end, chunk
            start = end

    def _keep(self, key: bytes, chunk: array) -> None:
        with self._lock:
            old = self._chunks.pop(key, None)
            self.tokens_held += len(chunk) - (len(old) if old is not None else 0)
            self._chunks[key] = chunk
            while self.tokens_held > self._max_tokens and self._chunks:
                _, dropped = self._chunks.popitem(last=False)
                self.tokens_held -= len(dropped)

    def _check(self, text: str, special: bool, ids: list[int]) -> None:
        self.checked += 1
        if self._encode(text, special) != ids:
            with self._lock:
                self.exact = False
                self._chunks.clear()
                self.tokens_held = 0
