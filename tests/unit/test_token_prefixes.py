"""Prompt prefixes tokenized once (flagscale/router/token_prefixes.py): the chunked tokens equal the whole text's
for the demo model's byte-level BPE tokenizer, an already-seen prefix is not tokenized again, the cache keeps to
its bound, and a tokenizer that joins across the cut turns it off."""

from __future__ import annotations

import random

import pytest

from flagscale.adaptors import tokenizers
from flagscale.demo_model import ensure_demo_model
from flagscale.router.token_prefixes import CHECKS, TokenPrefixes, cuts

WORDS = "serve engine prefix cache block token router replica event 12345 index, keys: hash (chat) model".split()


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.Tokenizer.from_file(str(ensure_demo_model() / "tokenizer.json"))


def text_of(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("  " if rng.random() < 0.05 else "") for _ in range(words))


def test_cuts_fall_before_a_space_between_two_non_spaces():
    text = "aaaa  bbbb cccc dddd"
    assert cuts(text, every=3) == [10, 15]  # not inside "  " (4, 5): before " cccc" and " dddd"
    assert cuts("short", every=100) == [] and cuts("nospacesatall" * 10, every=5) == []
    text = text_of(1, 3000)
    for at in cuts(text):
        assert text[at] == " " and not text[at - 1].isspace() and not text[at + 1].isspace()


def test_chunked_tokens_equal_the_whole_texts(tokenizer):
    calls = []

    def encode(text: str, special: bool) -> list[int]:
        calls.append(len(text))
        return tokenizer.encode(text, add_special_tokens=special).ids

    prefixes = TokenPrefixes(encode, chunk_chars=256)
    shared = text_of(2, 600)
    for i in range(CHECKS + 4):
        prompt = f"{shared} question {i}: {text_of(100 + i, 40)}"
        for special in (True, False):
            assert prefixes.encode(prompt, special) == tokenizer.encode(prompt, add_special_tokens=special).ids
    assert prefixes.exact and prefixes.checked == CHECKS and prefixes.chunks_reused > 0
    # past the checks, a prompt whose prefix was seen is tokenized only past it
    calls.clear()
    prompt = f"{shared} one more question: {text_of(999, 40)}"
    assert prefixes.encode(prompt, True) == tokenizer.encode(prompt).ids
    assert sum(calls) < len(prompt) / 3, calls


def test_the_cache_keeps_to_its_bound(tokenizer):
    prefixes = TokenPrefixes(
        lambda t, s: tokenizer.encode(t, add_special_tokens=s).ids, max_tokens=2000, chunk_chars=64
    )
    for seed in range(40):
        prefixes.encode(text_of(seed, 200), False)
    assert 0 < prefixes.tokens_held <= 2000
    assert prefixes.tokens_held == sum(len(chunk) for chunk in prefixes._chunks.values())


def test_a_tokenizer_that_joins_across_the_cut_turns_the_cache_off():
    def joining(text: str, special: bool) -> list[int]:  # one token per pair of characters: cuts shift the pairs
        return [hash(text[i : i + 2]) % 1000 for i in range(0, len(text), 2)]

    prefixes = TokenPrefixes(joining, chunk_chars=5)
    text = "abc defgh ij klmno pq"
    assert prefixes.encode(text, False) == joining(text, False)
    assert not prefixes.exact and prefixes.tokens_held == 0
    assert prefixes.encode(text + " more", False) == joining(text + " more", False)  # whole from now on
